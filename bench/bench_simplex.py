"""What the simplex search's accepted moves are worth, on worlds where the truth is known.

A world is bench_decide's (8 checkpoints, per-item noise z_ij, loss 1 + A c_0^2 + lam sum c_j^2)
plus a drift: checkpoint j's loss is higher by drift * (8 - j) / 7, so later checkpoints are truly
better and the best weights over the last 4 are not uniform. fit.simplex_fit runs on 100 pick
items with ship's duel (race.duel) as today (the predictive futility bound, one standard error
ahead at the end), without any futility bound, and as before (a fixed bound: behind by half a
standard error at 16 items, not one ahead from 32; the point estimate at the end). Printed: the
fit's true loss against its uniform start (LAWA-w4), each rule paired with today's on the same
draws, the items each spends, and how often the fit ends at its start.

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


def the_fixed_bound(diffs) -> bool:
    """The futility bound before (a trial behind by half a standard error at 16 items, not a whole
    one ahead from 32), which left the simplex at its start in most runs."""
    t = len(diffs)
    bar = next((se for items, se in reversed(((16, -0.5), (32, 1.0))) if t >= items), None)
    if bar is None:
        return False
    mean, sd = mean_sd(diffs)
    return mean <= bar * sd / math.sqrt(t)


def at_the_end(rule: str):
    """race.duel as ship runs it ("today": predictive futility, END_SE at the end), without the
    futility bound ("no futility bound"), or as before ("fixed bound, point estimate": the fixed
    bound, and the point estimate deciding a duel that reaches the last item)."""

    def duel(trial, incumbent, ids, alpha=race.ALPHA, report_n=None):
        saved = race.futile, race.END_SE
        if rule == "no futility bound":
            race.futile = lambda diffs, n: False
        elif rule == "fixed bound, point estimate":
            race.futile, race.END_SE = (lambda diffs, n: the_fixed_bound(diffs)), 0.0
        try:
            return race.duel(trial, incumbent, ids, alpha, report_n)
        finally:
            race.futile, race.END_SE = saved

    return duel


def fitted(duel, seed: int, lam: float, drift: float, items: int = 100) -> tuple[float, int]:
    """(the fit's true loss - its uniform start's, items evaluated, whether the fit is its start)."""
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
    start = [0.0] * 5 + [0.25] * 4
    return truth(c) - truth(start), used[0], bool(np.allclose(c, start))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    reps = ap.parse_args().reps
    rules = ("today", "fixed bound, point estimate", "no futility bound")
    print(
        f"simplex fit, true loss vs its uniform start (nats/token), {reps} draws per world; paired vs today's rule"
    )
    for lam, drift in WORLDS:
        got = {r: [fitted(at_the_end(r), s, lam, drift) for s in range(reps)] for r in rules}
        cells = []
        for r in rules:
            gain = [g for g, _, _ in got[r]]
            paired = [a[0] - b[0] for a, b in zip(got[r], got["today"], strict=True)]
            m, sd = mean_sd(paired)
            items = np.mean([n for _, n, _ in got[r]])
            start = np.mean([s for _, _, s in got[r]])
            cells.append(
                f"{r}: {np.mean(gain):+.1e} ({m:+.1e} se {sd / math.sqrt(reps):.0e}; "
                f"{items:.0f} items; at its start {start:.0%})"
            )
        print(f"lam {lam} drift {drift}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
