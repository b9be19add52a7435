"""The persistent state of `bema stabilize`: what the recurrences need to go on, under OUT/.bema-state/.

A re-run of the same command after new checkpoints appeared reads only the new checkpoints
and continues each recurrence from where the last call left it, so its outputs are bitwise
identical to a one-shot run over the whole trajectory (the state is kept exactly, in the
accumulation dtype). Layout (docs/design.md, "Persistent state"):

    OUT/.bema-state/state.json         format, theta0's source and fingerprint, every consumed
                                       checkpoint's fingerprint, each run's schedule, last step
                                       and outputs
    OUT/.bema-state/<family>-<hash>/   one folder per distinct recurrence state (schedule.state_key
                                       at one step): tensors "<state>/<name>" (e.g.
                                       "ema/model.embed_tokens.weight") in the accumulation dtype, each
                                       state in files of its own (state_store.state_layout)
    OUT/.bema-state/theta0-<hash>/     theta0 after a burn-in (--tau) replaced the base

State folders are named by what they hold (state key, consumed steps), written under the
call's temp folder one work unit at a time, and committed together with the outputs and
state.json by the output commit protocol (io/commit.py): a crash at any moment leaves the old
state or the new one, never a mix. state.json is checked whole and every state file's digest
verified before a call continues from it (stabilize/state_doc.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from bema_cli import output
from bema_cli.errors import BemaError, InputError, UsageError
from bema_cli.io.checkpoints import Checkpoint, read_json
from bema_cli.io.fingerprint import changed, fingerprint, fingerprint_if_present
from bema_cli.io.safetensors import ModelIndex
from bema_cli.recurrence import STATE_TENSORS
from bema_cli.schedule import WINDOW_METHODS, Schedule, run_name, state_key, used_by
from bema_cli.stabilize import gaps, state_doc
from bema_cli.stabilize.plan import Options, Plan, Resume, Run, Track
from bema_cli.stabilize.state_store import STATE_DIR, state_layout

STATE_FILE = "state.json"
FORMAT = 2  # 2: sealed (state_doc.seal); 1 (bema 0.3): unsealed, refused with a --restart hint
# What must not change between calls of one run: the schedule (the EMA family's parameters, as a
# state of format 2 stores them; schedule.used_by) and the dtypes (flag names for errors).
SCHEDULE_KEYS = tuple(n for n in used_by("bema") if n != "method")
CHECKED = (*SCHEDULE_KEYS, "accum_dtype", "out_dtype", "lora_output", "lora_rank")
# Checked keys absent from states written before they were checked, and the value they had then.
ADDED_LATER = {"lora_output": "merged", "lora_rank": None}


# -- reading the state and checking a call against it -----------------------------------------
_SAID: set[Path] = set()  # unusable states already reported (read runs up to three times a call)


def read(out: Path, restart: bool = False) -> dict | None:
    """OUT/.bema-state/state.json, or None when OUT has no state; InputError naming it when malformed,
    edited or of an older format, unless `restart` (--restart/--overwrite: nothing of it is used)."""
    state_doc.check_no_links(out / STATE_DIR)
    path = out / STATE_DIR / STATE_FILE
    if not path.exists():
        return None
    required = tuple(k for k in CHECKED if k not in ADDED_LATER)
    try:
        return state_doc.validate(read_json(path), path, FORMAT, required)
    except InputError as exc:
        if not restart:
            raise
        if path not in _SAID:
            _SAID.add(path)
            output.log(f"{str(exc).split('; ')[0]}: recomputing from scratch (--restart)")
        return None


def run_settings(schedule: Schedule, opts: Options) -> dict:
    values = {n: getattr(schedule, n) for n in SCHEDULE_KEYS}
    values.update(accum_dtype=opts.accum_dtype, out_dtype=opts.out_dtype or "input")
    values.update(lora_output=opts.write.lora_output, lora_rank=opts.write.lora_rank)
    return json.loads(output.to_json(values))  # as stored: inf -> "inf", None -> null


def check_run(name: str, stored: dict, schedule: Schedule, opts: Options, where: Path) -> None:
    """Refuse (one line, naming the difference) to continue a run whose schedule or dtype changed."""
    now = run_settings(schedule, opts)
    for key in CHECKED:
        if key in SCHEDULE_KEYS and key not in schedule.params():
            continue  # e.g. --kappa for a window run: a parameter it does not use
        before = stored.get(key, ADDED_LATER.get(key))
        if before != now[key]:
            raise UsageError(
                f"{name}: --{key.replace('_', '-')} is {now[key]} but {where} was computed with "
                f"{before}; pass --restart to recompute this run from scratch (or choose another --out)"
            )


def check_folder(name: str, run: dict, schedule: Schedule, stored: dict, where: Path) -> None:
    """A run continues from the state folder bema named for it: its name is a digest of the run's
    state key, the steps consumed up to its last step and theta0 (`tracks`), so a folder swapped
    with another run's, or copied from another history, is refused without any key."""
    folder = run.get("state")
    if folder is None:
        return
    key = state_key(schedule)
    consumed = [int(x["step"]) for x in stored["steps"] if int(x["step"]) <= int(run["last_step"])]
    source = stored["theta0"]["source"]
    if schedule.method in WINDOW_METHODS:  # one ring serves every window of a cadence: its family only
        if not folder.startswith(f"{key[0]}-"):
            raise InputError(
                f"{where}: run {name} names the state folder {folder!r}, which is not a window ring "
                "(swapped with another run's); pass --restart to recompute from scratch"
            )
        return
    if folder != f"{key[0]}-{_digest(key, consumed, source)}":
        raise InputError(
            f"{where}: run {name} names the state folder {folder!r}, which bema did not compute for it "
            "(swapped with another run's, or from another history); pass --restart to recompute from scratch"
        )


def resume(
    opts: Options,
    out: Path | None,
    stored: dict | None,
    checkpoints: list[Checkpoint],
    base_source: str,
    base_files,
) -> Resume:
    """Check this call against OUT's state (`stored`, as `read` returned it) and say where each run
    of the grid starts.

    Errors (one line each): a consumed checkpoint changed on disk, a new checkpoint older than
    the last processed step, theta0 or a run's schedule changed. --restart (and --overwrite,
    which replaces outputs anyway) recomputes the grid's runs from theta0; the state of other
    runs is kept when the inputs it was computed from are unchanged, else dropped.
    """
    present = [c.step for c in checkpoints]
    consumed = sorted(int(s["step"]) for s in stored["steps"]) if stored is not None else []
    gaps.check_gaps(checkpoints, consumed, opts.allow_gaps or bool(opts.min_interval))  # thinned on purpose
    if stored is None:
        return Resume(None, present, {}, None, base_files)
    write = opts.write  # a state is stored only where a plan writes
    restart = write.recompute
    try:
        _check_inputs(
            stored, out / STATE_DIR, checkpoints, base_source, base_files, write.fingerprint == "full"
        )
    except BemaError:
        if not restart:
            raise
        return Resume(None, present, {}, None, base_files)  # nothing of the old state can be trusted
    runs = {r["run"]: r for r in stored["runs"]}
    starts: dict[str, int | None] = {}
    for s in opts.schedules:
        name = run_name(s)
        if name in runs and not restart:
            check_run(name, runs[name], s, opts, out / STATE_DIR)
            check_folder(name, runs[name], s, stored, out / STATE_DIR / STATE_FILE)
            starts[name] = int(runs[name]["last_step"])
    steps = sorted({int(s["step"]) for s in stored["steps"]} | set(present))
    burnin = stored["theta0"].get("burnin") or {}
    return Resume(stored, steps, starts, burnin.get("folder"), base_files)


def _check_inputs(
    stored: dict, where: Path, checkpoints: list[Checkpoint], base_source: str, base_files, full: bool
) -> None:
    """theta0 and every consumed checkpoint still on disk are what the state was computed from."""
    theta0 = stored["theta0"]
    if theta0.get("source") != base_source:
        raise UsageError(
            f"--base: theta0 is {base_source} but {where} was computed from {theta0.get('source')}; "
            "pass --restart to recompute from scratch (or choose another --out)"
        )
    diff = changed(theta0.get("files", []), fingerprint(base_files, full, theta0.get("files")))
    if diff:
        raise InputError(
            f"{base_source}: theta0 changed on disk since {where} was written ({diff}); pass --restart"
        )
    consumed = {int(s["step"]): s for s in stored["steps"]}
    last = max(consumed, default=None)
    for c in checkpoints:
        if c.step in consumed:
            now = fingerprint_if_present(c.path, consumed[c.step]["files"])
            diff = changed(consumed[c.step]["files"], now) if now and consumed[c.step]["files"] else None
            if diff:
                raise InputError(
                    f"{c.path}: changed on disk since it was processed ({diff}); pass --restart to recompute"
                )
        elif last is not None and c.step < last:
            raise InputError(
                f"{c.path}: a new checkpoint older than the last processed step {last}; pass --restart to recompute"
            )


def _digest(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def tracks(plan: Plan, resume: Resume, out: Path) -> list[Track]:
    """Group the runs into tracks; name each new state folder by its key and consumed steps."""
    groups: dict[tuple, list[Run]] = {}
    for run in plan.runs:
        groups.setdefault((state_key(run.schedule), run.start), []).append(run)
    stored = {r["run"]: r for r in (resume.stored or {}).get("runs", [])}
    result = []
    for (key, start), runs in groups.items():
        last = max(r.last_needed for r in runs)
        method = runs[0].schedule.method
        old = stored[runs[0].name].get("state") if start is not None else None
        track = Track(method, runs, start, last, None, old)
        if (STATE_TENSORS[method] or track.ring) and last != start:
            consumed = [s for s in resume.steps if s <= last]
            ring = (track.ring,) if track.ring else ()  # the EMA family's names as before windows existed
            track.folder = f"{key[0]}-{_digest(key, consumed, plan.base_source, *ring)}"
            track.source = state_doc.index_state(out / STATE_DIR / old, resume.stored) if old else None
            if track.window:
                track.ring_sources = _ring_sources(plan, track, out)
                track.source = None  # read member by member (ring_sources)
            elif start is not None and track.source is None:
                raise InputError(f"{out / STATE_DIR}: no state for run {runs[0].name}; pass --restart")
            elif track.source is not None:
                accum = stored[runs[0].name]["accum_dtype"]
                state_doc.check_layout(track.source, state_layout(plan, track.names, accum, 1 << 62))
        result.append(track)
    return result


def _ring_sources(plan: Plan, track: Track, out: Path) -> dict[int, tuple[ModelIndex, str]]:
    """Where a continued window reads the members its ring holds at `start`: the run's own checkpoint
    when it is still there (its fingerprint was checked: resume), else the copy in the state."""
    sources = {}
    missing = []
    for step in track.ring_steps(track.start):
        if step in plan.indexes:
            sources[step] = (plan.indexes[step], "")
        elif track.source is not None and any(n.startswith(f"s{step}/") for n in track.source.tensors):
            sources[step] = (track.source, f"s{step}/")
        else:
            missing.append(step)
    if missing:
        run = max(track.runs, key=lambda r: r.schedule.window)
        raise UsageError(
            f"{out / STATE_DIR}: run {run.name} (--window {run.schedule.window}) needs checkpoint step(s) "
            f"{', '.join(map(str, missing))} to continue, and neither the run folder nor the state has "
            "them; pass --restart to recompute from theta0"
        )
    if track.source is not None:
        accum = next(r for r in plan.resume.stored["runs"] if r["run"] == track.runs[0].name)["accum_dtype"]
        names = tuple(f"s{s}" for s, (index, _) in sources.items() if index is track.source)
        state_doc.check_layout(track.source, state_layout(plan, names, accum, 1 << 62))
    return sources


def attach(plan: Plan, resume: Resume, out: Path) -> None:
    """Decide the state side of a plan: its tracks, where theta0 is read, whether theta0 is saved.

    A continued ema/dema/vanilla state never looks at theta0 again; bema's drift, ouema's
    targets and a state started from scratch do. After a burn-in (steps <= tau) theta0 is that
    checkpoint's weights, kept in the state since the checkpoint may be gone by the next call.
    """
    plan.resume = resume
    plan.tracks = tracks(plan, resume, out)
    tau = plan.runs[0].schedule.tau  # one tau per grid (prepare.prepare)
    burnin = [s for s in plan.read_steps if s <= tau]
    plan.theta0_folder = f"theta0-{_digest(plan.base_source, burnin[-1])}" if burnin else None
    # a state started from theta0 reads it (windows and vanilla have none)
    fresh = any(t.start is None and STATE_TENSORS[t.method] for t in plan.tracks)
    if not fresh and not any(r.schedule.method in ("bema", "ouema") and r.out_steps for r in plan.runs):
        plan.theta0_index = None
    elif fresh or not resume.theta0_state:
        plan.theta0_index = plan.base_index
    else:
        plan.theta0_index = state_doc.index_state(out / STATE_DIR / resume.theta0_state, resume.stored)
        for run in resume.stored["runs"][:1]:  # one accumulation dtype per OUT (check_run)
            state_doc.check_layout(
                plan.theta0_index, state_layout(plan, ("theta0",), run["accum_dtype"], 1 << 62)
            )
