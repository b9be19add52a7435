"""`bema sweep --follow`: evaluate each checkpoint of a live run as it lands, one engine, nothing written."""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from bema_cli import output
from bema_cli.errors import InputError, UsageError
from bema_cli.eval import resume
from bema_cli.eval.evaluate import Evaluation
from bema_cli.eval.targets import Target
from bema_cli.io.aux_files import copy_aux_files
from bema_cli.io.checkpoints import Checkpoint
from bema_cli.io.fingerprint import weight_files
from bema_cli.io.reader import open_checkpoint
from bema_cli.io.watch import Pace, Watcher, hold_files, release, wait_for
from bema_cli.signals import Terminated
from bema_cli.stabilize import gaps
from bema_cli.sweep import session
from bema_cli.sweep.walk import add_landed, check_landed, plan_sweep


class Landed:
    """Checkpoints held as they land, by a thread that polls every --poll seconds also while the
    engine starts or a model is evaluated: each complete checkpoint has its weight files held open
    (`/proc/<pid>/fd/N`, readable by a vLLM worker too), its headers read, its fingerprints taken
    and its small files (config, tokenizer) copied at once, so a trainer's save_total_limit
    deleting it before its turn loses nothing. A step the run's cadence says was saved but that
    was never seen is an error (stabilize/gaps.py), unless --allow-gaps."""

    def __init__(self, watcher: Watcher, poll: float, allow_gaps: bool):
        self.watcher, self.poll, self.allow_gaps = watcher, poll, allow_gaps
        self.queue: queue.Queue = queue.Queue()
        self.fds: list[int] = []
        self.steps: list[int] = []
        self.aux = Path(tempfile.mkdtemp(prefix="bema-sweep-"))  # config/tokenizer copies (no weights)
        self.like: set[str] | None = None  # theta0's tensor names, once known (DCP prefixes)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def look(self) -> list[dict]:
        """One poll: every checkpoint newer than the last one that became complete, held."""
        last = self.steps[-1] if self.steps else -1
        new = sorted((s, p) for s, p in self.watcher.complete().items() if s > last)
        if new:
            gaps.check_gaps([Checkpoint(s, p) for s, p in new], self.steps, self.allow_gaps)
        return [self._hold(step, folder) for step, folder in new]

    def _hold(self, step: int, folder: Path) -> dict:
        """Hold `folder`'s weight files open and take what else its turn needs; deleted midway (a
        trainer rotating faster than one poll) it is a named error, never a traceback."""
        try:
            mapping, fds = hold_files(weight_files(folder))
            self.fds += fds
            held = {
                str(k): str(v).replace("/proc/self/", f"/proc/{os.getpid()}/") for k, v in mapping.items()
            }
            aux = self.aux / f"checkpoint-{step}"
            aux.mkdir()
            copy_aux_files(aux, [folder])
            item = {
                "step": step,
                "folder": folder,
                "held": held,
                "aux": aux,
                "inputs": session.input_prints({step: folder})[step],
                "vanilla": resume.weights_fingerprint(folder),
                "index": open_checkpoint(folder, like=self.like),
            }
        except (FileNotFoundError, InputError) as exc:
            if folder.is_dir() and not isinstance(exc, FileNotFoundError):
                raise  # a real problem of a checkpoint still there
            raise InputError(f"{folder}: disappeared before it could be read") from None
        self.steps.append(step)
        output.log(f"checkpoint-{step} landed: held until its turn")
        return item

    def start(self) -> None:
        """Poll from a thread from now on (the first checkpoints are the caller's to plan)."""
        self._thread = threading.Thread(target=self._loop, name="bema-sweep-follow", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                for item in self.look():
                    self.queue.put(item)
            except BaseException as exc:  # re-raised in the main thread by `take`
                self.error = exc
                return

    def take(self, timeout: float | None = 0) -> list[dict]:
        """What landed since the last call (waiting up to `timeout` seconds for something)."""
        if self.error is not None:
            raise self.error
        items = []
        try:
            items.append(self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait())
            while True:
                items.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        if self.error is not None and not items:
            raise self.error
        return items

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        release(self.fds)
        shutil.rmtree(self.aux, ignore_errors=True)


class Follow:
    """--follow: evaluate each checkpoint of a live run as it lands, in one engine, nothing written.
    Ctrl-C keeps every record written; the same command resumes."""

    def __init__(self, stab, config, engine, sweep_opts, pace: Pace, validated):
        self.at = session.parse_at(sweep_opts.at)  # a bad --at is refused before anything starts
        if self.at[0] == "last":
            raise UsageError("--at last: a followed run has no last step yet; use all, every:N or a list")
        self.stab, self.config, self.engine, self.sweep_opts = stab, config, engine, sweep_opts
        self.poll, self.until = pace.poll, pace.until_step
        self.idle_timeout, self.validated = pace.idle_timeout, validated
        self.landed = Landed(pace.watcher(stab.checkpoint_dir), self.poll, stab.allow_gaps)
        self.plan = self.walk = self.evaluation = None
        self.folder_of: dict[int, Path] = {}
        self.aux_of: dict[int, Path] = {}
        self.inputs: dict[int, list[dict]] = {}
        self.known: dict[Path, str] = {}  # vanilla's weights fingerprint, taken as it landed
        self.queued: list[int] = []
        self.seen_through = -1
        self.targets: list[Target] = []
        self.doc: dict = {}

    def _record(self, items: list[dict]) -> None:
        for item in items:
            step, folder = item["step"], item["folder"]
            self.folder_of[step], self.aux_of[step] = folder, item["aux"]
            self.inputs[step], self.known[folder] = item["inputs"], item["vanilla"]
            self.queued.append(step)

    def _first(self) -> bool:
        """Wait for the first checkpoints: plan, check memory, start the engine (the thread polls on)."""
        items = self.landed.look()
        if not items:
            return False
        self.landed.start()  # polls on while the first checkpoints are planned and the engine starts
        self._record(items)
        held = {k: v for item in items for k, v in item["held"].items()}
        steps = [item["step"] for item in items]
        self.plan = plan_sweep(replace(self.stab, ready_steps=steps), held)
        if [c.step for c in self.plan.checkpoints] != steps:
            gone = sorted(set(steps) - {c.step for c in self.plan.checkpoints})
            raise InputError(f"{self.folder_of[gone[0]]}: disappeared before it could be read")
        session.check_inputs(self.config, dict(self.folder_of), self.plan, [])
        if self.validated is not None:
            self.validated()
        self.evaluation = Evaluation(self.config, self.engine)
        self.doc, self.stab = session.memory_doc(
            self.plan, self.stab, self.config, self.engine, self.evaluation, self.sweep_opts
        )
        self.landed.like = set(self.plan.base_index.tensors)
        output.log(f"following {self.landed.watcher.run_dir} (poll every {self.poll:g} s)")
        self.walk = session.Walk(
            self.evaluation.backend_name,
            self.evaluation.engine,
            replace(self.stab, ready_steps=steps),
            self.plan,
            self.folder_of,
            [],
            self.aux_of,
            starter=self.evaluation.start,
        )
        return True

    def _extend(self, timeout: float | None = 0) -> bool:
        """Add what landed to the plan (here and where the states live); True when something did."""
        items = self.landed.take(timeout)
        if not items:
            return False
        for item in items:
            check_landed(self.plan, item["index"], self.stab.cast_base, item["held"])
        add_landed(self.plan, [(item["step"], item["folder"], item["index"]) for item in items])
        self.walk.backend.source_call("extend", self.plan)
        self._record(items)
        return True

    def _chosen(self, steps: list[int]) -> list[int]:
        return [s for s in steps if session.at_chosen(*self.at, s)]

    def _wait(self, left: float | None) -> bool:
        if self.plan is None:
            return wait_for(self._first, self.poll, left)
        deadline = None if left is None else time.monotonic() + left
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return self._extend()
            if self._extend(min(self.poll, remaining) if remaining is not None else self.poll):
                return True

    def run(self, t0: float) -> dict:
        idle_since = time.monotonic()
        try:
            while True:
                if not self.queued:
                    if self.until is not None and self.seen_through >= self.until:
                        output.log(f"step {self.seen_through} done (--until-step {self.until}): done")
                        break
                    left = (
                        None
                        if self.idle_timeout is None
                        else self.idle_timeout - (time.monotonic() - idle_since)
                    )
                    if not self._wait(None if left is None else max(left, 0.0)):
                        output.log(f"no new checkpoint for {self.idle_timeout:g} s (--idle-timeout): done")
                        break
                steps, self.queued = self.queued, []
                chosen = self._chosen(steps)
                at = session.targets(self.plan, self.stab, chosen, self.folder_of) if chosen else []
                self.targets += at
                jobs = (
                    self.evaluation.plan(at, session.fingerprints(self.plan, at, self.inputs, self.known))
                    if at
                    else []
                )
                self.walk.run(jobs, self.evaluation.write, between=self._extend)
                self._advance_to(steps[-1])  # steps no --at step chose still move the averages
                self.seen_through = steps[-1]
                idle_since = time.monotonic()
        except (KeyboardInterrupt, Terminated):
            output.log(f"stopped; {self.config.out}/results.jsonl keeps every finished evaluation")
            raise
        finally:
            self.landed.close()
            if self.walk is not None:
                self.walk.close()
        if self.walk is None:
            return {
                "runs": [],
                "evaluated": 0,
                "records": [],
                "engine_starts": 0,
                "written_weight_bytes": 0,
                "memory": {},
                "seconds": time.perf_counter() - t0,
            }
        self.doc.update(self.walk.summary())
        session.judge_motion(self.doc, self.plan, self.config.out)
        return session.finish_doc(self.doc, self.evaluation, self.targets, t0)

    def _advance_to(self, step: int) -> None:
        for s in [s for s in self.plan.read_steps if s <= step and s not in self.walk.walked]:
            self.walk.backend.source_call("advance", s)
            self.walk.walked.append(s)
            self.walk.backend.source_call("finish")
        if self.walk.walked:
            self.walk.motion_sums = self.walk.backend.source_call("motion_sums")
