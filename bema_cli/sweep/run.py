"""`bema sweep`: evaluate a whole stabilizer grid at chosen steps without writing a weight file.

One engine (eval's backends) and one step-major walk (walk.py) whose states live where the
weights load: in this process for transformers, in the vLLM worker for vllm. At each --at
step every config's weights are streamed into the engine and evaluated with `bema eval`'s
own code (evaluate.Evaluation for data, resume keys and results files; evaluate_task for
each task), so a sweep record is the record `bema stabilize` + `bema eval` give, except
`model_path` (`sweep:<run>/checkpoint-<step>`: no such folder exists) and the weights'
fingerprint. A killed sweep resumes by walking the checkpoints again (states rebuilt from
theta0, docs/performance.md measures the cost) and evaluating only what results.jsonl lacks.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path

from bema_cli import output, stages
from bema_cli.cluster import ExecutorOptions, import_ray
from bema_cli.errors import UsageError
from bema_cli.eval.backends.base import EngineOptions
from bema_cli.eval.evaluate import Evaluation
from bema_cli.eval.job import EvalConfig
from bema_cli.eval.protocol import validate
from bema_cli.io.commit import locked
from bema_cli.io.watch import Pace
from bema_cli.machine import PeakRss, return_freed_memory
from bema_cli.stabilize.plan import Options
from bema_cli.sweep.follow import Follow
from bema_cli.sweep.project import project
from bema_cli.sweep.ray_split import run_split
from bema_cli.sweep.session import (
    SweepOptions,
    Walk,
    at_steps,
    check_inputs,
    fingerprints,
    finish_doc,
    input_prints,
    judge_motion,
    memory_doc,
    say_resumed,
    targets,
)
from bema_cli.sweep.walk import plan_sweep, sweep_options

__all__ = ["SweepOptions", "sweep"]


def sweep(
    stab: Options,
    config: EvalConfig,
    engine: EngineOptions,
    sweep_opts: SweepOptions,
    executor: ExecutorOptions | None = None,
    follow: Pace | None = None,
    validated=None,
    notes=None,
) -> dict:
    """Run one sweep (batch, or --follow at the given pace); returns the --json document,
    whose memory.peak_rss counts the engine's own processes too (vLLM's engine core runs apart).
    `notes(plan, step)`: a batch sweep's notes on its last step, read off the plan it walked (the
    command's: the lag notes live above the sweep)."""
    stages.reset()
    return_freed_memory()
    with PeakRss() as peak:
        doc = _sweep(stab, config, engine, sweep_opts, executor, follow, validated, notes)
    doc["memory"].update(peak.parts(), peak_device=_device_peak())
    return doc


def _device_peak() -> int | None:
    """The most bytes torch held on the GPU during the sweep (its states, a held checkpoint, a
    transformers engine's model), or None where nothing ran on one: the RSS peaks say nothing of it."""
    torch = sys.modules.get("torch")  # never imported for this alone
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def projection(plan, evaluation, jobs, doc: dict, config: EvalConfig) -> dict:
    """The projected wall time (sweep/project.py) and peak memory (the estimate), said on stderr."""
    from pathlib import Path

    from bema_cli.io.probe import probe
    from bema_cli.machine import engine_speeds
    from bema_cli.stabilize.project import probe_sample, projection_line

    sample = probe_sample(plan)
    if sample is None:
        return {"peak_memory_bytes": doc["memory"]["estimate"]}
    speeds = {**probe(sample, Path(config.out).expanduser()), **engine_speeds()}
    p = project(plan, evaluation, jobs, doc["memory"]["model_bytes"], speeds)
    p["peak_memory_bytes"] = doc["memory"]["estimate"]
    if output.progress_enabled() or output.verbose():  # on a terminal; pipes read it from --json
        output.log(projection_line(p))
    return p


def _sweep(stab, config, engine, sweep_opts, executor, follow, validated, notes=None) -> dict:
    t0 = time.perf_counter()
    validate(config, engine)
    executor = executor or ExecutorOptions()
    if config.out is None:
        raise UsageError("--out: name the results folder")
    if follow is not None and executor.executor != "local":
        raise UsageError("--follow runs one engine beside the trainer: drop --executor ray")
    if executor.executor == "ray":
        import_ray()
    stab = sweep_options(stab)
    if follow is not None:
        return Follow(stab, config, engine, sweep_opts, follow, validated).run(t0)
    plan = plan_sweep(stab)
    folder_of = {c.step: c.path for c in plan.checkpoints}
    steps = at_steps(sweep_opts.at, sorted(folder_of))
    check_inputs(config, folder_of, plan, steps)
    # one writer of OUT at a time (results, samples, libraries.log): a second sweep or eval is refused
    with nullcontext() if sweep_opts.dry_run else locked(Path(config.out).expanduser()):
        if validated is not None:
            validated()
        evaluation = Evaluation(config, engine, executor)
        doc, stab = memory_doc(plan, stab, config, engine, evaluation, sweep_opts)
        at = targets(plan, stab, steps, folder_of)
        jobs = evaluation.plan(at, fingerprints(plan, at, input_prints(folder_of)))
        say_resumed(evaluation, at, jobs)
        doc["projection"] = (
            projection(plan, evaluation, jobs, doc, config) if jobs or sweep_opts.dry_run else None
        )
        if sweep_opts.dry_run:
            doc.update(dry_run=True, backend=evaluation.backend_name, pending=sum(len(j.tasks) for j in jobs))
            return finish_doc(doc, evaluation, at, t0)
        if not jobs:
            output.log(f"up to date: every (config, step, task) is in {evaluation.results.path}")
        elif executor.executor == "ray":
            doc.update(run_split(plan, stab, evaluation, jobs, folder_of, executor))
        else:
            walk = Walk(
                evaluation.backend_name,
                evaluation.engine,
                stab,
                plan,
                folder_of,
                jobs,
                starter=evaluation.start,
            )
            try:
                walk.run(jobs, evaluation.write)
            finally:
                walk.close()
            doc.update(walk.summary(), backend=evaluation.backend_name)
        judge_motion(doc, plan, config.out)
        done = finish_doc(doc, evaluation, at, t0)
        evaluated = [
            r["step"] for r in done.get("records", []) if isinstance(r.get("step"), int) and r["step"] > 0
        ]
        if notes is not None and evaluated:
            done["notes"] = notes(plan, max(evaluated))
        return done
