"""The racing and reporting statistics, checked by simulation on worlds whose truth is known.

- the confidence sequence (race.sequence) covers the true mean at every look at once, at >= 1 - a;
- a race drops the truly best candidate at most a of the time, and does drop clearly worse ones;
- a duel decides as the exhaustive comparison does when the two are far apart, using fewer items;
- its futility bound never turns a loss into a win, and stops near-ties early;
- the minimum detectable difference (power.mdd) is detected at about 80%;
- the winner's-curse correction (power.corrected) is median-unbiased among the differences that pass.
Each rate is given with a Wilson 95% interval from the simulation's own size.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bema_cli.decide import power, race


def wilson(k: int, n: int) -> tuple[float, float]:
    z, p = 1.959964, k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return mid - half, mid + half


def test_the_confidence_sequence_covers_at_every_look_at_once():
    """400 paths of 200 skewed (exponential) differences, looked at after every round of items as a
    race looks: the share of paths that ever miss the true mean is not above a = 0.05 beyond the
    simulation's own interval (a fixed-n interval looked at this often misses far more: measured
    beside it, the bar this one must clear)."""
    rng = np.random.default_rng(0)
    paths, t_max, a = 400, 200, 0.05
    ever_missed = fixed_missed = 0
    for _ in range(paths):
        d = rng.exponential(1.0, size=t_max) - 1.0  # mean 0, skewed
        missed = fixed = False
        looks = [
            len(sum(race.rounds(range(t_max))[: k + 1], [])) for k in range(len(race.rounds(range(t_max))))
        ]
        for t in [*range(race.MIN_ITEMS, t_max + 1, race.ROUND_ITEMS), *looks]:  # every 16 items: stricter
            lo, hi = race.sequence(d[:t].tolist(), a, t_max)
            missed |= not lo <= 0 <= hi
            sd = d[:t].std(ddof=1)
            fixed |= abs(d[:t].mean()) > 1.96 * sd / math.sqrt(t)
        ever_missed += missed
        fixed_missed += fixed
    lo, hi = wilson(ever_missed, paths)
    assert lo < a and ever_missed / paths < 0.07, (ever_missed, lo, hi)
    assert (
        wilson(fixed_missed, paths)[0] > a
    )  # peeking at a fixed-n interval  # peeking at a fixed-n interval: what the sequence protects against


def test_a_race_keeps_the_best_and_drops_the_clearly_worse():
    """5 candidates, paired item scores; the best (mean 0.3 above the rest's 0) is dropped in at
    most a of 300 races, and the worst (1.0 below) is dropped before the items run out."""
    rng = np.random.default_rng(1)
    races, items = 300, 96
    best_dropped = worst_dropped_early = 0
    for _ in range(races):
        shared = rng.normal(0, 1, size=items)  # item difficulty: what pairing removes
        means = {"best": 0.3, "a": 0.0, "b": 0.0, "c": 0.0, "worst": -1.0}
        scores = {k: shared + m + rng.normal(0, 0.5, size=items) for k, m in means.items()}
        r = race.Race(list(means), horizon=items, protect=["a"])
        for name in list(means):  # each visited once, as ship's menu race does (menu._visit)
            for batch in race.rounds(range(items)):
                r.add(name, scores[name][batch].tolist())
                if r.behind(name):
                    break
            r.completed(name)
        best_dropped += "best" in r.dropped
        worst_dropped_early += r.dropped.get("worst", {}).get("after", items) < items
        assert "a" in r.alive  # protected (vanilla) is never dropped
    lo, hi = wilson(best_dropped, races)
    assert best_dropped / races <= race.ALPHA and hi < 0.06, (best_dropped, lo, hi)
    assert worst_dropped_early == races


def test_a_race_of_equals_drops_each_of_them_at_most_a_of_the_time():
    """The hardest world for the evidence's average: 8 candidates equally good (each is "the best"),
    skewed item scores, each visited once as ship does. Every rival's evidence is then a
    supermartingale, and their average reaches 1/a in at most a of races: each candidate's drop rate,
    and their pooled rate with its Wilson interval, stay under a (measured 0.5-1.6% each, 0.77%
    [0.57%, 1.03%] pooled; Bonferroni against the leader 0.27%)."""
    rng = np.random.default_rng(7)
    names, items, races = [f"c{k}" for k in range(8)], 100, 800
    drops = dict.fromkeys(names, 0)
    for _ in range(races):
        shared = rng.normal(0, 1, size=items)
        scores = {n: shared + rng.exponential(0.5, size=items) for n in names}  # equal means, skewed
        r = race.Race(names, horizon=items, protect=["c0"])
        for name in names:
            for batch in race.rounds(range(items)):
                r.add(name, scores[name][batch].tolist())
                if r.behind(name):
                    break
            r.completed(name)
        for name in r.dropped:
            drops[name] += 1
    pooled = sum(drops.values())
    lo, hi = wilson(pooled, races * (len(names) - 1))
    assert hi < race.ALPHA and max(drops.values()) / races < race.ALPHA, (drops, lo, hi)
    assert pooled > 0  # the rule does drop on noise sometimes: the level is spent, not wasted


def test_the_race_drops_whenever_bonferroni_against_the_leader_would_and_sooner_when_rivals_agree():
    """Path by path: where the two-sided sequence of (leader - candidate) at a / (K - 1) lies above 0
    (the rule before), the evidence's average drops the candidate too; and where several rivals are
    each ahead by less than that sequence can tell, their evidence adds up and drops it sooner
    (measured: 410 drops both rules make, 119 only this one)."""
    rng = np.random.default_rng(12)
    names, items = ["v", "a", "b", "c", "x"], 100
    level = race.ALPHA / (len(names) - 1)
    both = new_only = 0
    for k in range(300):
        shared = rng.normal(0, 1, size=items)
        gap = (0.25, 0.4)[k % 2]  # x behind every rival by this, items of spread ~0.7 around it
        scores = {n: shared + rng.normal(0, 0.5, size=items) for n in names[:-1]}
        scores["x"] = shared - gap + rng.normal(0, 0.5, size=items)
        for t in (16, 32, 64):
            r = race.Race(names, horizon=items, protect=["v"])
            for n in names[:-1]:
                r.add(n, scores[n].tolist())
            r.add("x", scores["x"][:t].tolist())
            lead = max(names[:-1], key=lambda n: scores[n][:t].sum())
            lo, _ = race.sequence(
                power.paired(scores[lead][:t].tolist(), scores["x"][:t].tolist()), level, items
            )
            dropped = r.behind("x")
            assert dropped or not lo > 0, (k, t)  # never keeps what the rule before would drop
            if dropped:  # the record says what dropped it: the average evidence, past 1/a
                assert r.dropped["x"]["log10_evidence"] >= math.log10(1 / race.ALPHA) - 0.05
            both += dropped and lo > 0
            new_only += dropped and not lo > 0
    assert both > 50 and new_only > 0.2 * both, (both, new_only)  # measured 410 and 119


def test_a_duel_decides_as_the_whole_comparison_with_fewer_items():
    rng = np.random.default_rng(2)
    ids = list(range(128))
    agree = used = 0
    for k in range(200):
        gap = 0.5 if k % 2 else -0.5  # far apart: the whole comparison's answer is clear
        shared = rng.normal(0, 1, size=128)
        x, y = shared + gap + rng.normal(0, 0.5, size=128), shared + rng.normal(0, 0.5, size=128)

        def of(v):
            return lambda i: v[i].tolist()

        won, n, _ = race.duel(of(x), of(y), ids)
        whole, n_all, _ = race.exhaustive(of(x), of(y), ids)
        agree += won == whole
        used += n
        assert n_all == 128
    assert agree == 200 and used / 200 < 0.5 * 128  # same answers, at most half the items


def test_the_futility_bound_adds_no_win_and_stops_near_ties_early(monkeypatch):
    """On near-ties (no gap, or one too small for the pick items to tell), the duel with the bound
    wins only on paths where the duel without it wins too (it can only stop a trial, as a loss), and
    uses fewer items; a clearly better trial still wins."""
    rng = np.random.default_rng(3)
    ids = list(range(100))

    def of(v):
        return lambda i: v[i].tolist()

    bound = race.futile

    def duel(x, y, with_bound: bool):
        monkeypatch.setattr(race, "futile", bound if with_bound else (lambda diffs, n: False))
        return race.duel(of(x), of(y), ids)

    used = {True: 0, False: 0}
    wins = {True: 0, False: 0}
    for k in range(400):
        gap = (0.0, 0.02)[k % 2]  # per item, against an item spread of 1: a tie, or next to one
        shared = rng.normal(0, 1, size=100)
        x, y = shared + gap + rng.normal(0, 0.7, size=100), shared + rng.normal(0, 0.7, size=100)
        (w1, n1, _), (w0, n0, _) = duel(x, y, True), duel(x, y, False)
        assert w1 <= w0, k  # a win with the bound is a win without it, path by path
        used[True] += n1
        used[False] += n0
        wins[True] += w1
        wins[False] += w0
    assert used[True] < 0.8 * used[False], used
    assert wins[True] <= wins[False], wins
    clear = 0
    for _ in range(100):  # a trial better by 0.6 item spreads (3.4 s.e. at 32 items) still wins
        shared = rng.normal(0, 1, size=100)
        x, y = shared + 0.6 + rng.normal(0, 0.7, size=100), shared + rng.normal(0, 0.7, size=100)
        clear += duel(x, y, True)[0]
    assert clear >= 95, clear


@pytest.mark.parametrize("mean_in_se,t", [(-1.0, 16), (0.0, 16), (0.5, 32), (1.5, 32), (-0.3, 64)])
def test_the_futility_bound_is_the_predictive_chance_of_ending_a_standard_error_ahead(mean_in_se, t):
    """race.futile against its definition simulated: the mean so far uncertain (N(mean, sd^2 / t)),
    the n - t items left drawn around it; the chance that the mean of all n items ends END_SE
    standard errors ahead (200,000 draws: the chance within 0.005) is under FUTILE_CHANCE exactly
    where futile says so, or the two sit within the simulation's error of the threshold."""
    n, rng = 100, np.random.default_rng(11)
    base = rng.normal(0.0, 1.0, size=t)
    base = (base - base.mean()) / base.std(ddof=1)  # sd exactly 1
    diffs = base + mean_in_se / math.sqrt(t)
    mean, sd = float(diffs.mean()), float(diffs.std(ddof=1))
    draws = 200_000
    mu = rng.normal(mean, sd / math.sqrt(t), size=draws)
    rest = rng.normal(mu, sd / math.sqrt(n - t))
    final = (t * mean + (n - t) * rest) / n
    chance = float((final > race.END_SE * sd / math.sqrt(n)).mean())
    if abs(chance - race.FUTILE_CHANCE) > 0.005:
        assert race.futile(diffs.tolist(), n) is (chance < race.FUTILE_CHANCE), chance


def test_the_futility_bound_costs_a_truly_better_trial_under_2_percent_of_its_wins(monkeypatch):
    """Trials truly better by 0.3 item spreads (a gain the 100 pick items find about 3 times in 4):
    the wins that the duel without the bound would have had and the duel with it loses, with their
    Wilson interval, stay under 2% (the bound stops a duel only where it can no longer win)."""
    rng = np.random.default_rng(7)
    ids, n = list(range(100)), 1000
    bound = race.futile

    def wins(x, y, with_bound) -> bool:
        monkeypatch.setattr(race, "futile", bound if with_bound else (lambda diffs, n: False))
        return race.duel(lambda b: x[b].tolist(), lambda b: y[b].tolist(), ids)[0]

    lost = won = 0
    for _ in range(n):
        shared = rng.normal(0, 1, size=100)
        x, y = shared + 0.3 + rng.normal(0, 0.7, size=100), shared + rng.normal(0, 0.7, size=100)
        free = wins(x, y, False)
        won += free
        lost += free and not wins(x, y, True)
    assert won > 0.6 * n, won
    lo, hi = wilson(lost, n)
    assert hi < 0.02, (lost, lo, hi)


def _drift_world(seed: int, items: int, basis: int, lam: float, drift: float):
    """bench_simplex's world: (the true loss of c, per-item scores)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(20, 61, size=items).astype(float)
    b = rng.normal(1.0, 0.3, size=items)
    z = rng.normal(0.0, 0.15, size=(items, basis))
    z[:, 0] = 0.0
    g = np.array([0.0] + [drift * (8 - j) / 7 for j in range(1, basis)])

    def truth(c) -> float:
        c = np.asarray(c)
        return 1.0 + 0.6 * c[0] ** 2 + lam * float((c[1:] ** 2).sum()) + float(g @ c)

    def scores(c, ids):
        ids = np.asarray(ids)
        return (-(b[ids] + z[ids] @ np.asarray(c) + truth(c)) * tokens[ids]).tolist()

    return truth, scores


def _fixed_bound(diffs, n) -> bool:
    """The futility bound before: behind by half a standard error at 16 items, not one ahead from 32."""
    t = len(diffs)
    bar = -0.5 if t < 32 else 1.0
    mean, sd = power.mean_sd(diffs)
    return t >= 16 and mean <= bar * sd / math.sqrt(t)


@pytest.mark.parametrize("lam,drift", [(0.0, 0.05), (0.045, 0.0)])
def test_the_simplex_fit_beats_the_fixed_bounds_on_the_same_draws(monkeypatch, lam, drift):
    """bench/bench_simplex.py's worlds: later checkpoints truly better (lam 0, drift 0.05), where the
    fixed futility bound left the simplex at its start in 46% of draws, and one where uniform weights
    are best (lam 0.045). On the same 150 draws the fit raced as ship races it ends truly better
    than the fit under the fixed bound (with the point estimate deciding at the last item), by more
    than two standard errors of the paired differences; and better than its start where it tilts."""
    from bema_cli.decide import fit

    basis, items, draws = 9, 100, 150
    start, paired, gains = [0.0] * 5 + [0.25] * 4, [], []
    today = race.futile, race.END_SE
    for seed in range(draws):
        truth, scores = _drift_world(seed, items, basis, lam, drift)

        def better(trial, incumbent, scores=scores) -> bool:
            return race.duel(lambda i: scores(trial, i), lambda i: scores(incumbent, i), list(range(items)),
                             report_n=items)[0]  # fmt: skip

        c, _ = fit.simplex_fit(4, basis, better)
        monkeypatch.setattr(race, "futile", _fixed_bound)
        monkeypatch.setattr(race, "END_SE", 0.0)
        before, _ = fit.simplex_fit(4, basis, better)
        monkeypatch.setattr(race, "futile", today[0])
        monkeypatch.setattr(race, "END_SE", today[1])
        paired.append(truth(c) - truth(before))
        gains.append(truth(c) - truth(start))
    mean, sd = power.mean_sd(paired)
    assert mean + 2 * sd / math.sqrt(draws) < 0, (mean, sd)
    if drift:
        mean, sd = power.mean_sd(gains)
        assert mean + 2 * sd / math.sqrt(draws) < 0, (mean, sd)  # truly better than its start


def test_the_minimum_detectable_difference_is_found_80_percent_of_the_time():
    """Paired differences with the true mean set to the MDD of their sd: a two-sided z test at 0.05
    on 100 items finds it in ~80% of 2000 draws."""
    rng = np.random.default_rng(3)
    n, sd = 100, 2.0
    mdd = power.mdd(rng.normal(0, sd, size=100_000).tolist()) * math.sqrt(100_000) / math.sqrt(n)
    found = 0
    for _ in range(2000):
        d = rng.normal(mdd, sd, size=n)
        found += abs(d.mean()) / (d.std(ddof=1) / math.sqrt(n)) > 1.959964
    lo, hi = wilson(found, 2000)
    assert lo < 0.80 < hi or abs(found / 2000 - 0.80) < 0.03, (found / 2000, lo, hi)


def test_the_corrected_difference_is_median_unbiased_among_those_that_pass():
    """True difference mu = 1 se: the raw difference of the draws that pass (x > 1.96 se) overstates
    mu (the winner's curse: measured here, the bar); the corrected one lands above mu half the time."""
    rng = np.random.default_rng(4)
    mu, se = 1.0, 1.0
    x = rng.normal(mu, se, size=200_000)
    passed = x[x > 1.959964 * se][:4000]
    corrected = np.array([power.corrected(float(v), se) for v in passed])
    assert passed.mean() > mu + 1.0  # raw: optimistic by more than a standard error
    above = int((corrected > mu).sum())
    lo, hi = wilson(above, len(passed))
    assert lo < 0.5 < hi, (above / len(passed), lo, hi)
    assert all(0 <= c <= v for c, v in zip(corrected, passed, strict=True))  # between 0 and the raw value


def test_the_corrected_difference_never_has_the_shipped_differences_opposite_sign():
    """Just past the threshold the conditional estimate runs to -inf ("+0.005152 after the
    correction" on a shipped -1.83e-3): kept at 0 there, and the raw value far past it."""
    se = 1.0
    for x in (1.96, 1.9601, 1.961, 1.97, 2.0, 2.2):
        c = power.corrected(x, se)
        assert 0.0 <= c <= x, (x, c)
    assert power.corrected(1.9601, se) == 0.0  # the unclamped estimate is about -2.4 here
    assert power.corrected(8.0, se) == pytest.approx(8.0, abs=1e-6)


def test_each_candidate_is_swapped_in_once_and_the_race_picks_as_select_on_every_pick_item():
    """Swaps are half of a ship's time. Each candidate is loaded once and scored round by round while
    it stays loaded (menu._visit): as many swaps as candidates in the menu's race. Where nobody can
    be dropped, the race's pick is select's pick on every pick item (the design with every candidate
    on every item; bench/bench_decide.py measures the design with rounds beside it). Counted as the
    arena swaps: a load of another vector."""
    from pathlib import Path

    from bema_cli.decide import select
    from bema_cli.decide.candidate import Candidate
    from bema_cli.decide.menu import race_menu
    from bema_cli.decide.metric import Metric
    from bema_cli.decide.request import ShipOptions
    from bema_cli.decide.scorer import ItemScorer
    from bema_cli.eval.results import ResultsFile

    steps = [10, 20, 30]
    rng = np.random.default_rng(3)
    noise = rng.normal(0.0, 1.0, size=(4, 200))
    cands = {n: Candidate.of(n, c, steps) for n, c in (("vanilla", [0, 0, 0, 1]), ("a", [0, 0, 0.5, 0.5]),
                                                      ("b", [0, 1 / 3, 1 / 3, 1 / 3]), ("c", [0.1, 0, 0.4, 0.5]))}  # fmt: skip
    means = {"vanilla": 10.0, "a": 9.99, "b": 9.995, "c": 10.0}  # close: the race keeps them all
    loads = []

    def evaluate(cand, task, ids):
        if not loads or loads[-1] != cand.name:
            loads.append(cand.name)
        row = list(cands).index(cand.name)
        nll = [(means[cand.name] + 0.05 * noise[row, i]) * 10 for i in ids]
        return [{"run": cand.name, "step": 30, "task": "loss", "model_path": cand.name, "is_base": False,
                 "items": {"ids": list(ids), "nll": nll, "tokens": [10] * len(ids)}, "protocol": {},
                 "seeds": None, "n_samples": 1, "n_prompts": len(ids), "backend": "sim", "dtype": "float64"}]  # fmt: skip

    metric, opts = Metric("loss", "loss", False), ShipOptions(out=Path("unused"), resamples=200)
    scorer = ItemScorer(evaluate, None, metric, ResultsFile(None))
    pick_ids = list(range(100))
    made = race_menu(scorer, cands, pick_ids, list(range(100, 200)), opts, metric, progress=False)
    assert made.race["survivors"] == list(cands)
    menu_loads = loads[: loads.index("c") + 1]  # the menu's race, before the report items
    assert menu_loads == ["vanilla", "a", "b", "c"], loads  # once each
    whole = select.select(
        [scorer.record(c, pick_ids) for c in cands.values()], metric, "last", None, 200, opts.seed
    )
    assert made.race["pick"] == [
        {k: r[k] for k in ("run", "value", "tied_with_best")} for r in whole["candidates"]
    ]


def _effect_race(means: dict, rng, effect: float, items: int = 100):
    """One menu race (menu._visit, ship's own) with --min-effect `effect` on a loss world: each
    candidate's per-token NLL is its mean plus N(0, 0.05) per item, 10 tokens an item."""
    from pathlib import Path

    from bema_cli.decide import menu
    from bema_cli.decide.candidate import Candidate
    from bema_cli.decide.metric import Metric
    from bema_cli.decide.request import ShipOptions
    from bema_cli.decide.scorer import ItemScorer
    from bema_cli.eval.results import ResultsFile

    names = list(means)
    steps = list(range(10, 10 * len(names) + 1, 10))
    cands = {n: Candidate.of(n, [0] + [1.0 if j == k else 0.0 for j in range(len(names))], steps)
             for k, n in enumerate(names)}  # fmt: skip
    noise = rng.normal(0.0, 0.05, size=(len(names), items))

    def evaluate(cand, task, ids):
        row = names.index(cand.name)
        nll = [(means[cand.name] + noise[row, i]) * 10 for i in ids]
        return [{"run": cand.name, "step": steps[-1], "task": "loss", "model_path": cand.name, "is_base": False,
                 "items": {"ids": list(ids), "nll": nll, "tokens": [10] * len(ids)}, "protocol": {},
                 "seeds": None, "n_samples": 1, "n_prompts": len(ids), "backend": "sim", "dtype": "float64"}]  # fmt: skip

    metric = Metric("loss", "loss", False)
    scorer = ItemScorer(evaluate, None, metric, ResultsFile(None))
    contest = race.Race(names, horizon=items, protect=["vanilla"])
    opts = ShipOptions(out=Path("unused"), min_effect=effect)
    menu._visit(contest, scorer, cands, race.rounds(list(range(items))), opts, metric, None, False)
    return {n: d for n, d in contest.dropped.items() if d["by"].startswith(menu.WITHIN)}


def test_min_effect_retirements_hold_their_family_wise_error_under_holm():
    """--min-effect E retires a config whose sequence against vanilla ends below E; "config j gains
    at least E" is a fixed hypothesis per config, so Holm's step-down (a / (K - 1 - r) after r
    retirements) keeps the chance of retiring any config that truly gains E at <= a. 300 races of 6
    configs: 3 gain exactly E (the null's edge, the hardest case), 3 gain nothing (retired)."""
    rng = np.random.default_rng(5)
    effect, races = 0.03, 300
    means = {"vanilla": 1.0, "z1": 1.0, "z2": 1.0, "z3": 1.0,  # visited first: retired, not dropped
             "e1": 1.0 - effect, "e2": 1.0 - effect, "e3": 1.0 - effect}  # fmt: skip
    wrong = retired_flat = 0
    for _ in range(races):
        gone = _effect_race(means, rng, effect)
        wrong += any(n.startswith("e") for n in gone)
        retired_flat += sum(n.startswith("z") for n in gone)
    lo, hi = wilson(wrong, races)
    assert hi < 0.06 and wrong / races <= race.ALPHA, (wrong, lo, hi)
    assert retired_flat / (3 * races) > 0.5, retired_flat  # the flat ones do go


def test_min_effect_steps_down_after_each_retirement():
    """Holm's step, path by path: a config whose sequence against vanilla clears E only at a / 3, not
    at Bonferroni's a / 6, is retired once 3 others were (and not before)."""
    from bema_cli.decide import menu

    def edge_case(retired: int) -> bool:
        rng = np.random.default_rng(11)
        t, names = 100, ["vanilla", "x", "r1", "r2", "r3", "o1", "o2"]
        contest = race.Race(names, horizon=t, protect=["vanilla"])
        van = rng.normal(10.0, 0.5, size=t)
        diffs = rng.normal(0.0, 0.5, size=t)
        contest.add("vanilla", list(-van))
        contest.add("x", list(-(van - diffs)))  # x's per-item gain over vanilla: diffs
        for n in names[2 : 2 + retired]:
            contest.retire(n, f"{menu.WITHIN} 0 of vanilla")
        mean, sd = power.mean_sd(list(diffs))
        strict = mean + race.radius(sd, t, race.ALPHA / 6, t)
        loose = mean + race.radius(sd, t, race.ALPHA / 3, t, race.ALPHA / 6)
        effect = (strict + loose) / 2 / 10  # per token, 10 tokens an item

        class Scorer:
            cache = {"v": {i: (0.0, 10) for i in range(t)}}

        class Vanilla:
            digest = "v"

        return menu._within(contest, Scorer, {"vanilla": Vanilla}, "x", list(range(t)), effect)

    assert not edge_case(0)  # Bonferroni's level: x's sequence still reaches E
    assert edge_case(3)  # three retired: a / 3, and x is retired too


def test_the_evidence_matches_a_high_precision_reference_far_into_both_tails():
    """race.evidence against the one-sided normal mixture computed with mpmath at 50 digits, from a
    rival far worse (x down to -200: Phi(x) ~ 1e-8700, far below a double) to one far better (capped
    at e^700). Relative tolerance 1e-9 where the value is a normal double. A clamped Phi (1e-300)
    read a far-worse rival as e^300-e^700 of evidence, and dropped a clear winner."""
    import mpmath

    mpmath.mp.dps = 50
    a, horizon = 0.05 / 7, 600
    rho2 = race._mixture(a, horizon)
    for t in (16, 200, 600, 1500):
        for x in (-200.0, -80.0, -40.0, -37.0, -10.0, -1.0, 0.0, 2.0, 8.0, 30.0):
            diffs = _diffs_with_x(x, t, rho2)
            mean, sd = power.mean_sd(diffs)
            xm = mpmath.mpf(t * mean / sd) * mpmath.sqrt(mpmath.mpf(rho2) / (t * rho2 + 1))
            ref = 2 * mpmath.ncdf(xm) / mpmath.sqrt(t * rho2 + 1) * mpmath.exp(xm * xm / 2)
            got = race.evidence(diffs, a, horizon)
            want = float(min(ref, mpmath.exp(700)))
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-300), (t, x, got, want)
            if x < 0:
                assert got < 1, (t, x, got)  # a rival far worse carries no evidence that it is better


def _diffs_with_x(x: float, t: int, rho2: float) -> list[float]:
    """t paired differences (+-1 around a mean) whose mixture statistic x is the one asked for."""
    base = np.array([1.0, -1.0] * (t // 2) + [0.0] * (t % 2))
    sd = base.std(ddof=1)
    mean = x * sd / t / math.sqrt(rho2 / (t * rho2 + 1))
    return (base + mean).tolist()


@pytest.mark.parametrize("items", [200, 600, 1500])
def test_a_race_keeps_every_average_that_beats_vanilla_on_nearly_every_item(items):
    """The world that dropped every average "by vanilla" (30 of 30): averages truly 0.13-0.50 better
    than vanilla on nearly every item (per-item mean/sd far past -3.9 at 200 items), vanilla
    protected and visited first as ship visits it. None of the averages may leave the race, and
    vanilla, the clearly worst, would be dropped at its first look were it not protected."""
    rng = np.random.default_rng(items)
    means = {"vanilla": 0.0, "ema": 0.13, "bema": 0.25, "lawa-w4": 0.5, "lawa-w8": 0.4}
    dropped = 0
    for _ in range(30):
        shared = rng.normal(0, 1, size=items)
        scores = {k: shared + m + rng.normal(0, 0.02, size=items) for k, m in means.items()}
        r = race.Race(list(means), horizon=items, protect=["vanilla"])
        for name in means:
            for batch in race.rounds(range(items)):
                r.add(name, scores[name][batch].tolist())
                if r.behind(name):
                    break
            r.completed(name)
        # the worse averages may leave, beaten by a better average; never "by vanilla", and the best stays
        assert "lawa-w4" in r.alive and all(d["by"] != "vanilla" for d in r.dropped.values()), r.dropped
        dropped += len(r.dropped)
    assert dropped > 0  # the race still races: the averages far behind lawa-w4 are dropped
    r2 = race.Race(["vanilla", "lawa-w4"], horizon=items)
    r2.add("lawa-w4", scores["lawa-w4"][:16].tolist())
    r2.add("vanilla", scores["vanilla"][:16].tolist())
    assert r2.behind("vanilla") and not r2.behind("lawa-w4")
