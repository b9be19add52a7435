"""CPU fallback backend: plain transformers, batched `generate`, one row per (prompt, sample).

Same prompts (token ids of the chat-rendered text), same sampling (temperature, no
top-k/top-p truncation, explicit stop ids), the same per-prompt seeds and the same scoring as
vLLM. The logits differ in rounding between the two implementations, so only greedy outputs
are promised to agree token for token across backends.
"""

from __future__ import annotations

import math
from pathlib import Path

from bema_cli import output
from bema_cli.errors import BackendError, UsageError
from bema_cli.eval import chat
from bema_cli.eval.backends.base import EngineOptions, Sampling, plugin, resolve_dtype
from bema_cli.eval.tasks import loss as loss_task

DTYPES = ("auto", "float32", "bfloat16", "float16")


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise UsageError(f"--dtype: unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return "auto" if name == "auto" else getattr(torch, name)


def load_hf_model(path: str | Path, dtype: str = "auto", device: str | None = None):
    """An AutoModelForCausalLM in eval mode; one-line BackendError when it cannot be loaded."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not output.progress_enabled():
        hf_logging.disable_progress_bar()  # no "Loading weights" bars in logs and pipes
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype))
    except Exception as exc:  # corrupt weights surface as many exception types
        raise BackendError(
            f"{path}: transformers cannot load the model ({str(exc).splitlines()[0]})"
        ) from None
    return model.to(device).eval()


def empty_model(folder: str | Path, dtype: str):
    """A model of `folder`'s architecture (its config.json) in `dtype`, in eval mode, its weights not
    read: `bema sweep` fills them from its states (load_weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    except Exception as exc:
        raise BackendError(
            f"{folder}: transformers cannot build the model ({str(exc).splitlines()[0]})"
        ) from None
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def load_weights(model, weights, where) -> None:
    """Copy (name, tensor) pairs into a live model's parameters in place (`param.copy_` casts to the
    model's dtype, as from_pretrained does): `bema sweep` swaps configs without writing files.
    Every parameter must be given (a tied head shares the embedding's storage, so it is)."""
    import torch

    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    missing = set(dict(model.named_parameters()))
    with torch.no_grad():
        for name, tensor in weights:
            target = params.get(name)
            if target is None or tuple(target.shape) != tuple(tensor.shape):
                raise BackendError(f"{where}: tensor {name!r} does not fit the loaded transformers model")
            target.copy_(tensor)
            missing.discard(name)
    if missing:
        raise BackendError(f"{where}: the weights lack parameter {sorted(missing)[0]!r}")


def dtype_name(torch_dtype_value) -> str:
    return str(torch_dtype_value).removeprefix("torch.")


class TransformersBackend:
    name = "transformers"

    def __init__(self, options: EngineOptions):
        self.options = options
        self.model = None
        self.path: Path | None = None
        self.dtype = options.dtype
        self.source = None  # a weight source (open_source)

    def load(self, checkpoint: Path) -> None:
        self.tokenizer, self.template_source, self.stop_ids = chat.load_chat(
            checkpoint, self.options.chat_template
        )
        self.model = None  # free the previous checkpoint first
        self.model = load_hf_model(checkpoint, resolve_dtype(self.options.dtype, checkpoint))
        self.dtype = dtype_name(self.model.dtype)
        self.path = Path(checkpoint)

    # a weight source (`bema sweep`'s walker) lives in this process; each key's weights are copied
    # into the one live model, no file written
    def open_source(self, factory: str, args: tuple, folder: Path) -> None:
        self.tokenizer, self.template_source, self.stop_ids = chat.load_chat(
            folder, self.options.chat_template
        )
        self.model = empty_model(folder, resolve_dtype(self.options.dtype, folder))
        self.dtype, self.path = dtype_name(self.model.dtype), Path(folder)
        self.source = plugin(factory)(*args)

    def source_call(self, method: str, *args):
        return getattr(self.source, method)(*args)

    def load_from_source(self, key, folder: Path) -> None:
        """The source's weights for `key` (the sweep: a config, None for theta_s); tokenizer files
        from `folder`."""
        if Path(folder) != self.path:
            self.tokenizer, self.template_source, self.stop_ids = chat.load_chat(
                folder, self.options.chat_template
            )
            self.path = Path(folder)
        load_weights(self.model, self.source.weights(key, self.model.dtype), folder)

    def generate(self, prompts: list[str], sampling: Sampling, seeds: list[int]) -> list[list[str]]:
        """For each prompt, n completions; sample j of prompt i is drawn with its own generator
        seeded seeds[i] + j (SeededSampler), so it does not depend on the batch it ran in."""
        import torch

        pad = self.tokenizer.pad_token_id
        device = self.model.device
        greedy = sampling.temperature == 0
        copies = 1 if greedy else sampling.n  # greedy samples are all identical: decode once
        kwargs = dict(
            do_sample=False,
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=1,
            eos_token_id=self.stop_ids,
            pad_token_id=pad,
            top_k=None,
            top_p=None,
            min_p=None,
            temperature=None,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
        )
        encoded = [chat.encode(self.tokenizer, p) for p in prompts]
        results: list[list[str]] = []
        size = self.options.batch_size
        for start in output.track(range(0, len(encoded), size), "generating", total=-(-len(encoded) // size)):
            batch = [seq for seq in encoded[start : start + size] for _ in range(copies)]
            width = max(len(ids) for ids in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, seq in enumerate(batch):  # left padding: every prompt ends where generation starts
                ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
                mask[row, width - len(seq) :] = 1
            if not greedy:
                rows = [seed + j for seed in seeds[start : start + size] for j in range(copies)]
                kwargs["logits_processor"] = [SeededSampler(sampling.temperature, rows, device)]
            with torch.no_grad():
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
            new = out[:, width:].tolist()
            for row in range(0, len(batch), copies):
                texts = [
                    chat.decode_completion(self.tokenizer, new[row + j], self.stop_ids) for j in range(copies)
                ]
                results.append(texts * sampling.n if greedy else texts)
        return results

    def loss(self, sequences: list[list[int]], starts: list[int] | None = None) -> list[tuple[float, int]]:
        return loss_task.record_losses(self.model, sequences, starts, pad_id=self.tokenizer.pad_token_id or 0)

    def close(self) -> None:
        source, self.source = self.source, None
        if hasattr(source, "close"):  # a weight source keeps files open (the sweep's walker)
            source.close()
        self.model = None


class SeededSampler:
    """A logits processor that samples: each row's next token is drawn from softmax(scores / T) with
    that row's own torch.Generator, and returned as the only finite score, so greedy decoding
    takes it. Drawn as vLLM's sampler draws (argmax of p / q, q ~ Exp(1): the exponential race),
    one draw of the vocabulary per row per step, so a row's stream depends on its seed alone."""

    def __init__(self, temperature: float, seeds: list[int], device):
        import torch

        self.temperature = temperature
        self.generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids, scores):
        import torch

        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        race = torch.empty_like(probs)
        for row, generator in enumerate(self.generators):
            race[row].exponential_(generator=generator)
        picked = probs.div_(race).argmax(dim=-1)
        chosen = torch.full_like(scores, -math.inf)
        chosen[torch.arange(len(picked)), picked] = 0.0
        return chosen


def make(options: EngineOptions) -> TransformersBackend:
    return TransformersBackend(options)
