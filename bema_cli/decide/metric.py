"""A metric and a record's per-item scores: what `select`, `ship` and the race compare.

A record of `bema eval` carries each item's score (`items`: each prompt's accuracy over its samples,
or each held-out record's summed NLL and token count); a metric's value on any set of items, a
bootstrap draw's included, is recomputed from them (docs/eval-protocol.md, "Selecting").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bema_cli.errors import InputError, UsageError

SCORINGS = ("flexible", "strict")


@dataclass(frozen=True)
class Metric:
    task: str
    key: str  # "loss", or "flexible"/"strict" (the record's accuracy_<key>)
    higher_is_better: bool

    @property
    def name(self) -> str:
        return self.task if self.task == "loss" else f"{self.task}:{self.key}"


def parse_metric(text: str) -> Metric:
    """'loss' | '<task>' | '<task>:strict' | '<task>:flexible' (flexible by default, as report plots)."""
    if text.startswith("lm_eval:"):
        raise UsageError(
            f"--metric {text}: lm-eval records hold lm-eval's aggregate metrics only, no per-item scores, "
            "and select's paired intervals need them; select on a bema task or loss"
        )
    task, _, scoring = text.partition(":")
    if not task:
        raise UsageError("--metric: name a task (loss, gsm8k, boolq, mmlu_hs[:strict|:flexible])")
    if task in ("loss", "train_loss"):
        if scoring:
            raise UsageError(f"--metric {text}: loss has no :{scoring} variant")
        return Metric(task, "loss", False)
    if scoring and scoring not in SCORINGS:
        raise UsageError(f"--metric {text}: choose :strict or :flexible")
    return Metric(task, scoring or "flexible", True)


def value(items: dict, metric: Metric, idx=None):
    """The metric on items (all, or the index array/matrix `idx` of a resample: one value per row)."""
    import numpy as np

    if metric.key == "loss":
        nll, tokens = np.asarray(items["nll"], float), np.asarray(items["tokens"], float)
        if idx is None:
            return float(nll.sum() / tokens.sum())
        return nll[idx].sum(axis=-1) / tokens[idx].sum(axis=-1)
    scores = np.asarray(items[metric.key], float)
    return float(scores.mean()) if idx is None else scores[idx].mean(axis=-1)


def per_item(record: dict, metric: Metric, where: str) -> dict:
    """A record's per-item scores, checked whole: ids, and for each needed key a list of finite
    numbers as long as the ids; a NaN or infinity is an error naming the item, never a winner."""
    items = record.get("items")
    needed = ("nll", "tokens") if metric.key == "loss" else (metric.key,)
    if not isinstance(items, dict) or any(k not in items for k in ("ids", *needed)):
        raise InputError(
            f"{where}: no per-item scores (records of bema < 0.5, or an lm_eval task); "
            "re-run bema eval (it resumes nothing for them: pass a new --out)"
        )
    ids = items["ids"]
    if not isinstance(ids, list) or not ids:
        raise InputError(f"{where}: items.ids is not a non-empty list")
    for key in needed:
        values = items[key]
        if not isinstance(values, list) or len(values) != len(ids):
            n = len(values) if isinstance(values, list) else type(values).__name__
            raise InputError(f"{where}: items.{key} holds {n} scores for {len(ids)} ids")
        for i, v in zip(ids, values, strict=True):
            if v is None:
                raise InputError(f"{where}: item {i!r} has no {key} score")
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise InputError(f"{where}: item {i!r}'s {key} score {v!r} is not a number")
            if not math.isfinite(v):
                raise InputError(
                    f"{where}: item {i!r}'s {key} score is {v} (a non-finite score is never compared)"
                )
    return items


def metric_value(record: dict, metric: Metric) -> float:
    """The metric on every item of the record."""
    return float(value(per_item(record, metric, record.get("_where", "a record")), metric))


def restrict(record: dict, ids: list, metric: Metric) -> dict:
    """The record on `ids` alone (its per-item scores in that order): what a finalist scored only on
    the report items is compared with."""
    items = per_item(record, metric, record.get("_where", record.get("model_path", "a record")))
    pos = {i: n for n, i in enumerate(items["ids"])}
    keys = ("nll", "tokens") if metric.key == "loss" else (metric.key,)
    picked = {"ids": list(ids), **{k: [items[k][pos[i]] for i in ids] for k in keys}}
    return {**record, "items": picked, "n_prompts": len(ids)}


FLIP_IDS = 5  # the item ids a flip table names on each side (the counts are whole)


def flips(record: dict, vanilla: dict, metric: Metric) -> dict | None:
    """An accuracy task's flip table, what lm-eval users ask of a new model: the items `record` gets
    right more often than vanilla (gained) and less often (lost), counted on the items both scored
    (a prompt's score is its samples' share right), with the first FLIP_IDS ids of each. None for a
    loss, whose items have no right or wrong."""
    if metric.key == "loss":
        return None
    mine = per_item(record, metric, record.get("_where", "a record"))
    theirs = per_item(vanilla, metric, vanilla.get("_where", "vanilla"))
    base = dict(zip(theirs["ids"], theirs[metric.key], strict=True))
    shared = [(i, s, base[i]) for i, s in zip(mine["ids"], mine[metric.key], strict=True) if i in base]
    gained = [i for i, s, v in shared if s > v]
    lost = [i for i, s, v in shared if s < v]
    return {
        "items": len(shared),
        "gained": len(gained),
        "lost": len(lost),
        "gained_ids": gained[:FLIP_IDS],
        "lost_ids": lost[:FLIP_IDS],
    }


def flip_note(task: str, run: str, table: dict) -> str:
    """The flip table in one sentence (ship's notes: the verdict's, `report DIR`'s and the card's)."""

    def ids(xs: list, n: int) -> str:
        return f" ({', '.join(map(str, xs))}{', ...' if n > len(xs) else ''})" if xs else ""

    return (
        f"{task}: of {table['items']} items, {run} is right more often than vanilla on {table['gained']}"
        f"{ids(table['gained_ids'], table['gained'])} and less often on {table['lost']}"
        f"{ids(table['lost_ids'], table['lost'])}"
    )
