"""What a selection says in words and whether it ships: the one number format of a difference and
its interval, the verdict sentence, and the rule that an average ships only when it beats vanilla
beyond its interval (select.py computes the intervals)."""

from __future__ import annotations


def fmt_value(v: float) -> str:
    return f"{v:.4g}"


def fmt_diff(d: dict | None) -> str:
    """The one number format: a difference, then its interval: -0.024 [-0.031, -0.017]."""
    if d is None:
        return ""
    p = f", McNemar p={d['mcnemar_p']:.3g}" if "mcnemar_p" in d else ""
    return f"{d['value']:+.4g} [{d['low']:+.4g}, {d['high']:+.4g}]{p}"


def verdict(doc: dict) -> str:
    """The decision in one sentence: what to ship, its value, and against vanilla at the same step;
    picked and reported on the same items, said so (its numbers are the pick's own, optimistic)."""
    w = doc["winner"]
    name = doc["metric"] if doc["metric"] != "loss" else "held-out loss"
    optimistic = (
        "; picked and reported on the same items (optimistic: the winner's curse; --holdout reports on others)"
        if doc["selection"]["holdout"] is None
        else ""
    )
    if w["run"] == "vanilla":
        beaten = [
            c
            for c in doc["candidates"]
            if c["vs_vanilla"] and is_better(c["vs_vanilla"], doc["higher_is_better"])
        ]
        why = "no average beats it beyond its interval" if not beaten else "the simplest of the tied"
        return f"ship vanilla at step {w['step']}: {name} {fmt_value(w['value'])}; {why}{optimistic}"
    vs = w["vs_vanilla"]
    vanilla = f" vs vanilla {fmt_value(w['value'] - vs['value'])} ({fmt_diff(vs)})" if vs else ""
    tied = f"; tied with {', '.join(w['tied_with'])}" if w.get("tied_with") else ""
    weak = (
        ""
        if not vs or is_better(vs, doc["higher_is_better"])
        else "; not beyond its interval against vanilla (ship writes vanilla)"
    )
    return f"ship {w['run']} at step {w['step']}: {name} {fmt_value(w['value'])}{vanilla}{tied}{weak}{optimistic}"


def beats_vanilla(doc: dict, margin: float = 0.0) -> bool:
    """Whether the winner is an average that beats vanilla at its step beyond the interval of the
    difference on the report items (and by more than `margin`, ship's --min-effect): only then does
    `bema ship` write an average."""
    w = doc["winner"]
    return (
        w["run"] != "vanilla"
        and w["vs_vanilla"] is not None
        and is_better(w["vs_vanilla"], doc["higher_is_better"], margin)
    )


def is_better(d: dict, higher_is_better: bool, margin: float = 0.0) -> bool:
    """The whole interval of a difference is on the good side of 0 (of `margin`, beyond it)."""
    return d["low"] > margin if higher_is_better else d["high"] < -margin


def equivalent(d: dict | None, margin: float) -> bool:
    """The whole interval of a difference lies within +-margin (ship's --min-effect): a release
    gate's other answer, equivalence within E (two one-sided tests at the interval's level)."""
    return d is not None and margin > 0 and -margin < d["low"] and d["high"] < margin
