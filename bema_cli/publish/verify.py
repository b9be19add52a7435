"""`bema verify DIR`: rebuild a model bema wrote from the provenance inside its weights
(io/provenance.py) and the inputs it names, and say bitwise which tensors differ.

A model written from a vector (ship, select --write) is rebuilt tensor by tensor in memory, as
write.write_vector summed it (fit.combined), and compared as it streams: nothing is written. An
output of `bema stabilize` is rebuilt in memory too, by the sweep's walker advanced to its step with
the record's settings (bitwise what stabilize writes); only where that walk would not fit in memory,
by the stabilize engine in a private temporary folder. The stored vector is never trusted: where
the record names a method and its settings, the vector is computed again from them and the steps
(candidate.menu) and a stored vector that differs is said. The inputs' fingerprints are compared
first, so a difference is laid at the right door: an input changed since, or the weights.

The record names its inputs (run/checkpoint-40, a Hub id or models/base), never by absolute local
paths: they are found again near the folder by name and fingerprint (provenance.find_input), or
where --run and --base say they went.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

from bema_cli import card, output
from bema_cli.decide.candidate import THETA0
from bema_cli.errors import InputError, UsageError
from bema_cli.io import provenance
from bema_cli.io.checkpoints import find_checkpoints, run_of, step_of
from bema_cli.schedule import METHODS

TOLERANCE = 1e-9  # a recomputed coefficient against the stored one (both float64 sums of the same terms)


def _run_steps(record: dict) -> dict[str, Path]:
    run = run_of(record["source_checkpoint"])
    try:  # any layout find_checkpoints reads (Megatron-Bridge's: iter_<N>/hf/)
        return {str(c.step): c.path for c in find_checkpoints(run)}
    except InputError:
        return {}


def _input_folders(record: dict, doc: dict) -> dict[str, Path]:
    """The input folders the provenance names, by its `inputs` keys: "theta0", a step, or (a record
    of an older bema) an input folder's path."""
    keys = list(doc.get("inputs", {}))
    by_step = _run_steps(record) if any(k.isdigit() for k in keys) else {}
    run = run_of(record["source_checkpoint"])
    out = {}
    for k in keys:
        if k == THETA0:
            out[k] = Path(record["theta0_source"])
        elif k.isdigit():
            out[k] = by_step.get(k, run / f"checkpoint-{k}")
        else:
            out[k] = Path(k)
    return out


def changed_inputs(record: dict, doc: dict) -> list[str]:
    """Inputs whose fingerprint differs from the one recorded (or that are gone)."""
    out = []
    for key, folder in sorted(_input_folders(record, doc).items()):
        try:
            now = provenance.input_print(folder) if folder.is_dir() else None
        except (OSError, InputError):
            now = None
        if now != doc["inputs"][key]:
            out.append(f"{key} ({folder}: {'changed' if now else 'gone'})")
    return out


def _step(key: str) -> int:
    if key == THETA0:
        return -1
    if key.isdigit():
        return int(key)
    try:
        step = step_of(Path(key))
    except InputError:
        step = None
    return -1 if step is None else step


def recomputed(record: dict, planned=None) -> dict[str, float] | None:
    """The vector the record's method, settings and step give on its run: vanilla is {step: 1} (the
    checkpoint at the record's step, nothing else); None for a fitted average, whose vector is what
    the decision chose (`decided` holds it to that). `planned`: the run as `_plan` planned it (a
    stabilize output's, shared with its walk)."""
    from bema_cli.decide.candidate import menu, of_settings, vanilla

    if record.get("method") == "vanilla":
        return vanilla(int(record["step"])).record
    if record.get("method") not in METHODS:
        return None
    if planned is not None:
        (cand,) = [c for key, c in menu(planned[0], int(record["step"])).items() if key != "vanilla"]
        return cand.record
    source = Path(record["source_checkpoint"])
    if not source.is_dir():
        raise InputError(f"{source}: the source checkpoint is gone; verifying needs it (and its run)")
    try:
        cand, _, _ = of_settings(
            record.get("run", ""),
            record,
            source,
            record.get("theta0_source"),
            int(record["step"]),
            bool(record.get("allow_gaps")),
        )
    except UsageError as exc:  # settings no command line could give: the record was edited
        raise InputError(f"{source}: the record's settings are not valid ({exc})") from None
    return cand.record


def decided(folder: Path, record: dict) -> dict[str, float] | None:
    """The vector the ship's sealed decision (DIR/.bema-ship/ship.json) says was written: vanilla's at
    its step, a fit's as the search found it (None: no ship record, or a menu config, which its
    method recomputes)."""
    from bema_cli.decide.candidate import vanilla
    from bema_cli.publish.records import check_sealed
    from bema_cli.publish.write import WORK

    path = folder / WORK / "ship.json"
    if not path.is_file():
        return None
    check_sealed(path.parent, "verify holds a shipped model to its decision as bema sealed it")
    doc = json.loads(path.read_text())
    decision = doc.get("decision") or {}
    if decision.get("kind") == "vanilla":
        return vanilla(int(decision["step"])).record
    if decision.get("kind") == "fitted":
        return ((doc.get("fitted") or {}).get("best") or {}).get("coefficients")
    return None


def side_files(folder: Path, record: dict) -> tuple[list[str], list[str]]:
    """(side files that differ from the digests the record holds, or that it does not name; side
    files present that no digest covers, as written by an older bema: not checked)."""
    from bema_cli.io.aux_files import AUX_PATTERNS, digests

    present = sorted({f.name for pattern in AUX_PATTERNS for f in folder.glob(pattern) if f.is_file()})
    recorded = record.get("files")  # a model written from a vector (ship, select --write) holds them
    if not isinstance(recorded, dict):
        return [], present
    now = digests(folder, [n for n in recorded if (folder / n).is_file()])
    differ = [n for n in sorted(recorded) if now.get(n) != recorded[n]]
    return differ + [n for n in present if n not in recorded], []


def _vector_differs(stored: dict | None, again: dict | None) -> list[str]:
    if again is None or stored is None:
        return []
    keys = sorted(set(stored) | set(again), key=_step)
    return [
        k for k in keys if not math.isclose(float(stored.get(k, 0.0)), again.get(k, 0.0), abs_tol=TOLERANCE)
    ]


def _compare(folder: Path, rebuilt) -> tuple[int, list[str]]:
    """(tensors in `folder`, names that differ bitwise from `rebuilt`'s (name, tensor) stream)."""
    import torch
    from safetensors import safe_open

    mine = {n: f for f in sorted(folder.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()}
    seen, differ = set(), []
    for name, y in rebuilt:
        seen.add(name)
        if name not in mine:
            differ.append(name)
            continue
        with safe_open(str(mine[name]), "pt") as a:
            x = a.get_tensor(name)
        same = x.dtype == y.dtype and x.shape == y.shape
        if not same or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            differ.append(name)
    return len(mine), sorted(differ + sorted(set(mine) - seen))


def _from_vector(record: dict, doc: dict):
    """(name, tensor) of the model the record's coefficients describe, summed as write_vector did."""
    from bema_cli.decide.fit import combined

    folders = _input_folders(record, {"inputs": dict.fromkeys(record["coefficients"])})
    keys = sorted(
        record["coefficients"], key=lambda k: (k != THETA0, _step(k), k)
    )  # the order it was summed in
    terms = []
    for k in keys:
        if not folders[k].is_dir():
            raise InputError(f"{folders[k]}: an input of this average is not a local folder (gone?)")
        terms.append((folders[k], float(record["coefficients"][k])))
    template = Path(record["source_checkpoint"])
    if not template.is_dir():
        raise InputError(f"{template}: the source checkpoint is gone; rebuilding needs it (and its run)")
    return ((info.name, value) for info, value in combined(terms, template))


def _out_dtype(record: dict) -> str | None:
    """--out-dtype as the output was made with it (None: each tensor kept its input dtype)."""
    return record.get("out_dtype") if record.get("out_dtype") not in (None, "mixed", "input") else None


WALK_SHARE = 0.5  # of the memory available: a model whose walk fits is rebuilt in memory


def _plan(record: dict):
    """A stabilize output's run planned once, as the sweep's walker walks it with the record's
    settings: (the plan, its options). Its vector (`recomputed`) and its walk (`_from_walk`) share it."""
    from bema_cli.decide.candidate import record_options
    from bema_cli.sweep.walk import plan_sweep, sweep_options

    source = Path(record["source_checkpoint"])
    if not source.is_dir():
        raise InputError(f"{source}: the source checkpoint is gone; verifying needs it (and its run)")
    try:
        opts = sweep_options(
            record_options(record, source, None, record.get("theta0_source"), out_dtype=_out_dtype(record))
        )
        return plan_sweep(opts), opts
    except UsageError as exc:  # settings no command line could give: the record was edited
        raise InputError(f"{source}: the record's settings are not valid ({exc})") from None


def _from_walk(record: dict, planned):
    """(name, tensor) of a `bema stabilize` output rebuilt in memory, nothing written: the sweep's
    walker advanced to the step with the record's settings (`planned`: `_plan`'s) gives, tensor for
    tensor, what stabilize writes (tests/test_sweep.py holds them bitwise equal), and None; or None
    and why the walk cannot make it (a LoRA run's output, a walk that would not fit in memory)."""
    from bema_cli.machine import available_memory

    plan, opts = planned
    held = 4 + sum(
        len(t.names) if not t.window else t.ring for t in plan.tracks
    )  # theta, theta0, out, blocks
    if plan.lora is not None:
        return None, "a LoRA run's output: the walk makes full models only"
    if plan.base_index.nbytes * 2 * held > WALK_SHARE * available_memory():
        return None, "the walk in memory would not fit"
    return _walk(plan, opts, int(record["step"])), None


def _walk(plan, opts, step: int):
    from bema_cli.sweep.walk import Walker, walk_to

    walker = Walker(plan, opts)
    try:
        for _ in walk_to(plan, step, walker.advance, walker.finish):
            pass
        yield from walker.weights(plan.runs[0].name)
    finally:
        walker.close()


def _from_stabilize(record: dict, folder: Path):
    """(name, tensor) of the record's output written again by `bema stabilize` (its settings, step,
    theta0, accumulation and output dtypes, gaps allowed, a LoRA adapter's rank, as they were) in a
    private temporary folder: a LoRA run's output, or a model whose walk in memory would not fit."""
    from safetensors import safe_open

    from bema_cli.decide.candidate import record_options
    from bema_cli.stabilize import Output, stabilize

    source = Path(record["source_checkpoint"])
    lora = record.get("lora") if isinstance(record.get("lora"), dict) else {}  # an adapter's: output, rank
    out_dtype = None if lora.get("output") == "adapter" else _out_dtype(record)  # an adapter keeps its own
    tmp = Path(tempfile.mkdtemp(prefix="bema-verify-"))
    try:
        opts = record_options(
            record,
            source,
            tmp / "out",
            record.get("theta0_source"),
            steps=[int(record["step"])],
            out_dtype=out_dtype,
            write=Output(no_state=True, lora_output=lora.get("output", "merged"), lora_rank=lora.get("rank")),
        )
        with output.muted():  # its warnings (a LoRA rank's truncation) were said when it was made
            made = stabilize(opts)["outputs"]
        (again,) = [Path(o["path"]) for o in made if o["step"] == int(record["step"])]
        for f in sorted(again.glob("*.safetensors")):
            with safe_open(str(f), "pt") as b:
                for name in b.keys():
                    yield name, b.get_tensor(name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def located(record: dict, doc: dict, folder: Path, run: Path | None, base: str | None) -> dict:
    """The record with its inputs' names replaced by their folders now: the source checkpoint under
    `run` (--run) or found near `folder`; theta0 as --base gives it, else found near the folder or
    the run by name and fingerprint, else (a Hub id) from the local Hub cache."""
    from bema_cli.io.checkpoints import resolve_model

    inputs = doc.get("inputs") if isinstance(doc.get("inputs"), dict) else {}
    name, step = record["source_checkpoint"], int(record["step"])
    given = Path(run).expanduser().resolve() if run is not None else None
    if given is not None:  # the run moved: its checkpoint at the record's step
        source = next((c.path for c in find_checkpoints(given) if c.step == step), None)
    else:
        source = provenance.find_input(name, [folder], inputs.get(str(step)))
    if source is None or not source.is_dir():
        raise InputError(
            f"{folder}: its source checkpoint {name} is not found "
            + (
                f"in --run {run}"
                if run is not None
                else "near it (moved?); pass --run RUN (and --base BASE) where they are now"
            )
        )
    out = {**record, "source_checkpoint": str(source)}
    theta0 = record.get("theta0_source")
    if base is not None:
        out["theta0_source"] = str(resolve_model(base).path)
    elif isinstance(theta0, str) and theta0 != "first":
        print_ = inputs.get(THETA0)
        found = provenance.find_input(theta0, [folder], print_)
        if found is None and given is not None:  # moved with the run: in it (checkpoint-0) or beside it
            near = [given / Path(theta0).name, given.parent / Path(theta0).name]
            found = next((f for f in near if f.is_dir() and provenance.input_print(f) == print_), None)
        if found is None and card.REPO_ID.match(theta0):
            try:  # a Hub id: the local cache's copy (as stabilize resolved it)
                found = resolve_model(theta0).path
            except InputError:
                found = None
        if found is None:
            raise InputError(
                f"{folder}: its theta0 {theta0} is not found near it (moved?); pass --base BASE where it is now"
            )
        out["theta0_source"] = str(found)
    return out


def verify(folder: Path, run: Path | None = None, base: str | None = None) -> dict:
    """The --json document: which tensors of `folder` differ bitwise from its rebuild, whether its
    stored vector is the one its method computes, and which inputs changed since it was written.
    `run`/`base` (--run, --base): where the inputs are now, when they moved."""
    folder = Path(folder)
    doc = provenance.read(folder)
    named = doc["record"]
    record = located(named, doc, folder, run, base)
    changed = changed_inputs(record, doc)
    gone = [c for c in changed if c.endswith(": gone)")]
    if gone:  # nothing to rebuild from: exit 3, not "differs"
        raise InputError(f"{folder}: an input it was made from is gone: {gone[0]}")
    stored = doc.get("coefficients")
    from_vector = provenance.written_from(record) == "vector"  # ship, select --write; else stabilize
    averaged = record.get("method") in METHODS and record.get("method") != "vanilla"
    planned = _plan(record) if averaged and not from_vector else None  # a stabilize output: planned once
    vector = _vector_differs(stored, recomputed(record, planned))
    if not vector and _vector_differs(stored, decided(folder, record)):
        vector = ["the shipped decision's vector"]
    files_differ, not_checked = side_files(folder, named)
    rebuilt = "in memory"
    if isinstance(record.get("coefficients"), dict) and record["coefficients"] != stored:
        vector = vector or ["record"]  # bema.json's vector is not the header's
    if from_vector:  # rebuilt in memory
        tensors, differ = _compare(folder, _from_vector(record, doc))
    else:  # a stabilize output: walked in memory where it fits, else rebuilt in a temporary folder
        walked, why = _from_walk(record, planned or _plan(record))
        if walked is None:
            rebuilt = f"in a temporary folder ({why})"
        tensors, differ = _compare(folder, walked if walked is not None else _from_stabilize(record, folder))
    return {
        "folder": str(folder),
        "identical": not differ and not vector and not files_differ,
        "tensors": tensors,
        "differ": differ,
        "files_differ": files_differ,
        "not_checked": not_checked,
        "rebuilt": rebuilt,
        "vector_differs": vector,
        "changed_inputs": changed,
        "record": named,
        "coefficients": stored,
        "bema_version": record.get("bema_version"),
    }
