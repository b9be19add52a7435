"""`bema sweep --follow`: evaluate each checkpoint of a live run as it lands, one engine, nothing written."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bema_cli import output
from bema_cli.errors import InputError, UsageError
from bema_cli.eval import resume
from bema_cli.eval.evaluate import Evaluation
from bema_cli.eval.targets import Target
from bema_cli.io.checkpoints import copy_aux_files
from bema_cli.io.fingerprint import weight_files
from bema_cli.io.watch import SETTLE_FLOOR, Watcher, hold_files, release, wait_for
from bema_cli.signals import Terminated
from bema_cli.sweep.run import (
    Walk,
    check_inputs,
    finish_doc,
    memory_doc,
    at_steps,
    fingerprints,
    input_prints,
    targets,
)
from bema_cli.sweep.walk import extend_plan, plan_sweep


class Follow:
    """--follow: evaluate each checkpoint of a live run as it lands, in one engine, nothing written.

    Each complete checkpoint (io/watch.Watcher, as stabilize --follow) has its files held open at
    once and is added to the walk (Walker.extend), also between two evaluations, so a trainer's
    save_total_limit rotating it away before its turn does not lose it. Ctrl-C keeps every record written.
    """

    def __init__(self, stab, config, engine, sweep_opts, follow: dict, validated):
        if sweep_opts.at == "last":
            raise UsageError("--at last: a followed run has no last step yet; use all, every:N or a list")
        self.stab, self.config, self.engine, self.sweep_opts = stab, config, engine, sweep_opts
        self.poll, self.until = follow["poll"], follow["until_step"]
        self.idle_timeout, self.validated = follow["idle_timeout"], validated
        settle = follow["settle"]
        self.watcher = Watcher(
            Path(stab.checkpoint_dir).expanduser(),
            settle=max(SETTLE_FLOOR, 2 * self.poll) if settle is None else settle,
        )
        self.plan = self.walk = self.evaluation = None
        self.folder_of: dict[int, Path] = {}
        self.inputs: dict[int, list[dict]] = {}
        self.queued: list[int] = []
        self.seen_through = -1
        self.fds: list[int] = []
        self.targets: list[Target] = []
        self.known: dict[Path, str] = {}  # vanilla's weights fingerprint, taken as it landed
        self.aux_of: dict[int, Path] = {}
        self.aux = Path(tempfile.mkdtemp(prefix="bema-sweep-"))  # config/tokenizer copies (bytes, no weights)
        self.doc: dict = {}

    def look(self) -> bool:
        """One poll: hold and add every checkpoint that became complete; True when one did."""
        new = {s: p for s, p in self.watcher.complete().items() if s not in self.folder_of}
        if self.folder_of:
            new = {s: p for s, p in new.items() if s > max(self.folder_of)}
        if not new:
            return False
        files = [f for folder in new.values() for f in weight_files(folder)]
        try:
            mapping, fds = hold_files(files)
        except FileNotFoundError as exc:
            raise InputError(f"{exc.filename}: disappeared before it could be read") from None
        self.fds += fds
        held = {str(k): str(v).replace("/proc/self/", f"/proc/{os.getpid()}/") for k, v in mapping.items()}
        self.inputs.update(input_prints(new))
        for step, folder in new.items():  # read now: the trainer may delete the folder before its turn
            self.known[folder] = resume.weights_fingerprint(folder)
            (self.aux / f"checkpoint-{step}").mkdir()
            copy_aux_files(self.aux / f"checkpoint-{step}", [folder])
            self.aux_of[step] = self.aux / f"checkpoint-{step}"
        if self.plan is None:
            self._start(new, held)
        else:
            extend_plan(self.plan, {s: str(p) for s, p in new.items()}, self.stab.cast_base, held)
            self.walk.backend.sweep_extend(self.plan)
        self.folder_of.update(new)
        self.queued += sorted(new)
        return True

    def _start(self, new: dict, held: dict) -> None:
        self.plan = plan_sweep(replace(self.stab, ready_steps=sorted(new)), held)
        check_inputs(self.config, new, self.plan, [])
        if self.validated is not None:
            self.validated()
        self.evaluation = Evaluation(self.config, self.engine)
        self.doc, self.stab = memory_doc(
            self.plan, self.stab, self.config, self.engine, self.evaluation, self.sweep_opts
        )
        stab = replace(self.stab, ready_steps=sorted(new))
        output.log(f"following {self.watcher.run_dir} (poll every {self.poll:g} s)")
        self.walk = Walk(
            self.evaluation.backend_name, self.engine, stab, self.plan, dict(new), [], self.aux_of
        )
        self.walk.folder_of = self.folder_of

    def _chosen(self, steps: list[int]) -> list[int]:
        text = self.sweep_opts.at.strip()
        if text == "all":
            return steps
        if text.startswith("every:"):
            return [s for s in steps if s in at_steps(text, steps + [0])]
        return [
            s for s in steps if s in at_steps(text, sorted(set(steps) | {int(x) for x in text.split(",")}))
        ]

    def run(self, t0: float) -> dict:
        idle_since = time.monotonic()
        try:
            while True:
                if not self.queued:
                    if (
                        self.until is not None
                        and self.walk
                        and self.walk.walked
                        and self.walk.walked[-1] >= self.until
                    ):
                        output.log(f"step {self.walk.walked[-1]} evaluated (--until-step {self.until}): done")
                        break
                    left = (
                        None
                        if self.idle_timeout is None
                        else self.idle_timeout - (time.monotonic() - idle_since)
                    )
                    if not wait_for(self.look, self.poll, None if left is None else max(left, 0.0)):
                        output.log(f"no new checkpoint for {self.idle_timeout:g} s (--idle-timeout): done")
                        break
                steps, self.queued = self.queued, []
                chosen = self._chosen(steps)
                at = targets(self.plan, self.stab, chosen, self.folder_of) if chosen else []
                self.targets += at
                prints = fingerprints(self.plan, at, self.inputs, self.known)
                jobs = self.evaluation.plan(at, prints) if at else []
                self.walk.run(jobs, self.evaluation.write, between=self.look)
                self._advance_to(steps[-1])  # steps no --at step chose still move the averages
                self.seen_through = steps[-1]
                idle_since = time.monotonic()
        except (KeyboardInterrupt, Terminated):
            output.log(f"stopped; {self.config.out}/results.jsonl keeps every finished evaluation")
            raise
        finally:
            if self.walk is not None:
                self.walk.close()
            release(self.fds)
            shutil.rmtree(self.aux, ignore_errors=True)
        if self.walk is None:
            return {"runs": [], "evaluated": 0, "records": [], "engine_starts": 0, "written_weight_bytes": 0,
                    "memory": {}, "seconds": time.perf_counter() - t0}  # fmt: skip
        self.doc.update(self.walk.summary())
        return finish_doc(self.doc, self.evaluation, self.targets, t0)

    def _advance_to(self, step: int) -> None:
        for s in [s for s in self.plan.read_steps if s <= step and s not in self.walk.walked]:
            self.walk.backend.sweep_advance(s)
            self.walk.walked.append(s)
            self.walk.backend.sweep_finish()
