"""Guard tasks (decide/guard.py): an average is shipped only if, on each task --metric does not name,
it is shown not worse than vanilla by more than the guard's margin. Checked by simulation through
ship's own paired bootstrap (select.versus) on worlds whose truth is known, each rate with its
Wilson interval: an average worse by exactly the margin passes at most 5% of the time (one-sided
2.5% by construction), and one as good as vanilla passes most of the time (the test is not vacuous)."""

from __future__ import annotations

import numpy as np
import pytest
from test_race import wilson

from bema_cli.decide import guard, select
from bema_cli.decide.metric import Metric
from bema_cli.decide.outcome import Shipped

METRIC = Metric("gsm8k", "flexible", True)


def _record(run: str, correct: np.ndarray) -> dict:
    return {"run": run, "step": 80, "task": "gsm8k", "model_path": run, "is_base": False, "protocol": {},
            "seeds": None, "n_samples": 1, "n_prompts": len(correct), "backend": "sim", "dtype": "float32",
            "items": {"ids": list(range(len(correct))), "flexible": correct.astype(float).tolist()}}  # fmt: skip


def _pass_rate(true_gap: float, margin: float, items: int, reps: int, seed: int) -> tuple[int, int]:
    """How often the guard passes an average whose accuracy is vanilla's + true_gap (paired items:
    the two disagree on a tenth of them, as averages of one run do)."""
    rng = np.random.default_rng(seed)
    passed, share = 0, 0.1 + abs(true_gap)  # discordant items: the average right and vanilla wrong, or
    up = (1 + true_gap / share) / 2  # the reverse, tilted so the mean difference is true_gap exactly
    for _ in range(reps):
        vanilla = rng.random(items) < 0.5
        discordant = rng.random(items) < share
        wins = rng.random(items) < up
        average = np.where(discordant, wins, vanilla)
        vanilla = np.where(discordant, ~wins, vanilla)
        vs = select.versus(_record("avg", average), _record("vanilla", vanilla), METRIC, None, 0, 1000)
        passed += guard.holds(vs, True, margin)
    return passed, reps


def test_a_guard_passes_an_average_worse_by_its_margin_at_most_5_percent_of_the_time():
    k, n = _pass_rate(true_gap=-0.05, margin=0.05, items=400, reps=300, seed=1)
    lo, hi = wilson(k, n)
    assert k / n <= 0.05 and lo <= 0.05, (k, n, lo, hi)
    k0, n0 = _pass_rate(true_gap=0.0, margin=0.05, items=400, reps=100, seed=2)
    assert k0 / n0 >= 0.8, (k0, n0)  # as good as vanilla: it passes


def test_check_blocks_first_and_names_the_guard():
    others = {
        "gsm8k": {"metric": "gsm8k:flexible", "higher_is_better": True,
                  "vs_vanilla": {"value": -0.04, "low": -0.09, "high": 0.01}},
        "boolq": {"metric": "boolq:flexible", "higher_is_better": True,
                  "vs_vanilla": {"value": 0.0, "low": -0.01, "high": 0.01}},
        "mmlu_hs": {"metric": "mmlu_hs:flexible", "higher_is_better": True, "vs_vanilla": None},
    }  # fmt: skip
    guards = guard.check(others, None)
    assert [(g["task"], g["passed"]) for g in guards] == [("gsm8k", False), ("boolq", True)]
    assert others["gsm8k"]["guard"] == {"margin": 0.03, "passed": False} and "guard" not in others["mmlu_hs"]
    assert [g["passed"] for g in guard.check(others, 0.1)] == [True, True]  # a wider margin lets it through
    loss = {
        "loss": {
            "metric": "loss",
            "higher_is_better": False,
            "vs_vanilla": {"value": 0.01, "low": 0.0, "high": 0.03},
        }
    }
    assert guard.check(loss, None)[0]["passed"] is False and guard.check(loss, 0.05)[0]["passed"] is True
    said = guard.blocked_verdict(
        Shipped("lawa-w4", 80, "menu", 1.2), "ship lawa-w4 at step 80: loss 1.2 vs ...", guards[0]
    )
    assert (
        said.startswith("ship vanilla at step 80: lawa-w4 won on the metric")
        and "guard gsm8k blocked it" in said
    )


@pytest.mark.parametrize("items", [100, 300, 660])
def test_the_foreseen_pass_rate_is_the_guards_own_by_simulation(items):
    """guard.pass_rate, said before anything is scored, against the guard itself (select.versus's
    bootstrap and guard.holds) on 300 equal models of 10% discordant items at the default margin: the
    foreseen rate lies within the simulation's Wilson 95% interval widened by 0.05 (the bootstrap's
    percentile interval is a little narrower than the normal one the formula reads). The issue
    measured 19%, 37% and 64%: under 80%, each is said with its levers."""
    margin = guard.DEFAULT_MARGIN["accuracy"]
    k, n = _pass_rate(true_gap=0.0, margin=margin, items=items, reps=300, seed=items)
    lo, hi = wilson(k, n)
    rate = guard.pass_rate(items, margin)
    assert lo - 0.05 <= rate <= hi + 0.05, (items, rate, k / n, lo, hi)
    doc = guard.foresight("gsm8k", items, margin, "loss")
    assert "said" in doc and f"{rate:.0%} of the time at {items} items" in doc["said"]
    assert (
        guard.pass_rate(doc["items_needed"], margin)
        >= guard.POWER
        > guard.pass_rate(doc["items_needed"] - 1, margin)
    )
    assert guard.pass_rate(items, doc["margin_resolvable"]) == pytest.approx(guard.POWER, abs=1e-3)


def _loss_pass_rate(margin: float, items: int, reps: int, seed: int) -> tuple[int, int]:
    """How often the guard passes an average as good as vanilla on held-out loss (paired records of
    20-60 tokens, the average's loss per token vanilla's + a difference of sd guard.LOSS_SPREAD)."""
    rng = np.random.default_rng(seed)
    passed = 0
    for _ in range(reps):
        tokens = rng.integers(20, 61, size=items).astype(float)
        base = rng.normal(1.5, 0.3, size=items)
        recs = [
            {**_record(run, np.zeros(items)), "task": "loss",
             "items": {"ids": list(range(items)), "nll": (per_token * tokens).tolist(), "tokens": tokens.tolist()}}
            for run, per_token in (("avg", base + rng.normal(0, guard.LOSS_SPREAD, items)), ("vanilla", base))
        ]  # fmt: skip
        vs = select.versus(recs[0], recs[1], Metric("loss", "loss", False), None, 0, 1000)
        passed += guard.holds(vs, False, margin)
    return passed, reps


@pytest.mark.parametrize("items", [100, 200, 600])
def test_a_loss_guard_is_foreseen_as_its_own_bootstrap_passes(items):
    """A loss guard is foreseen as an accuracy guard is, at its assumed spread: guard.pass_rate at
    sd LOSS_SPREAD lies within the Wilson 95% interval (widened by 0.05, as above) of the guard's own
    bootstrap on 300 equal models at the default margin; under 80% it is said with its levers and
    its assumption, and the dry run's `guards` holds it (tests/test_ship.py)."""
    margin = guard.DEFAULT_MARGIN["loss"]
    k, n = _loss_pass_rate(margin, items, reps=300, seed=items)
    lo, hi = wilson(k, n)
    rate = guard.pass_rate(items, margin, guard.LOSS_SPREAD)
    assert lo - 0.05 <= rate <= hi + 0.05, (items, rate, k / n, lo, hi)
    doc = guard.foresight("loss", items, margin, "gsm8k", higher_is_better=False)
    assert doc["equal_passes"] == pytest.approx(rate, abs=1e-3)
    if rate < guard.POWER:
        assert (
            f"{rate:.0%} of the time at {items} items" in doc["said"] and "sd 0.13 nats/token" in doc["said"]
        )
        needed = doc["items_needed"]
        assert (
            guard.pass_rate(needed, margin, 0.13) >= guard.POWER > guard.pass_rate(needed - 1, margin, 0.13)
        )
    else:
        assert "said" not in doc


def test_a_guard_block_names_its_levers_when_it_could_not_pass_an_equal_model():
    blocked = {"task": "gsm8k", "metric": "gsm8k:flexible", "higher_is_better": True, "margin": 0.03,
               "passed": False, "vs_vanilla": {"value": -0.005, "low": -0.04, "high": 0.03}}  # fmt: skip
    said = guard.blocked_verdict(Shipped("lawa-w4", 380, "menu", 1.0), "ship lawa-w4 at step 380: x",
                                 blocked, guard.foresight("gsm8k", 128, 0.03, "loss"))  # fmt: skip
    assert "at 128 items this guard passes an average as good as vanilla 19% of the time" in said, said
    assert "873 items, --guard-margin 0.0783, or the metric alone would decide" in said, said


def test_the_flip_table_counts_the_items_each_side_gets_right():
    """metric.flips against a count made here with numpy: items the average gets right more often
    than vanilla (gained) and less often (lost), on the items both scored, the first ids named."""
    from bema_cli.decide.metric import flip_note, flips

    rng = np.random.default_rng(5)
    average, vanilla = rng.random(200) < 0.6, rng.random(200) < 0.5
    table = flips(_record("avg", average), _record("vanilla", vanilla), METRIC)
    gained, lost = np.flatnonzero(average & ~vanilla), np.flatnonzero(~average & vanilla)
    assert (table["gained"], table["lost"], table["items"]) == (len(gained), len(lost), 200)
    assert table["gained_ids"] == gained[:5].tolist() and table["lost_ids"] == lost[:5].tolist()
    note = flip_note("gsm8k", "lawa-w4", table)
    assert note.startswith(
        f"gsm8k: of 200 items, lawa-w4 is right more often than vanilla on {len(gained)} ("
    )
    assert flips(_record("avg", average), _record("vanilla", vanilla), Metric("loss", "loss", False)) is None
