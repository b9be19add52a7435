"""The `bema stabilize` engine: stream a checkpoint trajectory into stabilized checkpoints.

Tensor-major walk: the model is cut into work units (groups of tensors, or row chunks
of one tensor along dim 0) whose working set fits `max_memory` (see plan.py). For each
unit we read theta0, start one `recurrence.Stabilizer` per distinct state, walk the
trajectory once (each input chunk read once, whatever the grid size) and write that unit
of every output at its final offset. The math lives in recurrence.py; files in bema_cli/io.

`unit.process_unit` is one unit's whole job (a fused, cache-blocked pass per step), so an
executor can run units anywhere that sees the files. The driver (`stabilize`) pre-creates the outputs (headers planned up front) in a
temp folder under OUT, runs the units, writes metadata and commits the folders by renames
(io/commit.py: OUT's lock, the journaled swap, manifest.json).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from bema_cli import __version__, output, stages
from bema_cli.cluster import ExecutorOptions, import_ray
from bema_cli.errors import BemaError, InputError, OutputError, UsageError
from bema_cli.io.commit import TMP_PREFIX, OutputTransaction, check_apart
from bema_cli.io.fingerprint import fingerprint
from bema_cli.io.prefetch import Prefetch, prefetch_bytes
from bema_cli.io.safetensors import ModelIndex
from bema_cli.io.watch import check_unchanged, held_stats, hold_files, release
from bema_cli.io.writer import ShardedWriter
from bema_cli.stabilize import meta, motion, state, state_commit, state_store
from bema_cli.stabilize.executors import run_units
from bema_cli.stabilize.plan import Options, Plan, Run, inputs_of
from bema_cli.stabilize.prepare import prepare, resolve_state
from bema_cli.stabilize.project import choose_device, project, projection_line
from bema_cli.stabilize.unit import read_ranges, unit_bytes
from bema_cli.stabilize.workspace import torch_device


def _out_dir(text: str) -> Path:
    if not text.strip():
        raise UsageError("--out: empty path (name the output folder)")
    return Path(text).expanduser().resolve()


def _up_to_date(opts, executor, last_step, t0: float) -> dict:
    """The --json document of a call with nothing to write (every output already there)."""
    return {
        "outputs": [],
        "read_bytes": 0,
        "written_bytes": 0,
        "state_bytes": 0,
        "executor": {"executor": executor.executor, "workers": executor.workers},
        "up_to_date": True,
        "last_step": last_step,
        "seconds": time.perf_counter() - t0,
        "projection": None,
        "motion": [],
        "motion_verdict": None,
        "stages": stages.report(),
        "device": _idle_device(opts),
    }


def _idle_device(opts: Options) -> dict:
    """`device` of a call with nothing to do (the --json keys of a working run)."""
    return {"asked": opts.device, "device": None, "reason": "nothing to stabilize"}


def _recovered(out: Path, txn: OutputTransaction) -> None:
    if txn.recovered:
        output.log(f"{out}: cleaned up after {len(txn.recovered)} interrupted bema run(s)")
    state_commit.tidy(out)


def _restarted(plan: Plan, opts: Options) -> set[str]:
    """Runs whose folders --restart may replace: those OUT's state knows (others stay protected)."""
    if not opts.write.restart:
        return set()
    known = {r["run"] for r in (plan.resume.stored or {}).get("runs", [])}
    if plan.resume.stored is None:  # an unusable state: bema's own runs, as the manifest lists them
        known = {
            r["run"]
            for r in (meta.read_manifest(Path(opts.out).expanduser().resolve()) or {}).get("runs", [])
        }
    return {r.name for r in plan.runs if r.name in known}


def _check_out(out: Path, runs: list[Run], overwrite: bool, restarted: set[str] = frozenset()) -> None:
    """OUT must be a folder; an existing run folder is replaced only with --overwrite and only when it is
    a bema output (meta.is_bema_run): --overwrite never deletes anything bema did not write.
    A run continued from OUT's state keeps its folder; only its new checkpoint folders must be new."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory")
    old = meta.read_manifest(out) if out.is_dir() else None
    for run in runs:
        folder = out / run.name
        if folder.is_symlink():
            raise OutputError(
                f"{folder}: is a symbolic link; bema only replaces run folders it wrote (remove the link or choose another --out)"
            )
        if run.start is not None:  # continued: the state knows this folder
            for step in run.out_steps:
                if (folder / f"checkpoint-{step}").exists() and not overwrite:
                    raise OutputError(
                        f"{folder / f'checkpoint-{step}'}: already exists and OUT's state does not know it "
                        "(use --overwrite to replace it)"
                    )
            continue
        if folder.exists() and not overwrite and run.name not in restarted:
            if not (out / state.STATE_DIR / state.STATE_FILE).exists() and meta.is_bema_run(folder, old):
                raise OutputError(  # e.g. written with --no-state: nothing to continue from
                    f"{folder}: already exists and OUT has no saved state to continue it from "
                    "(written with --final-only or --no-state, which keep none: pass --state to keep one); "
                    "use --overwrite to recompute it from theta0"
                )
            raise OutputError(f"{folder}: already exists (use --overwrite to replace it)")
        if folder.exists() and not meta.is_bema_run(folder, old):
            raise OutputError(
                f"{folder}: exists and is not a bema output (no manifest entry or bema.json names it); --overwrite only replaces bema outputs"
            )


def stabilize(opts: Options, executor: ExecutorOptions | None = None) -> dict:
    """Run (or with dry_run, only plan) one `bema stabilize`; returns the --json document.

    `executor` says where the work units run (default: in this process). With a persistent
    state in OUT (state.py) only the checkpoints after each run's last processed step are
    read and written; a call with nothing new writes nothing.
    """
    if opts.write is None:
        raise ValueError("stabilize writes: its Options need `write` (plan.Output)")
    t0 = time.perf_counter()
    stages.reset()
    executor = executor or ExecutorOptions()
    dry_run = opts.write.dry_run
    if executor.executor == "ray" and not dry_run:
        import_ray()  # a missing extra is reported before any planning
    out = _out_dir(opts.out)
    if not dry_run and out.is_dir() and any(out.glob(TMP_PREFIX + "*")):
        with OutputTransaction(out) as txn:  # a writer died here: finish its commit first (the state)
            _recovered(out, txn)
    if not dry_run and (out / meta.MANIFEST).is_file():
        reconcile(out)  # outputs deleted by hand leave manifest.json and state.json first
    asked, opts = opts, resolve_state(opts)
    write = opts.write  # no_state decided
    with stages.stage("discover"):
        plan = prepare(opts)
    check_apart(out, inputs_of(plan, opts.checkpoint_dir))
    if write.no_state and not write.overwrite and not dry_run and _already_written(out, plan, opts):
        last = max((c.step for c in plan.checkpoints), default=None)  # a finished --final-only call again
        return _up_to_date(opts, executor, last, t0)
    try:
        _check_out(out, plan.runs, write.overwrite, _restarted(plan, opts))
    except OutputError as exc:
        if not dry_run:
            raise
        output.warn(f"{exc} (a real run would stop here)")
    n_outputs = sum(len(r.out_steps) for r in plan.runs)
    last_step = max((c.step for c in plan.checkpoints), default=None)
    if not plan.read_steps and not n_outputs:  # nothing new since the last call: a working run's keys
        return _up_to_date(opts, executor, last_step, t0)
    # the inputs start coming into the page cache now, beside torch's import (io/prefetch.py); not
    # in a dry run, nor for Ray's workers (other processes, maybe other machines)
    local = not dry_run and executor.executor == "local"
    with Prefetch(read_ranges(plan) if local else [], prefetch_bytes()):
        return _stabilize(opts, asked, plan, out, executor, t0, n_outputs, last_step)


def _stabilize(
    opts: Options,
    asked: Options,
    plan: Plan,
    out: Path,
    executor: ExecutorOptions,
    t0: float,
    n_outputs: int,
    last_step: int | None,
) -> dict:
    """The rest of `stabilize`, from the first need of torch (`asked`: the options before the state
    resolved them)."""
    write = opts.write
    with stages.stage("setup"):  # torch's import (~1-2 s), the probe, the device's start
        # the first check that needs torch, so other errors come first; none in a dry run
        torch_device(opts.device, need_torch=not write.dry_run)
    theta0_bytes = plan.base_index.nbytes if plan.theta0_index is plan.base_index else 0
    read_bytes = theta0_bytes + sum(index.nbytes for index in plan.indexes.values())  # ring re-reads too
    meta0 = {"bema_version": __version__}
    written = n_outputs * ShardedWriter(out, plan.shards, meta0).nbytes  # header sizes differ by a few bytes
    doc = {
        "outputs": meta.outputs_of(plan, out),
        "read_bytes": read_bytes,
        "written_bytes": written,
        "state_bytes": state_store.traffic(plan),
    }
    doc["executor"] = {"executor": executor.executor, "workers": executor.workers}
    doc["up_to_date"], doc["last_step"] = False, last_step
    with stages.stage("setup"):
        doc["projection"] = project(plan, opts, read_bytes, written, out)
        doc["device"] = choose_device(plan, opts, doc["projection"], read_bytes, written)
    if output.progress_enabled() or output.verbose():  # on a terminal; pipes read it from --json
        output.log(projection_line(doc["projection"]))
    if doc["device"]["reason"] != "no CUDA device" or output.progress_enabled() or output.verbose():
        output.log(f"device: {doc['device']['device']} ({doc['device']['reason']})")  # a real choice
    opts = replace(opts, device=doc["device"]["device"])
    if write.dry_run:
        return {
            "dry_run": True,
            **doc,
            "seconds": time.perf_counter() - t0,
            "stages": stages.report(),
            "plan": meta.dry_run_plan(plan, opts),
        }
    with OutputTransaction(out) as txn:  # locks OUT: a second writer is refused here, before any work
        _recovered(out, txn)
        if state.read(out, write.recompute) != plan.resume.stored:
            opts = resolve_state(asked)  # another writer committed between our planning and the lock
            opts = replace(opts, device=doc["device"]["device"])
            plan, write = prepare(opts), opts.write
        _check_out(out, plan.runs, write.overwrite, _restarted(plan, opts))  # again, now that OUT is ours
        # checkpoints rotated away by a trainer mid-read are still read whole (through our handles;
        # Ray workers are other processes: they open the files by name)
        try:
            with hold(
                plan, executor.executor == "local", write.fingerprint == "full", record=not write.no_state
            ):
                doc["written_bytes"], sums = _walk(plan, opts, txn.tmp, executor)
            entries, _, kept = state_commit.stage(plan, opts, txn.tmp)
        except OSError as exc:  # metadata files, state: a full disk names what it was writing
            raise _io_error(exc, txn.tmp) from None
        doc["state_bytes"] += state_commit.written(txn.tmp)
        old = meta.read_manifest(out)
        replaced = [r.name for r in plan.runs if r.start is None and (out / r.name).exists()]
        with stages.stage("commit"):
            txn.commit(
                entries,
                manifest=meta.manifest(plan, old, outputs=kept, out=out),
                interim_manifest=meta.manifest(plan, old, with_new=False) if old and replaced else None,
            )
            state_commit.tidy(out)  # what --keep-last dropped, state folders no run needs any more
    keep = {(r.name, s) for r in plan.runs for s in kept[r.name]}
    doc["outputs"] = [o for o in doc["outputs"] if (o["run"], o["step"]) in keep]
    doc.update(motion.judge(sums, plan.runs))
    doc["seconds"] = time.perf_counter() - t0
    doc["stages"] = stages.report()  # this process's (Ray workers time their own units)
    return doc


def _already_written(out: Path, plan, opts: Options) -> bool:
    """A call without a state (--final-only) whose every output is on disk, as this call would write
    it: the same checkpoints, each bema.json the record this call writes, and written after its
    source checkpoint's files last changed. Re-running a finished command is then "up to date"."""
    import json

    from bema_cli.stabilize.vectors import coefficient_vectors

    out_dtype = meta.out_dtype_name(plan, opts)
    source_of = {c.step: c.path for c in plan.checkpoints}
    vectors = coefficient_vectors(plan) if plan.lora is None else {}
    for run in plan.runs:
        folder = out / run.name
        if not folder.is_dir() or {p.name for p in folder.glob("checkpoint-*")} != {
            f"checkpoint-{s}" for s in run.out_steps
        }:
            return False
        for step in run.out_steps:
            record = folder / f"checkpoint-{step}" / "bema.json"
            try:
                have = json.loads(record.read_text())
                newest = max(p.stat().st_mtime for p in Path(source_of[step]).iterdir())
                fresh = record.stat().st_mtime >= newest
            except (OSError, ValueError, KeyError):
                return False
            want = json.loads(
                output.to_json(
                    meta.record(
                        run,
                        step,
                        source_of[step],
                        plan.base_source,
                        opts,
                        out_dtype,
                        vectors.get((run.name, step)),
                    )
                )
            )
            if not fresh or {k: v for k, v in have.items() if k != "bema_version"} != {
                k: v for k, v in want.items() if k != "bema_version"
            }:
                return False
    return bool(plan.runs)


def reconcile(out: Path) -> None:
    """Outputs deleted by hand since the last call leave manifest.json and state.json (resealed), in
    one commit under OUT's lock, with a warning naming them: the two never list what is not on disk."""
    manifest = meta.read_manifest(out) or {}
    try:
        stored = state.read(out)
    except InputError:
        stored = None  # an unusable state is refused (or recomputed with --restart) by the call itself
    listed = {(r["run"], o["step"]) for r in manifest.get("runs", []) for o in r.get("outputs", [])}
    listed |= {(r["run"], s) for r in (stored or {}).get("runs", []) for s in r["outputs"]}
    gone = sorted(x for x in listed if not (out / x[0] / f"checkpoint-{x[1]}").is_dir())
    if not gone:
        return
    with OutputTransaction(out) as txn:
        manifest = meta.read_manifest(out) or {}  # again, now that OUT is ours
        stored = state.read(out) if stored is not None else None
        for r in manifest.get("runs", []):
            r["outputs"] = [o for o in r.get("outputs", []) if (r["run"], o["step"]) not in gone]
        entries = []
        if stored is not None:
            for r in stored["runs"]:
                r["outputs"] = [s for s in r["outputs"] if (r["run"], s) not in gone]
            entries.append(state_commit.write_sealed(txn.tmp, stored))
        txn.commit(entries, manifest=manifest or None)
    names = ", ".join(f"{run}/checkpoint-{step}" for run, step in gone)
    output.warn(
        f"{out}: {names} deleted by hand since the last call: dropped from manifest.json and state.json"
    )


def _io_error(exc: OSError, tmp: Path) -> BemaError:
    """An OSError no reader or writer named: a write when it names a file under OUT's temp folder
    (or none), else a read of an input."""
    path = Path(exc.filename or tmp)
    if path.is_relative_to(tmp):
        return OutputError(f"{path}: cannot write ({exc.strerror or exc})")
    return InputError(f"{path}: cannot read ({exc.strerror or exc})")


@contextmanager
def hold(plan: Plan, alias: bool = True, full: bool = True, record: bool = True):
    """Keep every safetensors file this call reads open until it ends, and read them through those handles.

    A trainer with save_total_limit deletes old checkpoints while we read them; an open file
    lives on (io/watch.hold_files). A checkpoint already gone is an error naming it. The
    fingerprints recorded in the state are taken from the held files: what was read (`full`:
    a digest of each whole file, hashed by a thread beside the walk: docs/performance.md has its cost).
    Without a state to `record` them in (--no-state) nothing is hashed.
    """
    indexes = {step: index for step, index in plan.indexes.items() if type(index) is ModelIndex}
    held = list(indexes.values())
    if type(plan.theta0_index) is ModelIndex:
        held.append(plan.theta0_index)
    files = sorted({t.file for index in held for t in index.tensors.values()})
    try:
        mapping, fds = hold_files(files)
    except FileNotFoundError as exc:
        raise InputError(f"{exc.filename}: disappeared before it could be read") from None
    before = held_stats(fds)  # a file still being written moves while we read it: refused after
    pool = ThreadPoolExecutor(max_workers=1)
    files_of = {step: sorted({t.file for t in index.tensors.values()}) for step, index in indexes.items()}
    files_of = files_of if record else {}
    prints = pool.submit(_fingerprints, files_of, mapping, full)
    saved = [(index, index.tensors) for index in held] if alias else []
    for index, _ in saved:
        index.tensors = {n: replace(t, file=mapping[t.file]) for n, t in index.tensors.items()}
    try:
        yield
        check_unchanged(files, fds, before)
        plan.fingerprints = prints.result()
    except BemaError as exc:  # name the files as the user knows them, not by their /proc handle
        message = str(exc)
        for path, handle in sorted(mapping.items(), key=lambda kv: -len(str(kv[1]))):
            message = message.replace(str(handle), str(path))
        raise type(exc)(message) from None
    finally:
        prints.cancel()
        pool.shutdown(wait=True)  # the hashing thread reads through the fds released next
        for index, tensors in saved:
            index.tensors = tensors
        release(fds)


def _fingerprints(
    files_of: dict[int, list[Path]], mapping: dict[Path, Path], full: bool
) -> dict[int, list[dict]]:
    """step -> the fingerprint of its held files, under their own names."""
    result = {}
    for step, names in files_of.items():
        prints = fingerprint([mapping[p] for p in names], full)
        result[step] = [{**f, "name": p.name} for f, p in zip(prints, names, strict=True)]
    return result


def _walk(plan: Plan, opts: Options, tmp: Path, executor: ExecutorOptions) -> int:
    """The tensor-major pass; writes every output folder under tmp; returns safetensors bytes written."""
    with stages.stage("setup"):  # every output file allocated, its header written
        outputs = meta.open_outputs(plan, opts, tmp)
        plan.state_writers = state_store.open_writers(plan, opts, tmp)
    if opts.allow_nonfinite:
        output.warn("--allow-nonfinite: NaN/Inf in inputs are not checked and propagate to the outputs")
    total = sum(unit_bytes(u) for u in plan.units)
    with output.progress("bytes") as bar:
        task = bar.add_task("stabilizing (checkpoint bytes read)", total=total)
        sums = run_units(plan, opts, outputs, executor, lambda n: bar.advance(task, n))
    return meta.finish_outputs(plan, opts, outputs), sums
