"""Fitted averages: weights of an average fitted on the pick items, reported on the others.

Every average bema computes is linear in the iterates: at step S it is a coefficient vector c over
(theta0, theta_s1, ..., theta_sN), sum c = 1. `coefficients` gets each menu config's vector from
the real stabilize engine, run in float64 on a basis trajectory (theta0 = e_0, theta_sj = e_j): the
same recurrences, no second implementation. A fitted average is such a vector too, so it streams
like every method: `combine` writes sum_j c_j theta_j tensor by tensor through the sharded writer,
and bema.json records the coefficients.

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

import hashlib
import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from bema_cli import __version__
from bema_cli.errors import InputError
from bema_cli.io import provenance

THETA0 = 0  # the basis index of theta0; checkpoint j (in step order) is j + 1
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")  # fmt: skip
SIMPLEX_BUDGET = 12  # trials of the simplex search after its uniform start
SIMPLEX_STEP = 1.0  # the first step on a softmax logit (a factor e on that checkpoint's weight)
COMBINE_BLOCK = 1 << 22  # elements summed at a time (32 MB of float64), not a whole embedding


def coefficients(schedules: list, steps: list[int], at: int, work: Path) -> dict[str, list[float]]:
    """{run name: c} with c[0] theta0's coefficient and c[j] the j-th checkpoint's (steps in order),
    computed by `bema stabilize` itself on a basis trajectory in `work`."""
    import torch
    from safetensors.torch import load_file, save_file

    from bema_cli.schedule import run_name
    from bema_cli.stabilize import Options, stabilize

    n = len(steps) + 1
    shutil.rmtree(work, ignore_errors=True)
    config = json.dumps({"model_type": "basis", "dtype": "float64"})
    for j, folder in enumerate([work / "base", *(work / "run" / f"checkpoint-{s}" for s in steps)]):
        folder.mkdir(parents=True)
        save_file({"c": torch.eye(n, dtype=torch.float64)[j].contiguous()}, folder / "model.safetensors")
        (folder / "config.json").write_text(config)
    opts = Options(checkpoint_dir=str(work / "run"), schedules=schedules, out=str(work / "out"),
                   base=str(work / "base"), steps=[at], accum_dtype="float64", no_state=True)  # fmt: skip
    stabilize(opts)
    out = {}
    for s in schedules:
        folder = work / "out" / run_name(s) / f"checkpoint-{at}"
        out[run_name(s)] = load_file(folder / "model.safetensors")["c"].tolist()
    shutil.rmtree(work, ignore_errors=True)
    return out


def combined(terms: list[tuple[Path, float]], template: Path) -> Iterator[tuple[object, object]]:
    """(tensor info, sum_j c_j theta_j) tensor by tensor (`terms`: (model folder, c_j)), summed in
    float64 and cast once to the template checkpoint's dtype; non-floating tensors are the template's.
    What `combine` writes and what `Combiner` streams into an engine: the same bytes."""
    import torch

    from bema_cli.io.reader import open_checkpoint
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
    try:
        for info in like.tensors.values():
            rows = info.shape[0] if info.shape else 1
            if info.dtype not in FLOATING:
                yield info, template_reader.read(info.name, 0, rows).reshape(info.shape)
                continue
            dtype = getattr(torch, DTYPES[info.dtype][0])
            value = torch.empty(info.shape, dtype=dtype)
            flat, row = value.view(rows, -1), max(1, info.numel // rows)
            step = max(1, COMBINE_BLOCK // row)  # rows at a time: float64 scratch bounded, same sums
            for lo in range(0, rows, step):
                hi = min(rows, lo + step)
                acc = torch.zeros((hi - lo, row), dtype=torch.float64)
                for reader, (_, c) in zip(readers, indexes, strict=True):
                    acc.add_(reader.read(info.name, lo, hi).reshape(hi - lo, row).double(), alpha=c)
                flat[lo:hi] = acc.to(dtype)
            yield info, value
    finally:
        for reader in (*readers, template_reader):
            reader.__exit__(None, None, None)


def combine(terms: list[tuple[Path, float]], template: Path, out: Path, record: dict) -> Path:
    """`combined(terms, template)` written to `out` through the sharded writer; the template's small
    files (config, tokenizer) and `record` as bema.json beside the weights."""
    from bema_cli.io.reader import open_checkpoint
    from bema_cli.io.writer import ShardedWriter, plan_shards, tensor_bytes

    tensors = list(open_checkpoint(template).tensors.values())
    inputs = {str(folder): provenance.input_print(folder) for folder, c in terms if c != 0}
    coefficients = {str(folder): c for folder, c in terms if c != 0}
    meta = {"format": "pt", **provenance.metadata(record, inputs, coefficients)}
    writer = ShardedWriter(out, plan_shards(tensors, 5 * 10**9), meta).open()
    with writer.held():
        for info, value in combined(terms, template):
            writer.write(info.name, 0, tensor_bytes(value))
    writer.close()
    for name in SMALL_FILES:
        if (template / name).is_file():
            shutil.copy2(template / name, out / name)
    (out / "bema.json").write_text(json.dumps(record, indent=2) + "\n")
    return out


class Combiner:
    """An engine's weight source (as the sweep's Walker is): any coefficient vector over the basis
    (theta0, checkpoints), streamed into the engine with nothing written. `set` names a vector;
    `weights(key)` yields exactly the tensors `combine` would write for it."""

    def __init__(self, basis: list[Path], template: Path):
        self.basis, self.template, self.vectors = [Path(b) for b in basis], Path(template), {}

    def set(self, key: str, c: list[float]) -> None:
        self.vectors[key] = list(c)

    def weights(self, key: str | None, dtype=None) -> Iterator[tuple[str, object]]:
        terms = list(zip(self.basis, self.vectors[key], strict=True))
        for info, value in combined(terms, self.template):
            if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                value = value.to(dtype)
            yield info.name, value


def fitted_record(name: str, method: str, step: int, c: list[float], folders: list[Path], base_source: str,
                  template: Path, **extra) -> dict:  # fmt: skip
    """bema.json of a fitted average: its coefficients over (theta0, each checkpoint) by folder."""
    return {
        "bema_version": __version__, "run": name, "method": method, "step": step,
        "coefficients": {"theta0": c[0], **{str(f): w for f, w in zip(folders, c[1:], strict=True) if w}},
        "source_checkpoint": str(template), "theta0_source": base_source, "accum_dtype": "float64",
        "out_dtype": "input", **extra,
    }  # fmt: skip


def digest(c: list[float]) -> str:
    return hashlib.sha256(json.dumps([round(x, 12) for x in c]).encode()).hexdigest()[:10]


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
    start, a trial kept when `better(trial, best)`. Returns (c over the whole basis, trials made)."""
    logits, step, calls = [0.0] * k, SIMPLEX_STEP, 0

    def vector(z: list[float]) -> list[float]:
        top = max(z)
        w = [math.exp(x - top) for x in z]
        total = sum(w)
        return [0.0] * (n - k) + [x / total for x in w]

    while calls < SIMPLEX_BUDGET and step > 1e-3:
        improved = False
        for i in range(k):
            for move in (step, -step):
                if calls >= SIMPLEX_BUDGET:
                    break
                trial = logits.copy()
                trial[i] += move
                calls += 1
                if better(vector(trial), vector(logits)):
                    logits, improved = trial, True
                    break
        if not improved:
            step /= 2
    return vector(logits), calls
