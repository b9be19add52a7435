"""How much memory a sweep will hold, and where its states live, decided before anything is read."""

from __future__ import annotations

import os

from bema_cli import output
from bema_cli.errors import UsageError
from bema_cli.eval.backends.base import EngineOptions
from bema_cli.eval.backends.vllm_backend import default_max_model_len
from bema_cli.eval.backends.vllm_engine import KV_ENV, cpu_kv_cache
from bema_cli.eval.job import EvalConfig
from bema_cli.io.checkpoints import read_json
from bema_cli.io.safetensors import FLOATING
from bema_cli.machine import available_memory
from bema_cli.stabilize import meta
from bema_cli.stabilize.plan import Options, Plan
from bema_cli.stabilize.workspace import torch_device
from bema_cli.sweep.hold import state_bytes

RUNTIME_BYTES = 1 << 30  # Python, torch, tokenizers and the engine's code: measured ~0.8-1 GB RSS


ENGINE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def memory_estimate(
    plan: Plan, opts: Options, config: EvalConfig, engine: EngineOptions, backend: str, gpu: bool = False
) -> dict:
    """Peak bytes the sweep will hold, by part, decided before anything is read. On a GPU machine
    the engine (weights, KV cache) lives in GPU memory and is left out; so are the
    states in `host_total` when `states_device` puts them there."""
    numel = sum(t.numel for t in plan.out_tensors if t.dtype in FLOATING)
    engine_dtype = engine.dtype if engine.dtype != "auto" else meta.out_dtype_name(plan, opts)
    model = numel * ENGINE_BYTES.get(engine_dtype, 4)
    parts = {"states": state_bytes(plan, opts.accum_dtype), "runtime": RUNTIME_BYTES}
    # a swap's per-tensor copies (vLLM rebuilds each layer beside the tensor given to it: the
    # embedding twice), the loss logits and what the allocator keeps: measured 1.2 GB on the 0.5B
    # shape's vLLM sweep once freed blocks go back to the OS (machine.return_freed_memory; 7.35 GB
    # peak against 6.15 GB of named parts, docs/performance.md), counted with a margin
    parts["transients"] = numel * 3
    if not gpu:
        parts["engine_weights"] = model
        if backend == "vllm":  # the size the engine will be given (vllm_engine.kv_cache_kwargs)
            kv = os.environ.get(KV_ENV, "").strip()
            config = read_json(plan.base_index.folder / "config.json")  # the run's architecture
            max_len = engine.max_model_len or default_max_model_len(config)
            parts["kv_cache"] = (
                int(kv) * 2**30
                if kv
                else cpu_kv_cache(config, engine_dtype, engine.workload, max_len, available_memory())[0]
            )
    return {"parts": parts, "model_bytes": model}


def host_total(parts: dict, states_on: str) -> int:
    """The host-memory part of an estimate: all of it but states kept on the GPU."""
    return sum(v for k, v in parts.items() if not (k == "states" and states_on == "cuda"))


def states_device(requested: str, states: int, model: int, engine: EngineOptions, backend: str) -> str:
    """Where the states live: --device, or (auto) the GPU when they fit beside the engine's share
    of it (vLLM takes --gpu-memory-utilization of the whole GPU; transformers the model), else host RAM."""
    device = torch_device(requested).type
    if requested != "auto" or device != "cuda":
        return device
    import torch

    free, total = torch.cuda.mem_get_info()
    engine_share = engine.gpu_memory_utilization * total if backend == "vllm" else 2 * model
    fits = states * 1.1 <= free - engine_share
    output.log(
        f"sweep states: {gb(states)} in {'GPU' if fits else 'host'} memory ({gb(free)} of the GPU free)"
    )
    return "cuda" if fits else "cpu"


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_memory(estimate: dict, limit: int, run_dir: str, grid: int) -> None:
    """Refuse, in one line, a sweep whose estimate does not fit: name the disk path instead."""
    if estimate["total"] <= limit:
        return
    parts = ", ".join(f"{k} {gb(v)}" for k, v in estimate["parts"].items())
    raise UsageError(
        f"{run_dir}: a sweep of {grid} config(s) needs an estimated {gb(estimate['total'])} ({parts}), "
        f"over the {gb(limit)} available (--max-memory); write them instead: bema stabilize then bema eval"
    )
