"""Fitted averages: weights of an average fitted on the pick items, reported on the others.

Every average bema computes is linear in the iterates: at step S it is a coefficient vector c over
(theta0, theta_s1, ..., theta_sN), sum c = 1 (candidate.py). A fitted average is such a vector too,
so it streams like every candidate: `combined` gives sum_j c_j theta_j tensor by tensor, what the
engine is served (`Combiner`), what ship writes (write.write_vector) and what verify compares.

Two fits, both only ever evaluated on the pick items:
- greedy soup (Wortsman et al. 2022, "Model soups", Algorithm 1): ingredients sorted by their pick
  score; add each to the soup (uniform weights over the kept ones) and keep it only if the soup's
  pick score improves;
- simplex weights over the last K checkpoints minimising held-out loss: coordinate search on
  softmax logits (start uniform = LAWA; try +-step on each logit, halve the step when nothing
  improves), a fixed budget of trials. Derivative-free, deterministic, a handful of trials.
Each "improves" is a race on the pick items (race.duel): a trial stops being evaluated as soon as
an anytime-valid interval tells it apart from the incumbent, else it is decided on every pick item.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

from bema_cli.errors import InputError

THETA0 = 0  # the basis index of theta0; checkpoint j (in step order) is j + 1
SIMPLEX_BUDGET = 12  # trials of the simplex search after its uniform start
SIMPLEX_STEP = 1.0  # the first step on a softmax logit (a factor e on that checkpoint's weight)
COMBINE_BLOCK = 1 << 18  # elements summed at a time (2 MB of float64: in cache; 1 << 22 summed 3x slower)


def combined(terms: list[tuple[Path, float]], template: Path) -> Iterator[tuple[object, object]]:
    """(tensor info, sum_j c_j theta_j) tensor by tensor (`terms`: (model folder, c_j)), summed in
    float64 and cast once to the template checkpoint's dtype; non-floating tensors are the template's.
    What write.write_vector writes and what `Combiner` streams into an engine: the same bytes."""
    import torch

    from bema_cli.io.reader import open_checkpoint, read_into
    from bema_cli.io.safetensors import DTYPES, FLOATING

    like = open_checkpoint(template)
    indexes = [(open_checkpoint(folder), c) for folder, c in terms if c != 0]
    for index, _ in indexes:
        if set(index.tensors) != set(like.tensors):
            extra = sorted(set(index.tensors) ^ set(like.tensors))[:1]
            raise InputError(f"{index.folder}: tensors differ from {template}'s (e.g. {extra[0]!r})")
    readers = [index.open() for index, _ in indexes]
    template_reader = like.open()
    for reader in (*readers, template_reader):
        reader.__enter__()
    # reused scratch (the sum, a term, its raw bytes): a fresh float64 block per term and tensor
    # cost more than the sums themselves (page faults); the same sums, the same bytes
    acc_buf = term_buf = torch.empty(0, dtype=torch.float64)
    raw = torch.empty(0, dtype=torch.uint8)
    try:
        for info in like.tensors.values():
            rows = info.shape[0] if info.shape else 1
            if info.dtype not in FLOATING:
                yield info, template_reader.read(info.name, 0, rows).reshape(info.shape)
                continue
            value = torch.empty(info.shape, dtype=getattr(torch, DTYPES[info.dtype][0]))
            flat, row = value.view(-1), max(1, info.numel // rows)
            step = max(1, COMBINE_BLOCK // row)  # rows at a time: float64 scratch bounded, same sums
            block = min(rows, step) * row
            if acc_buf.numel() < block:  # grown to the largest block so far, then reused
                acc_buf = torch.empty(block, dtype=torch.float64)
                term_buf = torch.empty(block, dtype=torch.float64)
                raw = torch.empty(block * 8, dtype=torch.uint8)  # a term's bytes: at most 8 per element
            for lo in range(0, rows, step):
                hi = min(rows, lo + step)
                acc, term = acc_buf[: (hi - lo) * row].zero_(), term_buf[: (hi - lo) * row]
                for reader, (_, c) in zip(readers, indexes, strict=True):
                    read_into(reader, info.name, lo, hi, term, raw)
                    acc.add_(term, alpha=c)
                flat[lo * row : hi * row].copy_(acc)
            yield info, value
    finally:
        for reader in (*readers, template_reader):
            reader.__exit__(None, None, None)


class Combiner:
    """An engine's weight source (as the sweep's Walker is): any coefficient vector over the basis
    (theta0, checkpoints), streamed into the engine with nothing written. `set` names a vector;
    `weights(key)` yields exactly the tensors write.write_vector would write for it."""

    def __init__(self, basis: list[Path], template: Path):
        self.basis, self.template, self.vectors = [Path(b) for b in basis], Path(template), {}

    def set(self, key, c: list[float]) -> None:
        self.vectors[key] = list(c)

    def weights(self, key, dtype=None) -> Iterator[tuple[str, object]]:
        terms = list(zip(self.basis, self.vectors[key], strict=True))
        for info, value in combined(terms, self.template):
            if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                value = value.to(dtype)
            yield info.name, value


def greedy_soup(
    ingredients: list[tuple[str, list[float], float]], better: Callable[[list[float], list[float]], bool]
) -> tuple[list[str], list[float]]:
    """Wortsman et al.'s greedy soup: `ingredients` (name, coefficient vector, pick score: higher is
    better), tried best first; `better(trial, soup)` says whether a trial soup beats the current one
    on the pick items (a race on them: race.duel). Returns the kept names and the soup's
    coefficients (the mean of the kept vectors)."""
    order = sorted(ingredients, key=lambda x: -x[2])
    kept = [order[0]]
    for name, c, _ in order[1:]:
        trial = [*kept, (name, c, 0.0)]
        if better(_mean([x[1] for x in trial]), _mean([x[1] for x in kept])):
            kept = trial
    return [x[0] for x in kept], _mean([x[1] for x in kept])


def _mean(vectors: list[list[float]]) -> list[float]:
    return [sum(col) / len(vectors) for col in zip(*vectors, strict=True)]


def simplex_fit(
    k: int, n: int, better: Callable[[list[float], list[float]], bool]
) -> tuple[list[float], int]:
    """Weights on the simplex over the last `k` of n-1 checkpoints (basis indices n-k..n-1) with the
    lowest held-out loss on the pick items: coordinate search on softmax logits from the uniform
    start, a trial kept when `better(trial, best)`. Every trial is a point not tried before: one
    already beaten (a move back to an incumbent left behind, or a move polled again from the same
    incumbent after a later coordinate's win) would spend the budget on a known answer. Returns
    (c over the whole basis, trials made)."""
    logits, step, calls = [0.0] * k, SIMPLEX_STEP, 0

    def vector(z: list[float]) -> list[float]:
        top = max(z)
        w = [math.exp(x - top) for x in z]
        total = sum(w)
        return [0.0] * (n - k) + [x / total for x in w]

    def point(z: list[float]) -> tuple:  # logits up to a shift are one vector
        return tuple(round(x - z[0], 9) for x in z)

    tried = {point(logits)}
    while calls < SIMPLEX_BUDGET and step > 1e-3:
        improved = False
        for i in range(k):
            for move in (step, -step):
                trial = logits.copy()
                trial[i] += move
                if calls >= SIMPLEX_BUDGET or point(trial) in tried:
                    continue
                tried.add(point(trial))
                calls += 1
                if better(vector(trial), vector(logits)):
                    logits, improved = trial, True
                    break
        if not improved:
            step /= 2
    return vector(logits), calls
