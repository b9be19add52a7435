"""Racing on the pick items: candidates are evaluated in rounds of items, and one that cannot win
stops being evaluated (Maron & Moore 1994, "Hoeffding races"), with an interval that stays valid
however often it is looked at.

The interval is the asymptotic confidence sequence of Waudby-Smith, Arbour, Sinha, Kennedy and
Ramdas, "Time-uniform central limit theory and asymptotic confidence sequences" (Ann. Statist. 52,
2024, Theorem 2.2), Robbins' normal-mixture boundary (Howard et al. 2021, eq. 14) with the sample
variance plugged in. For the mean of t paired per-item differences d_1..d_t, with probability
>= 1 - a it holds at *every* t at once:

    mean_t +- sd_t * sqrt( 2 (t rho^2 + 1) / (t^2 rho^2) * log( sqrt(t rho^2 + 1) / a ) )

rho sets the t where it is tightest (here: all the pick items, where a fixed-n test would look).

The menu's race drops a candidate on the same mixture read as evidence (an e-value): for each rival
j, the one-sided mixture E_j that j's items beat the candidate's (`evidence`), and the candidate
goes once their average over its K - 1 rivals reaches 1/a (a rival not yet scored that far counts
0). Where the candidate is truly the best, each E_j is a nonnegative supermartingale in the items,
so is their average, and by Ville's inequality it ever reaches 1/a with probability <= a: the best
is dropped with probability <= a over the whole race, as with Bonferroni's a / (K - 1) against the
leader, which this rule drops whenever that one does (and more often: rivals' evidence adds up).
docs/eval-protocol.md, "Racing".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from bema_cli.decide.power import log_tail, mdd, mean_sd, paired

ALPHA = 0.05  # chance, over a whole race, of dropping the truly best candidate
ROUND_ITEMS = 16  # the first round's items; each later look at ROUND_GROWTH x what was seen
ROUND_GROWTH = 2  # 16, 32, 64, ...: the looks of a candidate while it is loaded
MIN_ITEMS = (
    16  # no look before one round: on skewed items the plug-in variance of 8 missed 7.8% (tests/test_race.py)
)
# A duel that reaches its last pick item keeps the trial only if it is ahead there by END_SE
# standard errors of the mean: on a near-tie the point estimate alone kept noise (moves whose true
# gain is ~0 and whose pick-item gain is chance). A duel stops early as futile only where the trial
# can no longer reach that bar: its predictive chance of ending there (the mean so far, the rest of
# the items drawn from the same spread) is under FUTILE_CHANCE. bench/bench_simplex.py (300 draws a
# world): the fit is truly better than under the fixed bound this replaced (behind by 0.5 se at 16
# items, not 1 se ahead at 32, the point estimate at the end) in all five worlds, by 1.5-10e-4
# nats/token (each > 2 se), within 7e-5 of the same rule with no futility bound, at about twice the
# fixed bound's items. An end bar of 1 se gained more where the weights tilt but lost 4e-4 where
# uniform is best (and bench_decide's shipped model 7.8e-4, 2.4 se); 2 se gained less everywhere.
END_SE = 1.5
FUTILE_CHANCE = 0.02


def rounds(ids: Sequence) -> list[list]:
    """The items in rounds that look after 16, 32, 64, ... of them (ROUND_GROWTH; and after the last):
    log2 of the items many looks, not one per 16 items. The confidence sequence is valid at any
    looks; fewer looks stop later (more items)."""
    out, lo, size = [], 0, ROUND_ITEMS
    while lo < len(ids):
        out.append(list(ids[lo : lo + size]))
        lo += size
        size = lo * (ROUND_GROWTH - 1)  # the next look at ROUND_GROWTH x what was seen
    return out


def _mixture(a: float, horizon: int) -> float:
    """rho^2 of the normal mixture tuned for level `a`, tightest at `horizon` items (Waudby-Smith et
    al., eq. (2.11)): the sequence and the evidence share it."""
    log_term = -2 * math.log(a)
    return (log_term + math.log(log_term + 1)) / max(horizon, 2)


def radius(sd: float, t: int, a: float, horizon: int, tuned: float | None = None) -> float:
    """Half-width of the two-sided level-(1 - a) confidence sequence at t items (tightest at `horizon`).
    `tuned`: the level its mixture is tuned for (default `a`); held fixed, the width only grows as `a`
    shrinks, which Holm's step-down needs (a rejection at a looser level implies one at a stricter)."""
    if t < 2:
        return math.inf
    rho2 = _mixture(a if tuned is None else tuned, horizon)
    return sd * math.sqrt(2 * (t * rho2 + 1) / (t * t * rho2) * math.log(math.sqrt(t * rho2 + 1) / a))


def sequence(
    diffs: Sequence[float], a: float, horizon: int, tuned: float | None = None
) -> tuple[float, float]:
    """(low, high) of the confidence sequence for the mean of the paired differences seen so far."""
    t = len(diffs)
    if t < 2:
        return -math.inf, math.inf
    mean, sd = mean_sd(diffs)
    r = radius(sd, t, a, horizon, tuned)
    return mean - r, mean + r


def evidence(diffs: Sequence[float], a: float, horizon: int) -> float:
    """The e-value, at these items, that the mean of the paired differences is above 0: Robbins'
    normal mixture over positive slopes only (Howard, Ramdas, McAuliffe and Sekhon 2021, the one-sided
    normal mixture), the sample variance plugged in, tuned as `radius` at level `a`. Where the true
    mean is <= 0 it ever reaches 1/a with probability <= a (asymptotically, as `sequence` covers).
    It is the two-sided mixture behind `sequence` times 2 Phi(x) > 1, so it reaches 1/a whenever
    that sequence at `a` lies above 0."""
    t = len(diffs)
    if t < 2:
        return 1.0
    mean, sd = mean_sd(diffs)
    if sd == 0:  # every item the same difference (ties included): certain, as `sequence` reads it
        return math.exp(700.0) if mean > 0 else 0.0
    rho2 = _mixture(a, horizon)
    x = t * mean / sd * math.sqrt(rho2 / (t * rho2 + 1))
    # log Phi(x) from its tail (log(1 - Phi(-x))): far below 0 Phi(x) underflows, and x^2 / 2 must
    # meet -x^2 / 2 there, leaving ~1 / (|x| sqrt(t rho^2 + 1)): the rival is far worse, no evidence
    log_phi = log_tail(-x)
    return math.exp(min(math.log(2) + log_phi - 0.5 * math.log(t * rho2 + 1) + x * x / 2, 700.0))


class Race:
    """Candidates scored item by item (oriented: higher is better); `protect`ed ones are never dropped."""

    def __init__(self, names: Sequence[str], horizon: int, protect: Sequence[str] = (), alpha: float = ALPHA):
        self.scores: dict[str, list[float]] = {n: [] for n in names}
        self.alive = list(names)
        # name -> {"after": items seen, "by": the rival with most evidence, "log10_evidence": the average's}
        self.dropped: dict[str, dict] = {}
        self.horizon, self.protect, self.alpha = horizon, set(protect), alpha

    def add(self, name: str, values: Sequence[float]) -> None:
        self.scores[name].extend(values)

    def behind(self, name: str) -> bool:
        """Drop `name` once the evidence that its rivals beat it, averaged over its K - 1 rivals on the
        items it has (a rival scored on fewer counts 0), reaches 1/a: a candidate visited once, item
        by item, is checked against the ones already scored."""
        t = len(self.scores[name])
        if t < MIN_ITEMS or name in self.protect:
            return False
        family = max(len(self.scores) - 1, 1)
        level = self.alpha / family  # each rival's share: the mixture's tuning, as Bonferroni's level
        against = {
            n: evidence(paired(s[:t], self.scores[name][:t]), level, self.horizon)
            for n, s in self.scores.items()
            if n != name and len(s) >= t
        }
        total = sum(against.values())
        if total < family / self.alpha:
            return False
        self.alive.remove(name)
        self.dropped[name] = {
            "after": t,
            "by": max(against, key=against.get),
            "log10_evidence": round(math.log10(total / family), 1),
        }
        return True

    def completed(self, name: str) -> None:
        """`name` reached its last item still in the race: each candidate scored before it meets it
        again on the items they share (`behind`), so one visit each decides as rounds would."""
        if name in self.alive:
            for other in [n for n in self.alive if n != name]:
                self.behind(other)

    def retire(self, name: str, why: str) -> None:
        """Leave `name` out for a reason other than a rival (ship's --min-effect)."""
        self.alive.remove(name)
        self.dropped[name] = {"after": len(self.scores[name]), "by": why, "log10_evidence": None}


def duel(
    trial: Callable[[list], list[float]],
    incumbent: Callable[[list], list[float]],
    ids: Sequence,
    alpha: float = ALPHA,
    report_n: int | None = None,
) -> tuple[bool, int, float]:
    """Is `trial` better than `incumbent` on the pick items (oriented scores, higher is better)?
    Rounds of items until the confidence sequence of their difference excludes 0 (kept, or
    dropped), or until it is futile (dropped): given `report_n`, the sequence shows the trial's gain
    is below what `report_n` report items could resolve (power.mdd of the differences seen: a gain no
    report can confirm cannot change the decision); or its predictive chance of ending END_SE
    standard errors ahead on every pick item is under FUTILE_CHANCE (`futile`: a non-binding
    futility bound, as in group-sequential trials; it only ever makes a trial lose, so it adds no
    false win). Else the trial is kept if it is END_SE standard errors ahead on every item.
    Returns (better, items used, mean difference on them)."""
    diffs: list[float] = []
    n = len(ids)
    for batch in rounds(ids):
        diffs += paired(trial(batch), incumbent(batch))
        if len(diffs) >= MIN_ITEMS and len(diffs) < n:
            low, high = sequence(diffs, alpha, n)
            unresolvable = report_n is not None and high < mdd(diffs) * math.sqrt(len(diffs) / report_n)
            if low > 0 or high < 0 or unresolvable or futile(diffs, n):
                return low > 0, len(diffs), sum(diffs) / len(diffs)
    if not diffs:
        return False, 0, 0.0
    mean, sd = mean_sd(diffs)
    return mean > END_SE * sd / math.sqrt(len(diffs)), len(diffs), mean


def futile(diffs: Sequence[float], n: int) -> bool:
    """The trial's predictive chance of ending END_SE standard errors ahead on all `n` items is
    under FUTILE_CHANCE: the items left drawn around the mean so far with the spread so far, that
    mean itself uncertain (the final mean ~ N(mean, sd^2 (n - t) / (n t)); Spiegelhalter, Freedman
    and Blackburn 1986, predictive power)."""
    t = len(diffs)
    if t >= n:
        return False
    mean, sd = mean_sd(diffs)
    if sd == 0:
        return mean <= 0
    bar = END_SE * sd / math.sqrt(n)
    spread = sd * math.sqrt((n - t) / (n * t))
    return 0.5 * math.erfc((bar - mean) / (spread * math.sqrt(2))) < FUTILE_CHANCE


def exhaustive(
    trial: Callable[[list], list[float]], incumbent: Callable[[list], list[float]], ids: Sequence, **_
) -> tuple[bool, int, float]:
    """`duel` without racing: every item, then the point estimate (the search as it was before racing,
    kept as the benchmark's reference)."""
    diffs = paired(trial(list(ids)), incumbent(list(ids)))
    mean = sum(diffs) / len(diffs) if diffs else 0.0
    return mean > 0, len(diffs), mean
