"""What a number of items can resolve, and what a shipped difference is worth once it was tested.

- Minimum detectable difference (MDD): the smallest true difference a paired two-sided test at
  level 0.05 finds with probability 0.80 on n items, (z_0.975 + z_0.80) * sd(d) / sqrt(n), with sd(d)
  the spread of the per-item differences (Cohen 1988, ch. 2; the normal approximation).
- Winner's-curse correction: a difference is shipped only because its interval cleared 0 on the
  report items, so the shipped value is drawn from a normal *truncated* at the test's threshold
  c = 1.96 se. Its conditionally median-unbiased estimate (Zhong & Prentice 2008, "Bias-reduced
  estimators and confidence intervals for odds ratios in genome-wide association studies",
  Biostatistics 9; Ghosh, Zou & Wright 2008 give the conditional MLE, which runs to -inf when x sits
  on c) is the mu with P(X > x | X > c; mu) = 1/2. docs/eval-protocol.md, "What the numbers mean".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z_TEST = 1.959964  # two-sided 0.05
# Differences this small, relative to the values compared, are the arithmetic's, not the models':
# two averages equal in exact arithmetic (a window over equal checkpoints, and one of them) score
# ~1e-7 apart in float32 (docs/eval-protocol.md, "Ties"). About 80 float32 ulps: a tie.
RESOLUTION = 1e-5
Z_POWER = 0.841621  # 0.80


def resolved(diff: float, x: float, y: float) -> float:
    """The paired difference x - y (`diff`), or 0 where it is below the arithmetic's resolution."""
    return 0.0 if abs(diff) <= RESOLUTION * max(abs(x), abs(y)) else diff


def paired(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """Per-item differences x - y, each below the arithmetic's resolution counted as a tie (0)."""
    return [resolved(x - y, x, y) for x, y in zip(xs, ys, strict=True)]


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """The mean and sample standard deviation (n - 1) of at least two values."""
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def mdd(diffs: Sequence[float], scale: float = 1.0) -> float:
    """Minimum detectable difference at 80% power of a paired test on these per-item differences
    (each divided by `scale`: loss items are summed NLLs, the metric is NLL per token)."""
    n = len(diffs)
    if n < 2:
        return math.inf
    return (Z_TEST + Z_POWER) * mean_sd(diffs)[1] / scale / math.sqrt(n)


def log_tail(z: float) -> float:
    """log(1 - Phi(z)), accurate far into the tail (erfc underflows past z ~ 38: Mills' asymptotic
    series there, to the term in z^-8: relative error under 1e-13 from z = 36)."""
    if z < 36:
        return math.log(0.5 * math.erfc(z / math.sqrt(2)))
    u = 1 / (z * z)
    series = 1 - u + 3 * u**2 - 15 * u**3 + 105 * u**4
    return -z * z / 2 - math.log(z * math.sqrt(2 * math.pi)) + math.log(series)


def corrected(x: float, se: float) -> float:
    """The conditionally median-unbiased estimate of the true difference mu, given that x (oriented:
    better is positive) was reported only because x > 1.96 se: the mu under which half of the
    differences that pass the test exceed x, kept between 0 and x (far below x, down to 0, when x
    barely passed)."""
    if not se > 0 or not math.isfinite(se) or x <= Z_TEST * se:
        return x

    def above(mu: float) -> float:  # log P(X > x | X > c; mu), increasing in mu
        return log_tail((x - mu) / se) - log_tail((Z_TEST * se - mu) / se)

    lo, hi = x - 40 * se, x
    for _ in range(100):  # bisection on log P(X > x | X > c) = log 1/2
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if above(mid) < math.log(0.5) else (lo, mid)
    # Just past the threshold the conditional estimate runs far below 0 (to -inf as x -> c): it is
    # kept between 0 and x. For a true difference >= 0 that moves only estimates already below it,
    # so the median-unbiasedness holds; it never reads as the opposite of the shipped difference.
    return max(0.0, (lo + hi) / 2)
