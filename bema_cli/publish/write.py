"""Writing the chosen model as DIR itself: weights, config, tokenizer, bema.json and a card, so
`from_pretrained(DIR)`, `vllm serve DIR` and `hf upload DIR` find the weights at the top.

The folder is built beside DIR (a hidden `.bema-tmp-*` sibling) and renamed into place at the end:
DIR appears whole or not at all. Every model is written from its coefficient vector by one writer
(`write_vector`: fit.combined's float64 sums, cast once), whatever was chosen: vanilla, a config of
the menu (its vector from its settings: candidate.py) or a fitted average.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from bema_cli import card, output
from bema_cli.errors import InputError, OutputError, UsageError
from bema_cli.eval.targets import SWEEP_SCHEME
from bema_cli.io.checkpoints import run_of
from bema_cli.io.commit import check_apart

WORK = ".bema-ship"  # ship's records inside the model folder it wrote (push never uploads .bema-*)


STAGING = re.compile(r"^\.bema-tmp-(ship|write|old)-(\d+)-(.+)$")  # kind, pid, the OUT it stages


def staging(out: Path, what: str) -> Path:
    """A fresh hidden folder beside `out` (same file system: the final rename is atomic), named for
    this process and this OUT alone: `.bema-tmp-<what>-<pid>-<OUT's name>`."""
    tmp = out.parent / f".bema-tmp-{what}-{os.getpid()}-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def check_apart_from(out: Path, inputs: list[Path], flag: str) -> None:
    """DIR, the work folder beside it (`.DIR.bema-ship`) must not be, contain or lie inside an input
    (the run, a checkpoint, the base, a file the command reads), with or without --overwrite: a
    shipped model replaces DIR, so DIR == base would lose the base."""
    for path in (out, out.parent / f".{out.name}.bema-ship"):
        check_apart(path, inputs, flag=flag)


def check_out_path(out: Path, flag: str) -> None:
    """What makes a DIR impossible to place, said before any work (exit 4): a file where a folder of
    its path must be (`--out FILE/model`), or the folder the command runs in, or one holding it (`--out .`:
    DIR is replaced whole by a rename, which the current folder cannot take part in)."""
    full = Path(os.path.abspath(out))
    for parent in [full, *full.parents]:
        if parent.exists() and not parent.is_dir():
            where = "is a file" if parent == full else f"lies under {parent}, a file"
            raise OutputError(f"{flag} {out}: {where}, not a folder; choose a folder path")
    here = Path.cwd()
    if here == full or here.is_relative_to(full):
        raise OutputError(
            f"{flag} {out}: is the folder this command runs in (or holds it); DIR is replaced whole, so "
            "run bema from outside it (cd ..)"
        )


def clean_staging(out: Path, work: Path | None = None) -> None:
    """Remove the staging folders a killed writer of `out` left (a SIGKILL runs no cleanup): the
    `.bema-tmp-<kind>-<pid>-<OUT's name>` siblings of `out` whose OUT is exactly `out` and whose
    process is gone. An old DIR set aside by a killed `place` comes back when DIR is missing."""
    for tmp in out.parent.glob(".bema-tmp-*") if out.parent.is_dir() else []:
        got = STAGING.match(tmp.name)
        if got is None or got.group(3) != out.name or _alive(int(got.group(2))) or tmp.is_symlink():
            continue
        if got.group(1) == "old" and not out.exists():
            tmp.rename(out)  # killed between place()'s two renames: the old DIR comes back
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_target(out: Path, overwrite: bool) -> None:
    """DIR must be new, or (with --overwrite) a model folder bema wrote; nothing else is replaced."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise OutputError(f"{out}: already exists (use --overwrite to replace it, or choose another folder)")
    if not (out / "bema.json").is_file():
        raise OutputError(f"{out}: exists and is not a model folder bema wrote (no bema.json); not replaced")


def place(folder: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished `folder` to `out`; an old `out` (checked by check_target) goes only after.
    --overwrite replaces only what bema wrote: the user's own files in the old `out` are carried
    into the new one, and said."""
    check_target(out, overwrite)
    from bema_cli.io.aux_files import carry, users_files

    theirs = users_files(out, skip=(WORK,)) if out.is_dir() else []
    if theirs:
        carry(out, folder, theirs)
        output.log(
            f"{out}: kept {len(theirs)} file(s) bema did not write: {', '.join(theirs[:5])}"
            + (" ..." if len(theirs) > 5 else "")
        )
    old = None
    if out.exists():
        old = out.parent / f".bema-tmp-old-{os.getpid()}-{out.name}"
        out.rename(old)
    folder.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def source_of(winner: dict, records: list[dict]) -> tuple[Path, str | None, dict]:
    """(the checkpoint the winner's step came from, theta0's folder or Hub id, its stabilizer settings)."""
    from bema_cli.io import provenance
    from bema_cli.io.provenance import find_input

    stab = dict(winner.get("stabilizer") or {"method": "vanilla"})
    if str(winner["path"] or "").startswith(SWEEP_SCHEME):  # evaluated by `bema sweep`, never on disk
        raw = [r for r in records if r.get("run") == "vanilla" and r.get("step") == winner["step"]]
        if not raw:
            raise InputError(
                f"{winner['path']}: no vanilla record at step {winner['step']} names the checkpoint it came from"
            )
        source, base = _found(raw[-1]["model_path"], records), stab.get("theta0_source")
    elif ((path := _found(winner["path"] or "", records)) / "bema.json").is_file():  # a stabilize output
        record = json.loads((path / "bema.json").read_text())
        inputs = provenance.read(path).get("inputs") or {}
        found = find_input(record["source_checkpoint"], [path], inputs.get(str(winner["step"])))
        if found is None:
            raise InputError(
                f"{path}: its source checkpoint {record['source_checkpoint']} is not found near it; "
                "writing it needs it (and its run)"
            )
        source, base = found, record.get("theta0_source")
    else:  # a vanilla checkpoint of the run itself; theta0 is the evaluated base, when there was one
        source, stab = path, {"method": "vanilla"}
        base = next((r.get("model_path") for r in records if r.get("is_base")), None)
    if stab.get("method") == "vanilla":  # theta_s itself: theta0 only has to exist; the run's is named
        base = base or next(
            (t for r in records if (t := (r.get("stabilizer") or {}).get("theta0_source"))), "first"
        )
    if not source.is_dir():
        raise InputError(
            f"{source}: the winner's source checkpoint is gone; writing it needs it (and its run)"
        )
    return source, theta0_folder(base, records, source), stab


def _found(name: str, records: list[dict]) -> Path:
    """A model the records name (provenance.record_name), found again near the results that name it."""
    from bema_cli.io.provenance import find_input

    found = find_input(name, _near(records), None) if name else None
    return found if found is not None else Path(name)


def _near(records: list[dict]) -> list[Path]:
    """The folders of the results files the records were read from (report.read_records)."""
    return [Path(f) for f in dict.fromkeys(r.get("_folder") for r in records) if f]


def theta0_folder(name: str | None, records: list[dict], source: Path) -> str | None:
    """theta0 as a record names it (provenance.input_name), found again near the results and the run,
    else the name as it is (a Hub id, or "first")."""
    from bema_cli.io.provenance import find_input

    if not name or name == "first" or Path(name).is_absolute():
        return name
    found = find_input(name, [*_near(records), run_of(source)], None)
    return str(found) if found is not None else name


def model_record(
    cand, step: int, settings: dict, folders: dict[str, Path], base_source: str, out: Path, **extra
) -> dict:
    """bema.json (and the header's record) of a model written from a vector: the candidate's method
    and settings (`settings`: a menu config's stabilizer keys, or {"method": ...}), its step, its
    coefficients keyed by "theta0" and step (the one record shape), and what they were read from,
    named (provenance.input_name), never by absolute local paths."""
    from bema_cli import __version__
    from bema_cli.eval.targets import STABILIZER_KEYS
    from bema_cli.io import provenance

    skip = ("accum_dtype", "out_dtype", "theta0_source")
    params = {k: settings[k] for k in STABILIZER_KEYS if k in settings and k not in skip}
    return {
        "bema_version": __version__,
        "run": cand.name,
        "written_from": "vector",  # one sum of its coefficients (verify rebuilds it so), not a walk
        **params,
        "step": step,
        "coefficients": cand.record,
        "averaged_steps": cand.steps(),
        "source_checkpoint": provenance.input_name(folders[str(step)], out),
        "theta0_source": provenance.input_name(base_source, out),
        "accum_dtype": "float64",
        "out_dtype": "input",
        **extra,
    }


def write_vector(cand, folders: dict[str, Path], template: Path, out: Path, record: dict) -> Path:
    """The one writer of a model from a vector: sum_j c_j theta_j (fit.combined: float64 sums, cast
    once to the template checkpoint's dtypes) through the sharded writer into `out`, the header
    carrying `record`, the inputs' fingerprints and the coefficients, each keyed by "theta0" and step;
    the template's side files (config, tokenizer, chat template: io/aux_files, a local path in them
    written as a name) and bema.json beside the weights. The side files' digests join the record
    (`files`), so verify checks them with the tensors."""
    from bema_cli.decide.fit import combined
    from bema_cli.io import provenance
    from bema_cli.io.aux_files import copy_aux_files, digests
    from bema_cli.io.reader import open_checkpoint
    from bema_cli.io.writer import MAX_SHARD_SIZE, ShardedWriter, plan_shards, tensor_bytes

    out.mkdir(parents=True, exist_ok=True)
    record = {**record, "files": digests(out, copy_aux_files(out, [template]))}
    keys = [k for k, _ in cand.vector]
    terms = [(folders[k], c) for k, c in cand.vector]
    tensors = list(open_checkpoint(template).tensors.values())
    inputs = {k: provenance.input_print(folders[k]) for k in keys}
    meta = {"format": "pt", **provenance.metadata(record, inputs, cand.record)}
    writer = ShardedWriter(out, plan_shards(tensors, MAX_SHARD_SIZE), meta).open()
    with writer.held():
        for info, value in combined(terms, template):
            writer.write(info.name, 0, tensor_bytes(value))
    writer.close()
    (out / "bema.json").write_text(output.to_json(record) + "\n")
    return out


def evaluation_rows(doc: dict, value: float, interval, versus: dict | None) -> list[dict]:
    """The card's evaluation table of `select --write`: the winner on the metric (a ship's card
    renders its Decision's rows: outcome.Decision.card_rows)."""
    from bema_cli.decide.verdict import fmt_diff

    vs = f"vs vanilla {fmt_diff(versus)}" if versus else ""
    return [{"dataset": doc["task"], "metric": doc["metric"], "value": value, "interval": interval, "vs": vs}]


def write_card(
    folder: Path,
    evaluation: list[dict],
    base_source: str,
    base_dir: Path | None,
    why: str,
    notes: list[str] | None = None,
) -> None:
    """The card of a model written from a vector; its Hub base from theta0 as it was read
    (`base_source`: a Hub id or the local folder `base_dir`), not from the record's name for it;
    `why`: the verdict that chose it, as the command said it."""
    record = json.loads((folder / "bema.json").read_text())
    base_model = card.hub_base_model(base_source, base_dir)
    text = card.card(record, base_model, evaluation=evaluation, selected=True, why=why, notes=notes)
    (folder / "README.md").write_text(text)


def write_winner(doc: dict, records: list[dict], out: Path, overwrite: bool = False) -> dict:
    """The winner of a `select` document written as `out` itself, with its card: its vector (computed
    from its record's settings on its run) through the one writer, as ship writes."""
    from bema_cli.decide.candidate import of_settings

    w = doc["winner"]
    source, base, stab = source_of(w, records)
    inputs = [run_of(source), source, *([Path(base)] if base and Path(base).expanduser().is_dir() else [])]
    check_out_path(out, "--write")
    check_apart_from(out, inputs, "--write")
    if out.is_symlink():  # place() would replace the link by a folder
        raise UsageError(f"--write {out}: a symbolic link (to {os.readlink(out)}); give the folder itself")
    check_target(out, overwrite)
    cand, folders, base_source = of_settings(w["run"], stab, source, base, w["step"])
    tmp = staging(out, "write")
    try:
        folder = tmp / "model"
        record = model_record(cand, w["step"], stab, folders, base_source, out)
        write_vector(cand, folders, Path(source), folder, record)
        rows = evaluation_rows(doc, w["value"], w["interval"], w["vs_vanilla"])
        write_card(folder, rows, base_source, folders.get("theta0"), doc["verdict"], doc.get("notes"))
        place(folder, out, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    output.log(f"wrote {out} ({w['run']} at step {w['step']}) with its model card")
    return {"path": str(out), "run": w["run"], "step": w["step"]}
