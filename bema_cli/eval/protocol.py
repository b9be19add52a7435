"""What a `bema eval` setting means before anything runs: the settings checked (usage errors),
each task's protocol (everything that changes its numbers, the resume key's core) and its seeds."""

from __future__ import annotations

import math
import os
from pathlib import Path

from bema_cli.errors import UsageError
from bema_cli.eval.backends.base import BACKENDS, SEED_RULE, SEED_SCHEME, EngineOptions
from bema_cli.eval.job import EvalConfig
from bema_cli.eval.tasks import LOSS_TASKS, get_task, is_lm_eval


def _max_n_samples() -> int:
    try:
        return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))
    except ValueError:
        return 16384


MAX_N_SAMPLES = _max_n_samples()  # vLLM's own limit on n per request (its env var, default 16384)


def validate(config: EvalConfig, engine: EngineOptions) -> None:
    """Nonsense values are usage errors (exit 2), before anything is loaded or written."""
    c = config
    if not c.tasks:
        raise UsageError("--tasks: no task given")
    for name in c.tasks:
        if is_lm_eval(name):
            if not name[len("lm_eval:") :]:
                raise UsageError(f"--tasks: {name!r} names no lm-eval task (lm_eval:<task>)")
        else:
            get_task(name)  # unknown names fail here, before any model is read
    if c.backend not in BACKENDS:
        raise UsageError(f"--backend: unknown backend {c.backend!r} (choose from {', '.join(BACKENDS)})")
    checks = [
        ("--n-samples", c.n_samples, 1),
        ("--limit", c.limit, 1),
        ("--max-new-tokens", c.max_new_tokens, 1),
        ("--loss-samples", c.loss_samples, 1),
        ("--loss-max-tokens", c.loss_max_tokens, 2),
        ("--num-fewshot", c.num_fewshot, 0),
        ("--batch-size", engine.batch_size, 1),
        ("--max-model-len", engine.max_model_len, 16),
        ("--tensor-parallel-size", engine.tensor_parallel_size, 1),
        ("--data-parallel-size", engine.data_parallel_size, 1),
    ]
    for flag, value, least in checks:
        if value is not None and value < least:
            raise UsageError(f"{flag}: must be at least {least}, got {value}")
    if c.n_samples > MAX_N_SAMPLES:  # vLLM refuses past it only after sizing its KV cache for the run
        raise UsageError(
            f"--n-samples: at most {MAX_N_SAMPLES} samples per prompt (vLLM's VLLM_MAX_N_SEQUENCES), "
            f"got {c.n_samples}"
        )
    if not (math.isfinite(c.temperature) and c.temperature >= 0):
        raise UsageError(f"--temperature: must be a finite number >= 0 (0 = greedy), got {c.temperature}")
    if not 0 < engine.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization: must be in (0, 1], got {engine.gpu_memory_utilization}")
    if c.log_samples and c.out is None:
        raise UsageError("--log-samples needs --out")
    if c.lm_eval_include is not None and not Path(c.lm_eval_include).is_dir():
        raise UsageError(f"--lm-eval-include: {c.lm_eval_include} is not a folder")


def task_protocol(config: EvalConfig, name: str, source: str) -> dict:
    """Everything about a task that changes its numbers, except seeds, engine and model."""
    if name in LOSS_TASKS:
        return {"data": source, "loss_samples": config.loss_samples, "max_tokens": config.loss_max_tokens}
    if is_lm_eval(name):
        return {
            "lm_eval_task": name.split(":", 1)[1],
            "include": source,
            "num_fewshot": config.num_fewshot or None,
            "limit": config.limit,
            "max_new_tokens": config.max_new_tokens,
        }
    task = get_task(name)
    return {
        "n_samples": config.n_samples,
        "temperature": config.temperature,
        "top_p": 1.0,
        "max_new_tokens": config.max_new_tokens or task.MAX_NEW_TOKENS,
        "limit": config.limit or task.DEFAULT_LIMIT,
        "selection_seed": config.selection_seed,
        "data": source,
        "prompt_version": task.PROMPT_VERSION,
        "num_fewshot": config.num_fewshot,
        "scoring_version": getattr(task, "SCORING_VERSION", 1),
        "cot": config.cot,
    }


def seeds(config: EvalConfig, name: str) -> dict:
    if is_lm_eval(name):
        from bema_cli.eval.lm_eval_bridge import SEEDS

        return dict(SEEDS)
    return {
        "sampling": config.seed,
        "selection": config.selection_seed,
        "scheme": SEED_SCHEME,
        "per_prompt": SEED_RULE,
    }
