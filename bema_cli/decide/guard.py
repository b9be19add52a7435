"""Guard tasks: with several tasks, --metric decides and every other task guards the decision.

An average the metric would ship is shipped only if, on each guard, it is shown not worse than
vanilla by more than the guard's margin: a one-sided non-inferiority test, read off the paired
bootstrap 95% interval of (average - vanilla) on the guard's items (its bound on the bad side beyond
-margin: a one-sided test at 2.5%). Accuracy cannot separate averages of one run (a 3-point gap
needs ~430-860 paired items per contender at 80% power), so a guard does not ask an average to be
better there, only not clearly worse; the margin says what "clearly" is. A blocked average is not
replaced by another: vanilla ships, and the verdict names the guard. docs/eval-protocol.md, "Guards".
"""

from __future__ import annotations

import math

from bema_cli import output
from bema_cli.decide import verdict
from bema_cli.decide.outcome import Shipped

# Default margins, in each metric's units: 3 points of accuracy, 0.02 nats/token of loss. On GSM8K's
# 660 items with 10% of them discordant, an average as good as vanilla passes 3 points 69% of the
# time (2 points: 41%; 4 points: 93%), and one worse by the margin 2-4% (bench/bench_decide.py).
DEFAULT_MARGIN = {"loss": 0.02, "accuracy": 0.03}


# Before anything is scored, a guard's pass rate for a model truly as good as vanilla is read at an
# assumed spread of its paired per-item differences; under POWER it is said up front. Accuracy: 10%
# of items discordant (two averages of one run disagree on few items: 10% in bench_decide's worlds and
# the runs measured in docs/eval-protocol.md, "Guards"), sd sqrt(0.1). Loss: 0.13 nats/token per
# record, as between LAWA-w4 and the last checkpoint in bench_decide's world, where the guard's own
# bootstrap passed an equal model 36%, 58% and 96% of the time at 100, 200 and 600 records.
DISCORDANT = 0.10
LOSS_SPREAD = 0.13
POWER = 0.80
Z95, Z80 = 1.959964, 0.841621


def spread(higher_is_better: bool) -> float:
    """The assumed sd of a guard's paired per-item differences: accuracy's (+-1 on the discordant
    items) or loss's, in nats/token."""
    return math.sqrt(DISCORDANT) if higher_is_better else LOSS_SPREAD


def pass_rate(items: int, margin: float, sd: float = math.sqrt(DISCORDANT)) -> float:
    """How likely an average truly as good as vanilla passes a guard of `items` paired items at
    `margin`: its interval's bound (mean - 1.96 sd / sqrt(n)) lies beyond -margin, `sd` the paired
    difference's. bench_decide's guard rows and tests/test_guard.py measure it through the
    bootstrap itself."""
    if items < 1 or margin <= 0:
        return 0.0
    z = margin * math.sqrt(items) / sd - Z95
    return 0.5 * math.erfc(-z / math.sqrt(2))


def foresight(task: str, items: int, margin: float, metric: str, higher_is_better: bool = True) -> dict:
    """What a guard can show at these items, said before any evaluation: the pass rate of a truly
    equal model and, under POWER, the levers (the items that margin needs, the margin these items
    can resolve, or the metric alone)."""
    sd = spread(higher_is_better)
    rate = pass_rate(items, margin, sd)
    doc = {"task": task, "items": items, "margin": margin, "equal_passes": round(rate, 3)}
    if rate < POWER:
        # a margin of 0 asks an equal model to be shown better: no number of items passes it
        doc["items_needed"] = math.ceil(((Z95 + Z80) * sd / margin) ** 2) if margin > 0 else None
        doc["margin_resolvable"] = round((Z95 + Z80) * sd / math.sqrt(max(items, 1)), 4)
        need = (
            f"{doc['items_needed']} items would pass it {POWER:.0%} of the time at this margin, "
            if margin > 0
            else ""
        )
        assumed = (
            f"{DISCORDANT:.0%} of items discordant"
            if higher_is_better
            else f"per-item differences of sd {LOSS_SPREAD:g} nats/token assumed"
        )
        doc["said"] = (
            f"{task} guard: an average as good as vanilla passes {rate:.0%} of the time at {items} items and "
            f"margin {margin:g} ({assumed}), so it may block a true winner: "
            f"{need}these items resolve --guard-margin {doc['margin_resolvable']:g}, or --tasks {metric} "
            "decides on the metric alone"
        )
    return doc


def foreseen(guards: dict[str, tuple[bool, int]], given: float | None, metric: str) -> list[dict]:
    """Each guard's `foresight` ({task: (higher_is_better, items)}), accuracy and loss alike, the
    ones under POWER warned: said before anything is scored, by ship and its dry run alike."""
    out = [foresight(t, n, margin_of(higher, given), metric, higher) for t, (higher, n) in guards.items()]
    for doc in out:
        if "said" in doc:
            output.warn(doc["said"])
    return out


def margin_of(higher_is_better: bool, given: float | None) -> float:
    """The guard's margin: --guard-margin when given, else the default for its kind of metric."""
    if given is not None:
        return given
    return DEFAULT_MARGIN["accuracy" if higher_is_better else "loss"]


def holds(vs: dict, higher_is_better: bool, margin: float) -> bool:
    """The average is shown not worse than vanilla by more than `margin`: the whole interval of
    (average - vanilla) lies above -margin (for a loss, below +margin)."""
    return vs["low"] > -margin if higher_is_better else vs["high"] < margin


def check(others: dict, given: float | None) -> list[dict]:
    """Each guard's verdict for the average `others` scored (contest._other_tasks' document, which
    gains a `guard` entry per task): the blocking ones first. None blocks when the shipped model is
    vanilla itself (no difference to test)."""
    out = []
    for task, doc in others.items():
        if doc.get("vs_vanilla") is None:
            continue
        higher = doc["higher_is_better"]
        margin = margin_of(higher, given)
        passed = holds(doc["vs_vanilla"], higher, margin)
        doc["guard"] = {"margin": margin, "passed": passed}
        out.append(
            {
                "task": task,
                "metric": doc["metric"],
                "higher_is_better": higher,
                "margin": margin,
                "passed": passed,
                "vs_vanilla": doc["vs_vanilla"],
            }
        )
    return sorted(out, key=lambda g: g["passed"])


def blocked_verdict(decision: Shipped, why: str, guard: dict, foreseen: dict | None = None) -> str:
    """The verdict of a ship a guard blocked: vanilla, what the metric said, and which guard said no;
    with `foreseen` (a guard that passes a truly equal model under POWER of the time), the levers."""
    shape = "above" if guard["higher_is_better"] else "below"
    said = (
        f"ship vanilla at step {decision.step}: {decision.run} won on the metric ({why.split(': ', 1)[-1]}), "
        f"but the guard {guard['task']} blocked it: {guard['metric']} {verdict.fmt_diff(guard['vs_vanilla'])} "
        f"against vanilla, not shown {shape} {'-' if shape == 'above' else '+'}{guard['margin']:g} (--guard-margin)"
    )
    if foreseen:  # the block may be the guard's size, not the average: said with what would change it
        said += (
            f"; at {foreseen['items']} items this guard passes an average as good as vanilla "
            f"{foreseen['equal_passes']:.0%} of the time: "
            + (f"{foreseen['items_needed']} items, " if foreseen["items_needed"] else "")
            + f"--guard-margin {foreseen['margin_resolvable']:g}, or the metric alone would decide"
        )
    return said


def guard_tasks(tasks, metric_task: str) -> list[str]:
    """The tasks that guard a decision: every evaluated task but the metric's (and train_loss, which
    ship does not score)."""
    return [t for t in tasks if t not in (metric_task, "train_loss")]
