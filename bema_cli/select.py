"""`bema select`: rank the evaluated configs on one metric, with paired bootstrap intervals.

Every record of `bema eval` carries its per-item scores (`items`: each prompt's accuracy over its
samples, or each held-out record's summed NLL and token count). Two configs scored on the same
items are compared *paired*: one bootstrap resample draws items with replacement, and every
config's metric is recomputed on that same draw, so the interval of a difference reflects how
much the items disagree, not each config's own spread (docs/eval-protocol.md, "Selecting").

Picking the best on the items it is then reported on is optimistic (the winner's curse):
`holdout` picks on a seeded part of the items and reports every number on the rest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from bema_cli.errors import InputError, UsageError

RESAMPLES = 2000
LEVEL = 0.95
SCORINGS = ("flexible", "strict")
# protocol fields two records must share to be compared (the resume key minus the weights)
SAME = ("protocol", "seeds", "n_samples", "n_prompts", "backend", "dtype")


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


def _value(items: dict, metric: Metric, idx=None):
    """The metric on items (all, or the index array/matrix `idx` of a resample: one value per row)."""
    import numpy as np

    if metric.key == "loss":
        nll, tokens = np.asarray(items["nll"], float), np.asarray(items["tokens"], float)
        if idx is None:
            return float(nll.sum() / tokens.sum())
        return nll[idx].sum(axis=-1) / tokens[idx].sum(axis=-1)
    scores = np.asarray(items[metric.key], float)
    return float(scores.mean()) if idx is None else scores[idx].mean(axis=-1)


def _items(record: dict, metric: Metric, where: str) -> dict:
    items = record.get("items")
    needed = ("nll", "tokens") if metric.key == "loss" else (metric.key,)
    if not isinstance(items, dict) or any(k not in items for k in ("ids", *needed)):
        raise InputError(
            f"{where}: no per-item scores (records of bema < 0.5, or an lm_eval task); "
            "re-run bema eval (it resumes nothing for them: pass a new --out)"
        )
    if any(v is None for k in needed for v in items[k]):
        raise InputError(f"{where}: an item without a score")
    return items


def _check_same_protocol(records: list[dict]) -> None:
    first = records[0]
    for r in records[1:]:
        for key in SAME:
            if r.get(key) != first.get(key):
                diff = key
                if isinstance(r.get(key), dict) and isinstance(first.get(key), dict):
                    keys = sorted(set(r[key]) | set(first[key]))
                    diff = next((f"{key}.{k}" for k in keys if r[key].get(k) != first[key].get(k)), key)
                raise InputError(
                    f"{r['_where']}: evaluated with another protocol than {first['_where']} ({diff} differs); "
                    "select compares records of one protocol only"
                )


def split(ids: list, fraction: float, seed: int) -> tuple[set, set]:
    """(items to pick on, items to report on): each id's side fixed by a hash of (seed, id), so the
    split does not depend on the order records were written in."""
    pick = {
        i for i in ids if int(hashlib.sha256(f"{seed}/{i}".encode()).hexdigest()[:8], 16) / 2**32 < fraction
    }
    return pick, set(ids) - pick


def select(
    records: list[dict],
    metric: Metric,
    at: str = "last",
    holdout: float | None = None,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict:
    """Rank (run, step) candidates on `metric`; differences to the best and to vanilla (same step)
    with paired bootstrap intervals; ties with the best; the winner."""
    import numpy as np

    check_flags(at, holdout, resamples)
    mine = [r for r in records if r["task"] == metric.task and r.get("step") is not None]
    if not mine:
        tasks = sorted({str(r["task"]) for r in records})
        raise InputError(f"--metric {metric.name}: no record holds it (tasks here: {', '.join(tasks)})")
    steps = sorted({r["step"] for r in mine if not r.get("is_base")})
    if at == "all":
        chosen = [r for r in mine if not r.get("is_base")]
    else:
        want = steps[-1] if at == "last" and steps else _step(at)
        chosen = [r for r in mine if r["step"] == want and (want == 0 or not r.get("is_base"))]
        if not chosen:
            have = ", ".join(map(str, sorted({r["step"] for r in mine})))
            raise UsageError(f"--at {at}: no {metric.name} record at step {want} (steps: {have})")
    latest: dict[tuple, dict] = {}
    for r in chosen:  # a re-evaluated (run, step): its newest record
        latest[(r["run"], r["step"])] = r
    chosen = list(latest.values())
    _check_same_protocol(chosen)
    items = {key: _items(r, metric, r["_where"]) for key, r in latest.items()}
    ids = list(next(iter(items.values()))["ids"])
    for key, it in items.items():
        if list(it["ids"]) != ids:
            raise InputError(f"{latest[key]['_where']}: scored on other items than the rest (ids differ)")
    positions = {i: n for n, i in enumerate(ids)}
    pick_ids, report_ids = (set(ids), set(ids)) if holdout is None else split(ids, holdout, seed)
    if holdout is not None and (not pick_ids or not report_ids):
        raise UsageError(f"--holdout {holdout}: {len(ids)} items leave one side empty; use more items")
    pick = np.array(sorted(positions[i] for i in pick_ids))
    report = np.array(sorted(positions[i] for i in report_ids))
    sign = 1.0 if metric.higher_is_better else -1.0
    picked = {key: float(_value(it, metric, pick[None, :])[0]) for key, it in items.items()}
    best = max(picked, key=lambda k: (sign * picked[k], -k[1], k[0]))  # ties: the earlier step, then name
    rng = np.random.default_rng(seed)
    draws = report[rng.integers(0, len(report), size=(resamples, len(report)))]
    boot = {key: _value(it, metric, draws) for key, it in items.items()}
    alpha = (1 - LEVEL) / 2

    def diff(a: tuple, b: tuple) -> dict:
        d = boot[a] - boot[b]
        point = float(
            _value(items[a], metric, report[None, :])[0] - _value(items[b], metric, report[None, :])[0]
        )
        lo, hi = (float(x) for x in np.quantile(d, [alpha, 1 - alpha]))
        return {"value": point, "low": lo, "high": hi}

    rows = []
    for key, r in latest.items():
        vanilla = ("vanilla", key[1])
        row = {
            "run": key[0],
            "step": key[1],
            "value": float(_value(items[key], metric, report[None, :])[0]),
            "interval": [float(x) for x in np.quantile(boot[key], [alpha, 1 - alpha])],  # its own value's
            "vs_best": diff(key, best),
            "vs_vanilla": diff(key, vanilla) if vanilla in items and key != vanilla else None,
            "path": r.get("model_path"),
            "stabilizer": r.get("stabilizer"),
        }
        row["tied_with_best"] = key == best or row["vs_best"]["low"] <= 0 <= row["vs_best"]["high"]
        rows.append(row)
    rows.sort(key=lambda x: (-sign * x["value"], x["step"], x["run"]))
    winner = next(x for x in rows if (x["run"], x["step"]) == best)
    return {
        "metric": metric.name,
        "task": metric.task,
        "higher_is_better": metric.higher_is_better,
        "at": at,
        "resamples": resamples,
        "seed": seed,
        "level": LEVEL,
        "items": len(ids),
        "selection": {
            "holdout": holdout,
            "picked_on": len(pick_ids),
            "reported_on": len(report_ids),
            "note": "picked and reported on the same items (optimistic: the winner's curse)"
            if holdout is None
            else f"picked on {len(pick_ids)} items, every number reported on the other {len(report_ids)}",
        },
        "protocol": {k: chosen[0].get(k) for k in SAME},
        "candidates": rows,
        "winner": {
            k: winner[k] for k in ("run", "step", "value", "interval", "vs_vanilla", "path", "stabilizer")
        },
    }


def check_flags(at: str, holdout: float | None, resamples: int) -> None:
    """The flags alone, checked before any results file is read."""
    if resamples < 100:
        raise UsageError(f"--resamples: at least 100, got {resamples}")
    if holdout is not None and not 0 < holdout < 1:
        raise UsageError(f"--holdout: a fraction of the items in (0, 1), got {holdout}")
    if at not in ("last", "all"):
        _step(at)


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise UsageError(f"--at: last, all or a step number, got {text!r}") from None
    if step < 0:
        raise UsageError(f"--at: a step >= 0, got {step}")
    return step


def fmt_interval(d: dict | None) -> str:
    if d is None:
        return ""
    return f"{d['value']:+.4g} [{d['low']:+.4g}, {d['high']:+.4g}]"
