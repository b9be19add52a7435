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

import hashlib
import json
import os
import resource
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bema_cli import __version__, output
from bema_cli.errors import UsageError
from bema_cli.eval import resume
from bema_cli.eval.backends.base import EngineOptions, make_backend
from bema_cli.eval.evaluate import EvalConfig, Evaluation, Job, evaluate_task, validate
from bema_cli.eval.targets import STABILIZER_KEYS, VANILLA, Target, check_model_dir
from bema_cli.eval.tasks import LOSS_TASKS
from bema_cli.io.commit import check_apart
from bema_cli.io.fingerprint import fingerprint, weight_files
from bema_cli.io.safetensors import DTYPES, FLOATING
from bema_cli.stabilize import meta
from bema_cli.stabilize.plan import Options, Plan
from bema_cli.stabilize.unit import torch_device
from bema_cli.sweep.walk import plan_sweep, state_bytes, sweep_options

SWEEP_SCHEME = "sweep:"  # model_path of a config's record: evaluated from memory, never on disk
CPU_KV_DEFAULT_GIB = 4  # vLLM-CPU's KV cache when VLLM_CPU_KVCACHE_SPACE is unset
RUNTIME_BYTES = 1 << 30  # Python, torch, tokenizers and the engine's code: measured ~0.8-1 GB RSS


@dataclass
class SweepOptions:
    at: str = "all"  # all | last | every:N | S1,S2,... (0: theta0)
    memory_limit: int | None = None  # bytes the sweep may hold; None: MemAvailable


def at_steps(text: str, steps: list[int]) -> list[int]:
    """The steps --at names, among the run's checkpoint steps (0: theta0, the base)."""
    text = text.strip()
    if text == "all":
        return list(steps)
    if text == "last":
        return steps[-1:]
    if text.startswith("every:"):
        try:
            n = int(text.removeprefix("every:"))
        except ValueError:
            n = 0
        if n < 1:
            raise UsageError(f"--at: every:N needs a whole number N >= 1, got {text!r}")
        chosen = [s for s in steps if s % n == 0]
        if not chosen:
            raise UsageError(f"--at {text}: no checkpoint step is a multiple of {n} (found {_list(steps)})")
        return chosen
    chosen = []
    for part in text.split(","):
        try:
            step = int(part)
        except ValueError:
            raise UsageError(f"--at: all, last, every:N or a comma list of steps, got {text!r}") from None
        if step != 0 and step not in steps:
            raise UsageError(f"--at: no checkpoint at step {step} (found {_list(steps)}; 0 is theta0)")
        chosen.append(step)
    return sorted(set(chosen))


def _list(steps: list[int]) -> str:
    return (
        ", ".join(map(str, steps))
        if len(steps) <= 12
        else f"{steps[0]}, ..., {steps[-1]} ({len(steps)} steps)"
    )


def _stabilizer(plan: Plan, opts: Options, run, step: int, source: Path) -> dict:
    """The stabilizer a record carries: what `bema eval` reads from that output's bema.json."""
    record = meta.record(run, step, source, plan.base_source, opts, meta.out_dtype_name(plan, opts))
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


def fingerprints(plan: Plan, at: list[Target]) -> dict[Path, str]:
    """Resume keys' `weights`: the files' own fingerprint for vanilla and theta0 (as `bema eval`
    takes it), and for a config a digest of its stabilizer, its step and every input up to it."""
    inputs = {c.step: fingerprint(weight_files(c.path)) for c in plan.checkpoints}
    base = fingerprint(weight_files(plan.base_index.folder))
    out = {}
    for t in at:
        if str(t.path).startswith(SWEEP_SCHEME):
            doc = {"stabilizer": t.stabilizer, "step": t.step, "base": base,
                   "inputs": [inputs[s] for s in sorted(inputs) if s <= t.step]}  # fmt: skip
            out[t.path] = "sweep:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
        else:
            out[t.path] = resume.weights_fingerprint(t.path)
    return out


def memory_estimate(
    plan: Plan, opts: Options, config: EvalConfig, engine: EngineOptions, backend: str
) -> dict:
    """Peak bytes the sweep will hold, by part, decided before anything is read."""
    numel = sum(t.numel for t in plan.out_tensors if t.dtype in FLOATING)
    engine_dtype = engine.dtype if engine.dtype != "auto" else meta.out_dtype_name(plan, opts)
    model = (
        numel
        * DTYPES.get({"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(engine_dtype, "F32"))[1]
    )
    parts = {"states": state_bytes(plan, opts.accum_dtype), "engine_weights": model, "runtime": RUNTIME_BYTES}
    if backend == "vllm" and any(t in LOSS_TASKS for t in config.tasks):
        parts["loss_model"] = model  # a transformers copy beside the engine, as `bema eval` has
    if backend == "vllm":
        kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        parts["kv_cache"] = int(float(kv or CPU_KV_DEFAULT_GIB) * 2**30)
    return {"parts": parts, "total": sum(parts.values())}


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping), else physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_memory(estimate: dict, limit: int, run_dir: str, grid: int) -> None:
    """Refuse, in one line, a sweep whose estimate does not fit: name the disk path instead."""
    if estimate["total"] <= limit:
        return
    parts = ", ".join(f"{k} {_gb(v)}" for k, v in estimate["parts"].items())
    raise UsageError(
        f"{run_dir}: a sweep of {grid} config(s) needs an estimated {_gb(estimate['total'])} ({parts}), "
        f"over the {_gb(limit)} available (--max-memory); write them instead: bema stabilize then bema eval"
    )


def sweep(
    stab: Options,
    config: EvalConfig,
    engine: EngineOptions,
    sweep_opts: SweepOptions,
    executor=None,
    follow: dict | None = None,
    validated=None,
) -> dict:
    """Run one sweep; returns the --json document (records, memory, timings)."""
    t0 = time.perf_counter()
    validate(config, engine)
    if config.out is None:
        raise UsageError("--out: name the results folder")
    plan = plan_sweep(stab)
    stab = sweep_options(stab)
    if plan.lora_rank is not None:
        raise UsageError("--lora-output adapter: a sweep evaluates merged models only")
    folder_of = {c.step: c.path for c in plan.checkpoints}
    steps = at_steps(sweep_opts.at, sorted(folder_of))
    check_apart(
        Path(config.out).expanduser(), list(folder_of.values()) + [plan.base_index.folder], may_contain=True
    )
    for step in steps:
        if step:
            check_model_dir(folder_of[step])  # tokenizer and config files come from the checkpoint
    if validated is not None:
        validated()
    evaluation = Evaluation(config, engine)
    estimate = memory_estimate(plan, stab, config, engine, evaluation.backend_name)
    limit = sweep_opts.memory_limit or available_memory()
    check_memory(estimate, limit, stab.checkpoint_dir, len(plan.runs))
    at = targets(plan, stab, steps, folder_of)
    jobs = evaluation.plan(at, fingerprints(plan, at))
    doc = {"runs": [r.name for r in plan.runs], "steps": steps, "evaluated": 0,
           "memory": {"estimate": estimate["total"], "parts": estimate["parts"], "limit": limit},
           "backend": evaluation.backend_name, "engine_starts": 0, "written_weight_bytes": 0}  # fmt: skip
    if jobs:
        doc.update(_run(plan, stab, evaluation, jobs, folder_of))
    else:
        output.log(f"up to date: every (config, step, task) is in {evaluation.results.path}")
    keys = {(str(t.path), r, n) for t in at for r, _ in t.record_runs() for n in evaluation.inputs}
    doc["records"] = [r for r in evaluation.results.records if (r["model_path"], r["run"], r["task"]) in keys]
    doc["memory"]["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    doc["bema_version"], doc["seconds"] = __version__, time.perf_counter() - t0
    return doc


def _run(plan: Plan, stab: Options, evaluation: Evaluation, jobs: list[Job], folder_of: dict) -> dict:
    """The walk: one engine, every checkpoint up to the last pending step read once, in order."""
    base_jobs = [j for j in jobs if j.target.is_base]
    by_step: dict[int, list[Job]] = {}
    for job in jobs:
        if not job.target.is_base:
            by_step.setdefault(job.target.step, []).append(job)
    last = max(by_step, default=0)
    walk = sorted({s for s in plan.read_steps if s <= last} | set(by_step))
    device = torch_device(stab.device)
    stab = replace(stab, device=device.type, base=str(plan.base_index.folder))
    first = folder_of[min(by_step)] if by_step else plan.base_index.folder
    backend = make_backend(evaluation.backend_name, evaluation.engine)
    evaluated, timing = 0, {"evaluate_s": 0.0}
    try:
        backend.open_sweep(stab, first)
        for job in base_jobs:  # theta0: the base folder itself, loaded as `bema eval --base` loads it
            evaluated += _evaluate(
                backend, evaluation, job, timing, load=lambda j=job: backend.load(j.target.path)
            )
        with output.progress("steps") as bar:
            task = bar.add_task("sweeping (checkpoints walked)", total=len(walk))
            for step in walk:
                backend.sweep_advance(step)
                for job in by_step.get(step, []):
                    run = None if job.target.run == "vanilla" else job.target.run
                    load = lambda r=run, s=step: backend.sweep_load(r, folder_of[s])  # noqa: E731
                    evaluated += _evaluate(backend, evaluation, job, timing, load)
                backend.sweep_finish()
                bar.advance(task)
    finally:
        backend.close()
    return {"evaluated": evaluated, "engine_starts": 1, "walked_steps": walk, **timing}


def _evaluate(backend, evaluation: Evaluation, job: Job, timing: dict, load) -> int:
    load()
    for item in job.tasks:
        t = time.perf_counter()
        records, samples = evaluate_task(backend, job, item)
        timing["evaluate_s"] += time.perf_counter() - t
        evaluation.write(records, samples)
    return len(job.tasks)
