"""Held-out (and train) loss: token-weighted mean next-token cross-entropy, in nats.

Records come in the formats TRL's SFTTrainer trains on: `{"text": ...}` and `{"messages": [...]}`
(rendered with the model's chat template) are scored on every token, as SFTTrainer learns them by
default; `{"prompt", "completion"}` (strings, or message lists) on the completion's tokens only, as
SFTTrainer does for that format (`completion_only_loss`). The first `--loss-samples` records, each
truncated to `--loss-max-tokens` tokens. `record_losses` is the transformers backend's forward pass, batched, padding masked
out; vLLM scores the same sequences from its prompt logprobs (backends/vllm_backend.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from bema_cli.eval import chat

NAME = "loss"
DEFAULT_SAMPLES = 200  # records, as in the paper
MAX_TOKENS = 1024  # truncation, as in the paper
BATCH_SIZE = 4


def encode_record(record: dict, tokenizer, max_tokens: int = MAX_TOKENS) -> tuple[list[int], int]:
    """One record -> (its token ids, the first position whose token is scored).

    Chat template for messages; the tokenizer's own specials for text. A completion starts where
    its tokens leave the prompt's (TRL's rule; a tokenizer that merges across the seam moves it)."""
    if "messages" in record:
        ids, start = (
            chat.encode(tokenizer, chat.render(tokenizer, record["messages"], generation_prompt=False)),
            1,
        )
    elif "text" in record:
        ids, start = list(tokenizer(record["text"])["input_ids"]), 1
    elif isinstance(record["prompt"], str):
        prompt = list(tokenizer(record["prompt"])["input_ids"])
        ids = list(tokenizer(record["prompt"] + record["completion"])["input_ids"])
        start = _shared_prefix(prompt, ids)
    else:
        prompt = chat.encode(tokenizer, chat.render(tokenizer, record["prompt"], generation_prompt=True))
        whole = record["prompt"] + record["completion"]
        ids = chat.encode(tokenizer, chat.render(tokenizer, whole, generation_prompt=False))
        start = _shared_prefix(prompt, ids)
    return ids[:max_tokens], max(1, start)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def record_losses(
    model,
    sequences: Sequence[list[int]],
    starts: Sequence[int] | None = None,
    pad_id: int = 0,
    batch_size: int = BATCH_SIZE,
    advance: Callable[[int], None] | None = None,
) -> list[tuple[float, int]]:
    """Per record: (summed next-token cross-entropy in nats, number of scored tokens), scoring
    positions starts[i] (default 1) to the end.

    Batches sequences of similar length (right padding; pad positions carry no loss).
    """
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    out: list[tuple[float, int]] = [(0.0, 0)] * len(sequences)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(sequences[i]) for i in idx)
        if width < 2:
            continue
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i], dtype=torch.long)
            mask[row, : len(sequences[i])] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # [B, T, V]
            for row, i in enumerate(idx):
                first, end = starts[i] if starts else 1, len(sequences[i])  # tokens scored: first..end-1
                if end - first < 1:
                    continue
                nll = F.cross_entropy(
                    logits[row, first - 1 : end - 1].float(), ids[row, first:end].to(device), reduction="sum"
                )
                out[i] = (float(nll.double()), end - first)
        if advance:
            advance(len(idx))
    return out


def loss_items(pairs: Sequence[tuple[float, int]]) -> dict:
    """The record's `items`: each held-out record's summed NLL and token count (by position in the
    loss file's prefix), so `bema select` can resample records: loss = sum(nll) / sum(tokens)."""
    return {"ids": list(range(len(pairs))), "nll": [s for s, _ in pairs], "tokens": [n for _, n in pairs]}


def loss_metrics(pairs: Sequence[tuple[float, int]]) -> dict:
    """loss = sum(nll) / sum(tokens); stderr of that ratio over records (delta method)."""
    pairs = [p for p in pairs if p[1] > 0]
    tokens = sum(n for _, n in pairs)
    if not tokens:
        return {"loss": math.nan, "loss_stderr": math.nan, "tokens": 0}
    loss = sum(s for s, _ in pairs) / tokens
    m = len(pairs)
    if m < 2:
        return {"loss": loss, "loss_stderr": 0.0, "tokens": tokens}
    resid = sum((s - loss * n) ** 2 for s, n in pairs) / (m - 1)
    stderr = math.sqrt(resid / m) / (tokens / m)
    return {"loss": loss, "loss_stderr": stderr, "tokens": tokens}
