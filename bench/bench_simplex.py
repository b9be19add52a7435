"""What the simplex search's accepted moves are worth, on worlds where the truth is known.

A world is bench_decide's (8 checkpoints, per-item noise z_ij, loss 1 + A c_0^2 + lam sum c_j^2)
plus a drift: checkpoint j's loss is higher by drift * (8 - j) / 7, so later checkpoints are truly
better and the best weights over the last 4 are not uniform. fit.simplex_fit runs on 100 pick
items with ship's duel (race.duel), today's and three others: without the futility bound's early
look at 16 items (race.BEHIND), and two rules for a duel that reaches the last pick item instead of
the point estimate (mean > 0): one standard error ahead (the bar race.BEHIND sets from 32 items),
and the anytime-valid sequence alone (low > 0). Printed: the fit's true loss against its uniform
start (LAWA-w4), each rule paired with today's on the same draws, and the items each spends.

    .venv/bin/python bench/bench_simplex.py [--reps 300]
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from bema_cli.decide import fit, race
from bema_cli.decide.power import mean_sd

BASIS = 9  # theta0 + 8 checkpoints
WORLDS = ((0.045, 0.0), (0.045, 0.02), (0.045, 0.05), (0.0, 0.05), (0.02, 0.1))  # (lam, drift)


def world(seed: int, items: int, lam: float, drift: float):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(20, 61, size=items).astype(float)
    b = rng.normal(1.0, 0.3, size=items)
    z = rng.normal(0.0, 0.15, size=(items, BASIS))
    z[:, 0] = 0.0
    g = np.array([0.0] + [drift * (8 - j) / 7 for j in range(1, BASIS)])

    def truth(c) -> float:
        c = np.asarray(c)
        return 1.0 + 0.6 * c[0] ** 2 + lam * float((c[1:] ** 2).sum()) + float(g @ c)

    def scores(c, ids) -> list[float]:  # oriented: minus each item's NLL
        ids = np.asarray(ids)
        return (-(b[ids] + z[ids] @ np.asarray(c) + truth(c)) * tokens[ids]).tolist()

    return truth, scores


def at_the_end(rule: str):
    """race.duel as ship runs it ("today"), without the early look, or with `rule` deciding a duel
    that ran to the last pick item."""

    def duel(trial, incumbent, ids, alpha=race.ALPHA, report_n=None):
        saved = race.BEHIND
        if rule == "no early look":
            race.BEHIND = tuple(b for b in saved if b[0] > race.MIN_ITEMS)
        try:
            won, used, diff = race.duel(trial, incumbent, ids, alpha, report_n)
        finally:
            race.BEHIND = saved
        if won and used == len(ids) and rule in ("1 se", "sequence"):
            d = race.paired(trial(list(ids)), incumbent(list(ids)))
            mean, sd = mean_sd(d)
            one_se = mean > race.BEHIND[-1][1] * sd / math.sqrt(len(d))
            won = one_se if rule == "1 se" else race.sequence(d, alpha, len(d))[0] > 0
        return won, used, diff

    return duel


def fitted(duel, seed: int, lam: float, drift: float, items: int = 100) -> tuple[float, int]:
    """(the fit's true loss - its uniform start's, items evaluated)."""
    truth, scores = world(seed, items, lam, drift)
    ids, cache, used = list(range(items)), {}, [0]

    def scored(c, batch):
        have = cache.setdefault(tuple(np.round(c, 12)), {})
        todo = [i for i in batch if i not in have]
        if todo:
            used[0] += len(todo)
            have.update(zip(todo, scores(c, todo), strict=True))
        return [have[i] for i in batch]

    def better(trial, incumbent) -> bool:
        return duel(lambda b: scored(trial, b), lambda b: scored(incumbent, b), ids, report_n=items)[0]

    c, _ = fit.simplex_fit(4, BASIS, better)
    return truth(c) - truth([0.0] * 5 + [0.25] * 4), used[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    reps = ap.parse_args().reps
    rules = ("today", "no early look", "1 se", "sequence")
    print(
        f"simplex fit, true loss vs its uniform start (nats/token), {reps} draws per world; paired vs today's rule"
    )
    for lam, drift in WORLDS:
        got = {r: [fitted(at_the_end(r), s, lam, drift) for s in range(reps)] for r in rules}
        cells = []
        for r in rules:
            gain = [g for g, _ in got[r]]
            paired = [a - b for (a, _), (b, _) in zip(got[r], got["today"], strict=True)]
            m, sd = mean_sd(paired)
            items = np.mean([n for _, n in got[r]])
            cells.append(
                f"{r}: {np.mean(gain):+.1e} ({m:+.1e} se {sd / math.sqrt(reps):.0e}; {items:.0f} items)"
            )
        print(f"lam {lam} drift {drift}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
