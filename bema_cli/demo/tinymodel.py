"""Build a small but real causal LM offline: a BPE tokenizer with a chat template and a Qwen2 model.

Used by `bema demo` (the base model theta0 it fine-tunes) and by the tests (no Hub
downloads anywhere). head_dim is 32 because vLLM's CPU attention needs 32/64/80/...
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from bema_cli.eval.chat import CHATML_TEMPLATE  # one copy of the template, shared with `bema eval`

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE on `texts`; returns a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(
    tokenizer,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    dtype: str = "float32",
):
    """A randomly initialised Qwen2ForCausalLM sized for tests/demos (head_dim = hidden/heads = 32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    return model.to(getattr(torch, dtype))


def save_model(model, tokenizer, path: str | Path) -> Path:
    """Save as an HF model folder (safetensors + config + generation config + tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def default_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """A little generated English/arithmetic text, enough to train the BPE merges."""
    import random

    rng = random.Random(seed)
    words = (
        "the a cat dog bird sees runs jumps over under true false answer question passage "
        "what is plus minus times number think step by step yes no choose letter option"
    ).split()
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        lines.append(f"{sentence}. {a} + {b} = {a + b}. Answer: {rng.choice('ABCD')} #### {a * b}")
    return lines


def make_tiny_model(path: str | Path, seed: int = 0, dtype: str = "float32", **model_kwargs) -> Path:
    """One call for tests: tokenizer + random Qwen2 model saved at `path`."""
    tokenizer = build_tokenizer(default_corpus(seed=seed))
    model = build_model(tokenizer, seed=seed, dtype=dtype, **model_kwargs)
    return save_model(model, tokenizer, path)
