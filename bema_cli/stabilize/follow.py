"""`bema stabilize --follow`: process each new checkpoint of a training run as soon as it is complete.

Each round is one incremental `bema stabilize` call (the persistent state makes it read only
the new checkpoints) over the checkpoints that are complete (io/watch.py); between rounds it
sleeps `poll` seconds per look. The outputs of a round are reported through `emit` right after their commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from bema_cli import output, signals
from bema_cli.errors import InputError
from bema_cli.io.watch import Pace, Watcher, wait_for
from bema_cli.stabilize import state
from bema_cli.stabilize.plan import Options


def _consumed(out: Path) -> list[int]:
    doc = state.read(out)
    return sorted(int(s["step"]) for s in doc["steps"]) if doc else []


def _check_vanished(watcher: Watcher, present: dict, consumed: list[int], opts: Options) -> None:
    """A checkpoint seen earlier, never read and now gone is an error unless every run skips it (--phi)."""
    last = consumed[-1] if consumed else None
    gone = sorted(
        s for s in watcher.seen if s not in present and s not in consumed and (last is None or s > last)
    )
    if not gone:
        return
    steps = sorted(set(consumed) | set(present) | set(gone))
    for step in gone:
        needed = any(
            next(e for e in s.plan(steps) if e.step == step).action != "skip" for s in opts.schedules
        )
        if needed:
            raise InputError(
                f"{watcher.seen[step]}: disappeared before it could be read (rotated away by the trainer?); "
                "the average cannot skip a step: use a shorter --poll or a larger save_total_limit, then --restart"
            )
        del watcher.seen[step]  # skipped by every run's cadence: it never mattered


def _look(watcher: Watcher, consumed: list[int], seen_through: int, opts: Options, ready: dict) -> bool:
    """One poll: fill `ready` with the complete checkpoints; True when one is newer than seen_through."""
    ready.clear()
    ready.update(watcher.complete())
    _check_vanished(watcher, watcher.scan(), consumed, opts)
    return any(s > seen_through for s in ready)


def follow(
    opts: Options, run_once: Callable[[Options], dict], emit: Callable[[dict], None], pace: Pace
) -> dict:
    """Watch opts.checkpoint_dir until `pace.until_step` is processed or `pace.idle_timeout` seconds pass
    without a new checkpoint; `run_once` is the batch `stabilize`. Returns totals over all rounds.
    The pace is checked by the command (FollowFlags.pace).

    Ctrl-C / SIGTERM end it like any bema run (exit 130 / 143) with OUT consistent: the same
    command later resumes from the last committed step.
    """
    try:
        return _follow(opts, run_once, emit, pace)
    except (KeyboardInterrupt, signals.Terminated):
        done = _consumed(Path(opts.out).expanduser().resolve())
        at = f"step {done[-1]}" if done else "no step yet"
        output.log(f"stopped; {opts.out} holds everything up to {at}: the same command resumes from there")
        raise


def _follow(
    opts: Options,
    run_once: Callable[[Options], dict],
    emit: Callable[[dict], None],
    pace: Pace,
) -> dict:
    out = Path(opts.out).expanduser().resolve()
    poll, until_step, idle_timeout = pace.poll, pace.until_step, pace.idle_timeout
    watcher = pace.watcher(opts.checkpoint_dir)
    totals = {"outputs": 0, "read_bytes": 0, "written_bytes": 0, "state_bytes": 0, "rounds": 0}
    first = True
    import torch  # noqa: F401  (imported now, not when the first checkpoint is waiting to be read)

    idle_since = time.monotonic()

    output.log(f"following {watcher.run_dir} (poll every {poll:g} s)")
    handled = -1  # the newest step a round has seen through (a step every run skips writes no state)
    while True:
        consumed = _consumed(out)
        seen_through = max(consumed[-1] if consumed else -1, handled)
        if until_step is not None and seen_through >= until_step:
            output.log(f"step {seen_through} processed (--until-step {until_step}): done")
            return totals
        ready: dict = {}
        new_ready = partial(_look, watcher, consumed, seen_through, opts, ready)
        left = None if idle_timeout is None else idle_timeout - (time.monotonic() - idle_since)
        # sleeps between polls: no CPU while idle; a signal (Ctrl-C, SIGTERM) ends the wait
        if not wait_for(new_ready, poll, None if left is None else max(left, 0.0)):  # polls at least once
            output.log(f"no new checkpoint for {idle_timeout:g} s (--idle-timeout): done")
            return totals
        again = {"restart": opts.write.restart and first, "overwrite": opts.write.overwrite and first}
        doc = run_once(replace(opts, ready_steps=sorted(ready), write=replace(opts.write, **again)))
        first = False
        handled = max(ready)
        for o in doc["outputs"]:
            emit(o)
        steps = sorted({o["step"] for o in doc["outputs"]})
        output.log(f"processed step(s) {', '.join(map(str, steps)) or '-'} in {doc['seconds']:.2f} s")
        totals["rounds"] += 1
        totals["outputs"] += len(doc["outputs"])
        for key in ("read_bytes", "written_bytes", "state_bytes"):
            totals[key] += doc.get(key, 0)
        idle_since = time.monotonic()
