"""Writing the chosen model as DIR itself: weights, config, tokenizer, bema.json and a card, so
`from_pretrained(DIR)`, `vllm serve DIR` and `hf upload DIR` find the weights at the top.

The folder is built beside DIR (a hidden `.bema-tmp-*` sibling) and renamed into place at the end:
DIR appears whole or not at all. The weights come from the streaming stabilize engine (bitwise what
`bema stabilize --steps STEP` writes for that config) or, for a fitted average, from fit.py's
streaming linear combination.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from bema_cli import card, output
from bema_cli.errors import InputError, OutputError
from bema_cli.eval.targets import SWEEP_SCHEME
from bema_cli.io.checkpoints import run_of
from bema_cli.io.commit import check_apart

WORK = ".bema-ship"  # ship's records inside the model folder it wrote (push never uploads .bema-*)


def staging(out: Path, what: str) -> Path:
    """A fresh hidden folder beside `out` (same file system: the final rename is atomic)."""
    tmp = out.parent / f".bema-tmp-{what}-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def check_apart_from(out: Path, inputs: list[Path], flag: str) -> None:
    """DIR, the work folder beside it (`.DIR.bema-ship`) and the staging siblings must not be, contain
    or lie inside an input (the run, a checkpoint, the base), with or without --overwrite: a shipped
    model replaces DIR, so DIR == base would lose the base."""
    for path in (out, out.parent / f".{out.name}.bema-ship", out.parent / f".bema-tmp-ship-{out.name}"):
        check_apart(path, inputs, flag=flag)


def clean_staging(out: Path, work: Path | None = None) -> None:
    """Remove the staging folders a killed writer of `out` left (a SIGKILL runs no cleanup): the
    `.bema-tmp-*-DIR-<pid>` siblings of `out` and the fitted candidates' in `work`, each only when its
    process is gone."""
    places = [(out.parent, f".bema-tmp-*-{out.name}-*")]
    if work is not None:
        places.append((work / "fit" / "models", ".bema-tmp-fit-*"))
    for folder, pattern in places:
        for tmp in folder.glob(pattern) if folder.is_dir() else []:
            pid = tmp.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            if tmp.name.startswith(".bema-tmp-old-") and not out.exists():
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
    """Rename the finished `folder` to `out`; an old `out` (checked by check_target) goes only after."""
    check_target(out, overwrite)
    old = None
    if out.exists():
        old = out.parent / f".bema-tmp-old-{out.name}-{os.getpid()}"
        out.rename(old)
    folder.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def source_of(winner: dict, records: list[dict]) -> tuple[Path, str | None, dict]:
    """(the checkpoint the winner's step came from, theta0's source, its stabilizer settings)."""
    path = Path(winner["path"] or "")
    stab = dict(winner.get("stabilizer") or {"method": "vanilla"})
    if str(winner["path"] or "").startswith(SWEEP_SCHEME):  # evaluated by `bema sweep`, never on disk
        raw = [r for r in records if r.get("run") == "vanilla" and r.get("step") == winner["step"]]
        if not raw:
            raise InputError(
                f"{winner['path']}: no vanilla record at step {winner['step']} names the checkpoint it came from"
            )
        source, base = Path(raw[-1]["model_path"]), stab.get("theta0_source")
    elif (path / "bema.json").is_file():
        record = json.loads((path / "bema.json").read_text())
        source, base = Path(record["source_checkpoint"]), record.get("theta0_source")
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
    return source, base, stab


def _number(value):
    return float(value) if value in ("inf", "-inf") else value


def stabilized(
    winner: dict, records: list[dict], tmp: Path, allow_gaps: bool = False, durations=None
) -> Path:
    """The winner at its step written by the streaming stabilize engine under `tmp`; its folder.
    `allow_gaps`: the run's missing checkpoints are passed over, as the decision passed over them
    (and the record says so)."""
    source, base, stab = source_of(winner, records)
    return _stabilize_one(source, base, stab, winner["step"], tmp, allow_gaps=allow_gaps, durations=durations)


def rebuild_average(record: dict, tmp: Path) -> Path:
    """An output of `bema stabilize` written again from its bema.json record (`bema verify`): the
    same settings, step, theta0, accumulation and output dtypes, gaps allowed as they were."""
    out_dtype = record.get("out_dtype") if record.get("out_dtype") not in (None, "mixed", "input") else None
    return _stabilize_one(Path(record["source_checkpoint"]), record.get("theta0_source"), record,
                          int(record["step"]), tmp, out_dtype=out_dtype,
                          allow_gaps=bool(record.get("allow_gaps")))  # fmt: skip


def stabilizer_params(stab: dict) -> dict:
    """A record's stabilizer settings as schedule.Schedule takes them."""
    names = {"schedule": "merge_schedule"}
    keys = ("method", "preset", "kappa", "eta", "gamma", "rho", "tau", "phi", "beta_min", "window",
            "schedule", "swa_start", "sigma_rel", "power_gamma")  # fmt: skip
    params = {names.get(k, k): _number(stab[k]) for k in keys if stab.get(k) is not None}
    if params.get("sigma_rel") is not None:
        params.pop("power_gamma", None)  # derived from sigma_rel, as on the command line
    return params


def _stabilize_one(source: Path, base, stab: dict, step: int, tmp: Path, **more) -> Path:
    from bema_cli.schedule import Schedule
    from bema_cli.stabilize import Options, stabilize

    params = stabilizer_params(stab)
    if not source.is_dir():
        raise InputError(f"{source}: the source checkpoint is gone; rebuilding needs it (and its run)")
    opts = Options(
        checkpoint_dir=str(run_of(source)), schedules=[Schedule(**params).resolved()], out=str(tmp / "out"),
        base=base, steps=[step], accum_dtype=stab.get("accum_dtype", "float32"), no_state=True, **more,
    )  # fmt: skip
    result = stabilize(opts)
    (written,) = [o for o in result["outputs"] if o["step"] == step]
    return Path(written["path"])


def model_record(
    cand, step: int, settings: dict, folders: dict[str, Path], base_source: str, **extra
) -> dict:
    """bema.json (and the header's record) of a model written from a vector: the candidate's method
    and settings (`settings`: a menu config's stabilizer keys, or {"method": ...}), its step, its
    coefficients keyed by "theta0" and step (the one record shape), and what they were read from."""
    from bema_cli import __version__
    from bema_cli.eval.targets import STABILIZER_KEYS

    skip = ("accum_dtype", "out_dtype", "theta0_source")
    params = {k: settings[k] for k in STABILIZER_KEYS if k in settings and k not in skip}
    return {
        "bema_version": __version__, "run": cand.name, **params, "step": step, "coefficients": cand.record,
        "averaged_steps": cand.steps(), "source_checkpoint": str(folders[str(step)]), "theta0_source": base_source,
        "accum_dtype": "float64", "out_dtype": "input", **extra,
    }  # fmt: skip


def write_vector(cand, folders: dict[str, Path], template: Path, out: Path, record: dict) -> Path:
    """The one writer of a model from a vector: sum_j c_j theta_j (fit.combined: float64 sums, cast
    once to the template checkpoint's dtypes) through the sharded writer into `out`, the header
    carrying `record`, the inputs' fingerprints and the coefficients, each keyed by "theta0" and step;
    the template's small files (config, tokenizer) and bema.json beside the weights."""
    from bema_cli.decide.fit import SMALL_FILES, combined
    from bema_cli.io import provenance
    from bema_cli.io.reader import open_checkpoint
    from bema_cli.io.writer import ShardedWriter, plan_shards, tensor_bytes

    keys = [k for k, _ in cand.vector]
    terms = [(folders[k], c) for k, c in cand.vector]
    tensors = list(open_checkpoint(template).tensors.values())
    inputs = {k: provenance.input_print(folders[k]) for k in keys}
    meta = {"format": "pt", **provenance.metadata(record, inputs, cand.record)}
    writer = ShardedWriter(out, plan_shards(tensors, 5 * 10**9), meta).open()
    with writer.held():
        for info, value in combined(terms, template):
            writer.write(info.name, 0, tensor_bytes(value))
    writer.close()
    for name in SMALL_FILES:
        if (template / name).is_file():
            shutil.copy2(template / name, out / name)
    (out / "bema.json").write_text(output.to_json(record) + "\n")
    return out


def evaluation_rows(doc: dict, value: float, interval, versus: dict | None) -> list[dict]:
    from bema_cli.decide.verdict import fmt_diff

    return [{"dataset": doc["task"], "metric": doc["metric"], "value": value, "interval": interval,
             "vs": f"vs vanilla {fmt_diff(versus)}" if versus else ""}]  # fmt: skip


def write_card(folder: Path, doc: dict, evaluation: list[dict], paths: str) -> None:
    record = json.loads((folder / "bema.json").read_text())
    base_model = card.hub_base_model(record["theta0_source"], None)
    text = card.card(record, base_model, evaluation=evaluation, paths=paths, selected=True)
    (folder / "README.md").write_text(text)


def write_winner(
    doc: dict,
    records: list[dict],
    out: Path,
    paths: str = "short",
    overwrite: bool = False,
    keep=None,
    allow_gaps: bool = False,
    durations: dict | None = None,
) -> dict:
    """The winner of a `select` document written as `out` itself, with its card; `keep(folder)` is
    called before the final rename (ship moves its records into the folder there)."""
    source, base, _ = source_of(doc["winner"], records)
    inputs = [run_of(source), source, *([Path(base)] if base and Path(base).expanduser().is_dir() else [])]
    check_apart_from(out, inputs, "--write" if keep is None else "--out")
    check_target(out, overwrite)
    tmp = staging(out, "write")
    try:
        folder = stabilized(doc["winner"], records, tmp, allow_gaps, durations)
        w = doc["winner"]
        write_card(folder, doc, evaluation_rows(doc, w["value"], w["interval"], w["vs_vanilla"]), paths)
        if keep is not None:
            keep(folder)
        place(folder, out, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    output.log(f"wrote {out} ({doc['winner']['run']} at step {doc['winner']['step']}) with its model card")
    return {"path": str(out), "run": doc["winner"]["run"], "step": doc["winner"]["step"]}
