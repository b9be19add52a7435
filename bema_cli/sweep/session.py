"""One sweep's parts: the steps --at names, the targets and their fingerprints, the memory check,
and `Walk` (one engine holding the walker's states, walking checkpoints and evaluating jobs),
shared by the batch sweep (run.py), --follow (follow.py) and the Ray actors (ray_split.py)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bema_cli import __version__, output, stages
from bema_cli.errors import UsageError
from bema_cli.eval import resume, timings
from bema_cli.eval.backends.base import EngineOptions, make_backend
from bema_cli.eval.evaluate import Evaluation
from bema_cli.eval.job import EvalConfig, Job, evaluate_task
from bema_cli.eval.targets import STABILIZER_KEYS, SWEEP_SCHEME, VANILLA, Target, check_model_dir
from bema_cli.io.commit import check_apart
from bema_cli.io.fingerprint import fingerprint, weight_files
from bema_cli.machine import available_memory
from bema_cli.stabilize import meta, motion
from bema_cli.stabilize.plan import Options, Plan
from bema_cli.stabilize.workspace import torch_device
from bema_cli.sweep.hold import state_bytes
from bema_cli.sweep.memory import check_memory, host_total, memory_estimate, states_device

WALKER = "bema_cli.sweep.walk:Walker"  # the backend builds it where the weights load (a vLLM worker)


@dataclass
class SweepOptions:
    at: str = "all"  # all | last | every:N | S1,S2,... (0: theta0)
    memory_limit: int | None = None  # bytes the sweep may hold; None: MemAvailable
    dry_run: bool = False  # project memory and time, then stop before reading any checkpoint


def parse_at(text: str) -> tuple[str, int | frozenset | None]:
    """--at as (kind, value): ("all", None), ("last", None), ("every", N) or ("list", steps)."""
    text = text.strip()
    if text in ("all", "last"):
        return text, None
    if text.startswith("every:"):
        n = text.removeprefix("every:")
        if not (n.isascii() and n.isdigit()) or int(n) < 1:  # int() takes '²' too
            raise UsageError(f"--at: every:N needs a whole number N >= 1, got {text!r}")
        return "every", int(n)
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):  # no empty item, no '²' (int() takes it)
        raise UsageError(f"--at: all, last, every:N or a comma list of steps, got {text!r}")
    return "list", frozenset(int(p) for p in parts)


def at_chosen(kind: str, value, step: int) -> bool:
    """Whether a step that landed is evaluated (--follow, where no step is the last yet)."""
    return kind == "all" or (kind == "every" and step % value == 0) or (kind == "list" and step in value)


def at_steps(text: str, steps: list[int]) -> list[int]:
    """The steps --at names, among the run's checkpoint steps (0: theta0, the base)."""
    kind, value = parse_at(text)
    if kind == "last":
        return steps[-1:]
    if kind == "list":
        for step in sorted(value):
            if step != 0 and step not in steps:
                raise UsageError(f"--at: no checkpoint at step {step} (found {_list(steps)}; 0 is theta0)")
        return sorted(value)
    chosen = [s for s in steps if at_chosen(kind, value, s)]
    if not chosen:
        raise UsageError(
            f"--at {text.strip()}: no checkpoint step is a multiple of {value} (found {_list(steps)})"
        )
    return chosen


def _list(steps: list[int]) -> str:
    return (
        ", ".join(map(str, steps))
        if len(steps) <= 12
        else f"{steps[0]}, ..., {steps[-1]} ({len(steps)} steps)"
    )


def _stabilizer(plan: Plan, opts: Options, run, step: int, source: Path) -> dict:
    """The stabilizer a record carries: what `bema eval` reads from that output's bema.json."""
    record = meta.record(run, step, source, plan.base_source, opts, meta.out_dtype_name(plan, opts), None)
    record = json.loads(output.to_json(record))  # as bema.json holds it (eta inf as "inf")
    return {k: record[k] for k in STABILIZER_KEYS if k in record}


def targets(plan: Plan, opts: Options, steps: list[int], folder_of: dict[int, Path]) -> list[Target]:
    """One Target per (config, step) and vanilla per step; theta0 as step 0 when asked."""
    out = []
    last = max(folder_of)  # a stabilizer's keys do not depend on the step
    stabilizers = {r.name: _stabilizer(plan, opts, r, last, folder_of[last]) for r in plan.runs}
    runs = [("vanilla", dict(VANILLA)), *stabilizers.items()]
    if 0 in steps:
        base = plan.base_index.folder
        out.append(Target(base, "base", 0, dict(VANILLA), is_base=True, runs=runs))
    for step in (s for s in steps if s):
        out.append(Target(folder_of[step], "vanilla", step, dict(VANILLA)))
        for r in plan.runs:
            if r.events[step].action != "skip":
                path = Path(f"{SWEEP_SCHEME}{r.name}/checkpoint-{step}")
                out.append(Target(path, r.name, step, stabilizers[r.name]))
    return out


def input_prints(folders: dict[int, Path]) -> dict[int, list[dict]]:
    """Each checkpoint's sampled file fingerprint (taken while it is on disk: --follow's may go)."""
    return {step: fingerprint(weight_files(folder)) for step, folder in folders.items()}


def fingerprints(
    plan: Plan, at: list[Target], inputs: dict[int, list[dict]], known: dict[Path, str] | None = None
) -> dict[Path, str]:
    """Resume keys' `weights`: the files' own fingerprint for vanilla and theta0 (as `bema eval`
    takes it), and for a config a digest of its stabilizer, its step and every input up to it."""
    base = fingerprint(weight_files(plan.base_index.folder))
    out = {}
    for t in at:
        if str(t.path).startswith(SWEEP_SCHEME):
            doc = {
                "stabilizer": t.stabilizer,
                "step": t.step,
                "base": base,
                "inputs": [inputs[s] for s in sorted(inputs) if s <= t.step],
            }
            out[t.path] = "sweep:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
        else:
            out[t.path] = (known or {}).get(t.path) or resume.weights_fingerprint(t.path)
    return out


def check_inputs(config: EvalConfig, folder_of: dict, plan: Plan, steps: list[int]) -> None:
    """OUT apart from everything the sweep reads (the run folder, its checkpoints, the base, the data
    files): neither it, inside it, nor around it. Then the checkpoints evaluated are model folders."""
    from bema_cli.io.checkpoints import run_of

    runs = {run_of(c.path) for c in plan.checkpoints}
    check_apart(
        Path(config.out).expanduser(),
        [*runs, *folder_of.values(), plan.base_index.folder, *config.read_paths()],
    )
    for step in steps:
        if step:
            check_model_dir(folder_of[step])  # tokenizer and config files come from the checkpoint


def memory_doc(plan, stab, config, engine, evaluation, sweep_opts) -> tuple[dict, Options]:
    """Where the states live and the host-memory estimate, checked against the limit before anything
    is read: the start of the --json document, and `stab` with its device decided."""
    backend = evaluation.backend_name
    gpu = torch_device("auto").type == "cuda"  # the engine's device
    engine = evaluation.engine  # with its workload (the KV cache's size)
    estimate = memory_estimate(plan, stab, config, engine, backend, gpu)
    on_gpu = state_bytes(plan, stab.accum_dtype, "cuda")  # theta0 and theta_s held there too
    device = states_device(stab.device, on_gpu, estimate["model_bytes"], engine, backend)
    stab = replace(stab, device=device)
    estimate["total"] = host_total(estimate["parts"], device)
    limit = sweep_opts.memory_limit or available_memory()
    check_memory(estimate, limit, stab.checkpoint_dir, len(plan.runs))
    doc = {
        "runs": [r.name for r in plan.runs],
        "evaluated": 0,
        "memory": {
            "estimate": estimate["total"],
            "parts": estimate["parts"],
            "limit": limit,
            "states_device": device,
            "model_bytes": estimate["model_bytes"],
        },
        "backend": backend,
        "engine_starts": 0,
        "written_weight_bytes": 0,
    }
    return doc, stab


def say_resumed(evaluation: Evaluation, at: list[Target], jobs: list[Job]) -> None:
    """A resumed sweep says how much of it was already done (the walk from theta0 comes again)."""
    total = len(at) * len(evaluation.inputs)
    done = total - sum(len(job.tasks) for job in jobs)
    if jobs and done:
        output.log(f"resuming: {done} of {total} evaluations already in {evaluation.results.path}")


def finish_doc(doc: dict, evaluation: Evaluation, at: list[Target], t0: float) -> dict:
    keys = {
        (evaluation.config.name(t.path), r, n)
        for t in at
        for r, _ in t.record_runs()
        for n in evaluation.inputs
    }
    doc["records"] = [r for r in evaluation.results.records if (r["model_path"], r["run"], r["task"]) in keys]
    doc["bema_version"], doc["seconds"] = __version__, time.perf_counter() - t0
    # this process's stages: a Ray actor's or vLLM worker's own time is inside its calls
    doc["stages"] = stages.report()
    timings.save(evaluation.backend_name, doc["stages"])  # this machine's floors for the next projection
    doc["finished_at"] = time.time()  # the engine's teardown at exit comes after (the benchmark separates it)
    return doc


def judge_motion(doc: dict, plan: Plan, out: str | None) -> None:
    """The walk's motion sums in `doc` as `motion` and `motion_verdict` (said on stderr when the
    last window barely moves), and OUT/motion.json beside the results (`bema report` plots it)."""
    sums = doc.pop("motion_sums", None)
    if not sums:
        return
    doc.update(motion.judge(sums, plan.runs))
    if out:
        motion.save(out, plan, doc)


class Walk:
    """One engine holding the walker's states; checkpoints walked in order, each job evaluated at its
    step (a Ray actor runs one too: sweep/ray_split.py)."""

    def __init__(
        self,
        backend_name: str,
        engine: EngineOptions,
        stab: Options,
        plan: Plan,
        folder_of: dict,
        jobs: list[Job],
        aux_of: dict | None = None,
        starter=None,
    ):
        """`starter`: Evaluation.start (--backend auto falls back to transformers when vLLM cannot start)."""
        self.plan, self.folder_of, self.base_folder = plan, folder_of, plan.base_index.folder
        stab = replace(stab, base=str(self.base_folder))  # its device is decided (memory_doc)
        steps = [j.target.step for j in jobs if not j.target.is_base]
        # the engine starts on a checkpoint (its dtype is the disk path's); --follow: the newest, the
        # one least likely to be rotated away while the engine starts
        start = min(steps) if steps else max(folder_of)
        first = (aux_of or {}).get(start, folder_of[start])
        self.walked, self.evaluated, self.evaluate_s, self.walk_s = [], 0, 0.0, 0.0
        self.motion_sums: dict = {}  # the walker's (motion.py): every step walked, from theta0
        self.aux_of = aux_of if aux_of is not None else {}  # --follow: step -> a copy of its small files
        if starter is None:
            self.backend = make_backend(backend_name, engine)
            self.backend.open_source(WALKER, (plan, stab), first)
        else:
            self.backend = starter(lambda backend: backend.open_source(WALKER, (plan, stab), first))
        self.engine_ready_at = time.time()  # the one-time start-up ends here (the benchmark separates it)

    def run(self, jobs: list[Job], write, between=None) -> None:
        """Evaluate `jobs`: theta0's first (the base folder, loaded as `bema eval --base` does), then
        each step's, walking every checkpoint up to the last one a job needs."""
        by_step: dict[int, list[Job]] = {}
        for job in jobs:
            if job.target.is_base:
                self._evaluate(job, write, lambda j=job: self.backend.load(j.target.path))
            else:
                by_step.setdefault(job.target.step, []).append(job)
        last = max(by_step, default=-1)
        done = self.walked[-1] if self.walked else -1
        steps = sorted({s for s in self.plan.read_steps if done < s <= last} | set(by_step))
        with output.countdown(sum(len(j.tasks) for js in by_step.values() for j in js), "evaluations"):
            for step in steps:
                t = time.perf_counter()
                with stages.stage("walk", self.plan.indexes[step].nbytes if step in self.plan.indexes else 0):
                    self.backend.source_call("advance", step)
                self.walk_s += time.perf_counter() - t
                self.walked.append(step)
                for job in by_step.get(step, []):
                    run = None if job.target.run == "vanilla" else job.target.run
                    self._evaluate(
                        job, write, lambda r=run, s=step: self.backend.load_from_source(r, self._folder(s))
                    )
                    if between is not None:
                        between()
                t = time.perf_counter()
                with stages.stage("walk"):
                    self.backend.source_call("finish")
                self.walk_s += time.perf_counter() - t
        if steps:
            self.motion_sums = self.backend.source_call("motion_sums")

    def _folder(self, step: int) -> Path:
        """Where the tokenizer and config files of `step` are: the checkpoint (--follow: their copy)."""
        return self.aux_of.get(step, self.folder_of[step])

    def _evaluate(self, job: Job, write, load) -> None:
        with stages.stage("swap"):
            load()
        for item in job.tasks:
            t = time.perf_counter()
            records, samples = evaluate_task(self.backend, job, item)
            self.evaluate_s += time.perf_counter() - t
            write(records, samples)
            self.evaluated += 1

    def summary(self) -> dict:
        return {
            "evaluated": self.evaluated,
            "engine_starts": 1,
            "walked_steps": self.walked,
            "engine_ready_at": self.engine_ready_at,
            "walk_s": self.walk_s,
            "evaluate_s": self.evaluate_s,
            "motion_sums": self.motion_sums,
        }

    def close(self) -> None:
        self.backend.close()
