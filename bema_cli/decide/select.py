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
import math

from bema_cli.decide.metric import Metric, per_item, value
from bema_cli.decide.power import RESOLUTION, resolved
from bema_cli.decide.verdict import verdict
from bema_cli.errors import InputError, UsageError

RESAMPLES = 2000
LEVEL = 0.95
# protocol fields two records must share to be compared (the resume key minus the weights)
SAME = ("protocol", "seeds", "n_samples", "n_prompts", "backend", "dtype")


def _check_same_protocol(records: list[dict]) -> None:
    """One protocol across the records; a data file named by another tail of its path (a moved OUT:
    provenance.input_name) is the same file, as a resume takes it (eval.resume.differences)."""
    from bema_cli.eval.resume import differences

    first = records[0]
    for r in records[1:]:
        for key in SAME:
            if r.get(key) != first.get(key):
                diff = key
                if isinstance(r.get(key), dict) and isinstance(first.get(key), dict):
                    found = differences(first[key], r[key])
                    if not found:
                        continue
                    diff = f"{key}.{found[0].split(' ')[0]}"
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
    allow_missing: bool = False,
) -> dict:
    """Rank (run, step) candidates on `metric`; differences to the best and to vanilla (same step)
    with paired bootstrap intervals; ties with the best; the winner."""
    import numpy as np

    check_flags(at, holdout, resamples)
    mine = [r for r in records if r["task"] == metric.task and r.get("step") is not None]
    if not mine:
        tasks = sorted({str(r["task"]) for r in records})
        raise InputError(f"--metric {metric.name}: no record holds it (tasks here: {', '.join(tasks)})")
    runs_at: dict[int, set] = {}
    for r in mine:
        if not r.get("is_base"):
            runs_at.setdefault(r["step"], set()).add(r["run"])
    every = set().union(*runs_at.values()) if runs_at else set()
    if at == "all":
        chosen = [r for r in mine if not r.get("is_base")]
    else:
        if at == "last":  # the last step every config has a record at (an interrupted sweep's is not)
            common = [s for s in sorted(runs_at) if runs_at[s] == every]
            if not common:
                raise InputError(
                    f"--metric {metric.name}: no step has a record of every config ({', '.join(sorted(every))}); "
                    "--at STEP picks one (with --allow-missing)"
                )
            want = common[-1]
        else:
            want = _step(at)
        chosen = [r for r in mine if r["step"] == want and (want == 0 or not r.get("is_base"))]
        if not chosen:
            have = ", ".join(map(str, sorted({r["step"] for r in mine})))
            raise UsageError(f"--at {at}: no {metric.name} record at step {want} (steps: {have})")
        missing = sorted(every - runs_at.get(want, set())) if want else []
        if missing and not allow_missing:
            raise InputError(
                f"--at {at}: step {want} has no {metric.name} record of {len(missing)} config(s) evaluated "
                f"elsewhere ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): an interrupted "
                "run? finish it (it resumes), or pass --allow-missing to select among the others"
            )
    latest: dict[tuple, dict] = {}
    for r in chosen:  # a re-evaluated (run, step): its newest record
        latest[(r["run"], r["step"])] = r
    chosen = list(latest.values())
    _check_same_protocol(chosen)
    items = {key: per_item(r, metric, r["_where"]) for key, r in latest.items()}
    ids = list(next(iter(items.values()))["ids"])
    for key, it in items.items():
        if list(it["ids"]) != ids:
            raise InputError(f"{latest[key]['_where']}: scored on other items than the rest (ids differ)")
    pick, report = sides(ids, holdout, seed)
    sign = 1.0 if metric.higher_is_better else -1.0
    rng = np.random.default_rng(seed)

    def paired(side):
        """Each key's value on `side` and its bootstrap values (one shared draw of items per resample)."""
        draws = _draws(side, resamples, rng)
        point = {key: float(value(it, metric, side[None, :])[0]) for key, it in items.items()}
        return point, {key: value(it, metric, draws) for key, it in items.items()}

    def diff(point, boot, a: tuple, b: tuple, side) -> dict:
        p = mcnemar(items[a], items[b], metric, side)
        return _difference(point[a], point[b], boot[a] - boot[b], p)

    picked, pick_boot = paired(pick)
    best = max(picked, key=lambda k: (sign * picked[k], -simplicity(k[0]), k[1], k[0]))
    tied = [k for k in picked if k == best or _contains_zero(diff(picked, pick_boot, k, best, pick))]
    winner_key = min(tied, key=lambda k: (simplicity(k[0]), -k[1], k[0]))  # TIE_RULE
    values, boot = paired(report)
    rows = []
    for key, r in latest.items():
        vanilla = ("vanilla", key[1])
        row = {
            "run": key[0],
            "step": key[1],
            "value": values[key],
            "interval": _interval(boot[key]),  # its own value's
            "vs_best": diff(values, boot, key, winner_key, report),
            "vs_vanilla": diff(values, boot, key, vanilla, report)
            if vanilla in items and key != vanilla
            else None,
            "path": r.get("model_path"),
            "stabilizer": r.get("stabilizer"),
            "picked_value": picked[key],
        }
        row["tied_with_best"] = key in tied
        rows.append(row)
    rows.sort(key=lambda x: ((x["run"], x["step"]) != winner_key, -sign * x["value"], -x["step"], x["run"]))
    winner = rows[0]
    doc = {
        "metric": metric.name,
        "task": metric.task,
        "higher_is_better": metric.higher_is_better,
        "at": at,
        "resamples": resamples,
        "seed": seed,
        "level": LEVEL,
        "items": len(ids),
        "tie_rule": TIE_RULE,
        "missing": [] if at == "all" else sorted(every - {k[0] for k in latest}),
        "selection": {
            "holdout": holdout,
            "picked_on": len(pick),
            "reported_on": len(report),
            "note": "picked and reported on the same items (optimistic: the winner's curse)"
            if holdout is None
            else f"picked on {len(pick)} items, every number reported on the other {len(report)}",
        },
        "protocol": {k: chosen[0].get(k) for k in SAME},
        "candidates": rows,
        "winner": {k: winner[k] for k in WINNER_KEYS},
    }
    doc["winner"]["tied_with"] = [f"{r['run']}" for r in rows[1:] if r["tied_with_best"]]
    doc["verdict"] = verdict(doc)
    others = sorted({r.get("task") for r in records} - {metric.task, None})
    if others and winner["run"] != "vanilla":  # ship on the same run guards on them: it may differ
        doc["notes"] = [
            f"select ranks on {metric.name} alone: {', '.join(others)} guard nothing here, where `bema ship` "
            "blocks an average shown worse than vanilla on another task (and may fit an average), so ship may "
            "keep another model on this run"
        ]
    return doc


# a row's keys, as the winner
WINNER_KEYS = ("run", "step", "value", "interval", "vs_vanilla", "path", "stabilizer")


def sides(ids: list, holdout: float | None, seed: int):
    """The positions (numpy arrays) of the items to pick on and to report on: all of them both
    times without a holdout, else `split`'s two sides, neither of which may be empty."""
    import numpy as np

    pick_ids, report_ids = (set(ids), set(ids)) if holdout is None else split(ids, holdout, seed)
    if not pick_ids or not report_ids:
        raise UsageError(f"--holdout {holdout}: {len(ids)} items leave one side empty; use more items")
    pos = {i: n for n, i in enumerate(ids)}
    return np.array(sorted(pos[i] for i in pick_ids)), np.array(sorted(pos[i] for i in report_ids))


def _draws(side, resamples: int, rng):
    """`resamples` bootstrap draws of the positions in `side` (one row each)."""
    return side[rng.integers(0, len(side), size=(resamples, len(side)))]


def _interval(boot) -> list[float]:
    import numpy as np

    alpha = (1 - LEVEL) / 2
    return [float(x) for x in np.quantile(boot, [alpha, 1 - alpha])]


def _difference(a: float, b: float, boot, p: float | None) -> dict:
    """a - b: its value, its paired bootstrap interval, and McNemar's p where it applies; a value or
    bound below the arithmetic's resolution (power.RESOLUTION) is 0, a tie."""
    point = resolved(a - b, a, b)
    boot = boot.copy()
    boot[abs(boot) <= RESOLUTION * max(abs(a), abs(b))] = 0.0
    lo, hi = _interval(boot)
    out = {"value": point, "low": lo, "high": hi}
    return out if p is None else {**out, "mcnemar_p": p}


# The tie rule: among the candidates tied with the best on the pick items (the paired interval of
# their difference contains 0), prefer vanilla, then the simplest config, then the later step.
TIE_RULE = "among configs tied with the best on the pick items: vanilla, then the simplest config, then the later step"
SIMPLICITY = {
    "vanilla": 0,
    "ema": 1,
    "swa": 1,
    "lawa": 1,
    "bema": 2,
    "wsm": 2,
    "power": 2,
    "dema": 3,
    "ouema": 3,
}
FITTED = 4  # a fitted average (soup, simplex): more parameters fitted than any fixed config


def simplicity(run: str) -> int:
    """0 for vanilla, larger for configs with more moving parts (the run name's method prefix)."""
    return SIMPLICITY.get(run.split("-", 1)[0], FITTED)


def _contains_zero(d: dict) -> bool:
    return d["low"] <= 0 <= d["high"]


def mcnemar(a: dict, b: dict, metric: Metric, side) -> float | None:
    """Exact McNemar p-value (two-sided binomial on the discordant items) for yes/no item scores
    (each item 0 or 1: one greedy sample), beside the bootstrap; None for any other metric."""
    if metric.key == "loss":
        return None
    import numpy as np

    x, y = np.asarray(a[metric.key], float)[side], np.asarray(b[metric.key], float)[side]
    if not (np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all()):
        return None
    only_a, only_b = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    n, k = only_a + only_b, min(only_a, only_b)
    # symmetric at 1/2: both tails are sum_{i <= k} C(n, i) / 2^n
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


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


# -- one record against another (bema ship's fitted averages, evaluated apart from the menu) ---------
def _sides(record: dict, metric: Metric, holdout: float | None, seed: int):
    items = per_item(record, metric, record.get("_where", record.get("model_path", "a record")))
    return (items, *sides(list(items["ids"]), holdout, seed))


def report_interval(
    record: dict, metric: Metric, holdout: float | None, seed: int, resamples: int = RESAMPLES
):
    """The record's own 95% bootstrap interval on the report items."""
    import numpy as np

    items, _, report = _sides(record, metric, holdout, seed)
    return _interval(value(items, metric, _draws(report, resamples, np.random.default_rng(seed))))


def versus(
    a: dict, b: dict, metric: Metric, holdout: float | None, seed: int, resamples: int = RESAMPLES
) -> dict:
    """a - b on the report items: the point difference, its paired bootstrap interval, McNemar."""
    import numpy as np

    _check_same_protocol([{**a, "_where": a.get("model_path")}, {**b, "_where": b.get("model_path")}])
    ia, _, report = _sides(a, metric, holdout, seed)
    ib = per_item(b, metric, b.get("model_path", "a record"))
    if list(ib["ids"]) != list(ia["ids"]):
        raise InputError(
            f"{b.get('model_path')}: scored on other items than {a.get('model_path')} (ids differ)"
        )
    draws = _draws(report, resamples, np.random.default_rng(seed))
    va, vb = float(value(ia, metric, report[None, :])[0]), float(value(ib, metric, report[None, :])[0])
    boot = value(ia, metric, draws) - value(ib, metric, draws)
    return _difference(va, vb, boot, mcnemar(ia, ib, metric, report))
