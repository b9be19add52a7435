"""recurrence.py (the one implementation of the math) against the plain float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from reference import reference, weights

from bema_cli.errors import UsageError
from bema_cli.recurrence import Stabilizer
from bema_cli.schedule import Schedule, run_name

METHODS = ["vanilla", "ema", "bema", "dema", "ouema"]
CASES = [
    dict(preset="paper"),
    dict(preset="paper", tau=20, phi=20, kappa=0.3, eta=0.4),
    dict(preset="paper", beta_min=0.3, gamma=2.0, rho=1.0, eta=math.inf),
    dict(preset="reference"),
    dict(preset="reference", phi=30, tau=10, rho=5.0),
    dict(preset="reference", phi=10, gamma=0.5, kappa=1.0, eta=0.0),
]
STEPS = [10, 20, 30, 40, 60, 80, 90]


def _run(
    method: str, case: dict, theta0: torch.Tensor, states: list[torch.Tensor]
) -> dict[int, torch.Tensor]:
    """recurrence.py in float64 over a trajectory, as the engine drives it."""
    sched = Schedule(method=method, **case)
    stab = Stabilizer(method, theta0.clone())
    out = {}
    for event, theta in zip(sched.plan(STEPS), states, strict=True):
        result = stab.apply(event, theta)
        if result is not None:
            out[event.step] = result.clone()
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("method", METHODS)
def test_stabilizer_matches_reference(method, case):
    if method == "ouema" and case.get("eta") == 0.0:
        pytest.skip("ouema with eta 0 is an error (tested below)")
    g = torch.Generator().manual_seed(1)
    theta0 = torch.randn(7, 5, generator=g, dtype=torch.float64)
    states = [
        theta0 + 0.1 * (i + 1) * torch.randn(7, 5, generator=g, dtype=torch.float64)
        for i in range(len(STEPS))
    ]
    ours = _run(method, case, theta0, states)
    ref = reference(
        {"w": theta0}, [(s, {"w": x}) for s, x in zip(STEPS, states, strict=True)], method, **case
    )
    assert sorted(ours) == sorted(ref)
    for step in ref:
        # float64 on both sides, different operation order: agreement to ~1e-14
        torch.testing.assert_close(ours[step], ref[step]["w"], rtol=1e-12, atol=1e-12)


def test_schedule_weights_match_issue_formulas():
    s = Schedule(kappa=0.5, eta=0.2).resolved()
    assert s.ema_weight(90) == pytest.approx(100**-0.5)
    assert s.bias_weight(90) == pytest.approx(100**-0.2)
    r = Schedule(preset="reference", kappa=0.5, eta=0.2, rho=0.0).resolved()
    assert r.beta_min == 1e-4 and r.phi == 400
    # t = max(s - tau + rho, 1) = 399; beta = (1 + t)**-kappa, alpha = (1 + t)**-eta
    assert r.ema_weight(399) == pytest.approx(400**-0.5)
    assert r.bias_weight(399) == pytest.approx(400**-0.2)
    assert weights(399, "reference", 0.5, 0.2, 1.0, 0.0, 0, 1e-4) == pytest.approx((400**-0.2, 400**-0.5))
    assert Schedule(eta=math.inf).resolved().bias_weight(5) == 0.0
    assert Schedule(eta=0.0).resolved().bias_weight(5) == 1.0  # eta 0 = full correction, not off
    assert Schedule(kappa=5.0, beta_min=0.25).resolved().ema_weight(100) == 0.25


def test_reference_cadence():
    plan = Schedule(preset="reference", phi=400).plan([100, 200, 500, 600, 900, 1000])
    assert [e.action for e in plan] == ["update", "skip", "update", "skip", "update", "skip"]


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(kappa=-1.0), "--kappa"),
        (dict(eta=-0.5), "--eta"),
        (dict(method="ouema", eta=0.0), "--eta 0"),
        (dict(phi=0), "--phi"),
        (dict(tau=-1), "--tau"),
        (dict(beta_min=2.0), "--beta-min"),
        (dict(method="nope"), "--method"),
        (dict(preset="nope"), "--preset"),
    ],
)
def test_invalid_hyperparameters(kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        Schedule(**kwargs).resolved()


def test_nonpositive_w_is_an_error():
    with pytest.raises(UsageError, match="rho \\+ gamma\\*s must be > 0"):
        Schedule(rho=-50.0).plan([10, 20])


def test_run_names():
    assert run_name(Schedule(kappa=0.5, eta=0.2)) == "bema-k0.5-e0.2"
    assert run_name(Schedule(kappa=0.5, eta=math.inf)) == "bema-k0.5-einf"
    assert run_name(Schedule(method="ema", kappa=0.25)) == "ema-k0.25"
    assert run_name(Schedule(method="ouema", kappa=1.0, eta=0.4)) == "ouema-k1.0-e0.4"
    assert run_name(Schedule(method="vanilla")) == "vanilla"


def test_state_key_shares_only_identical_state_trajectories():
    from bema_cli.schedule import state_key

    def key(**kw):
        return state_key(Schedule(**kw).resolved())

    assert key(method="bema", eta=0.2) == key(method="bema", eta=0.4) == key(method="ema", eta=math.inf)
    assert key(method="bema", kappa=0.2) != key(method="bema", kappa=0.5)
    assert key(method="bema", phi=2) != key(method="bema")
    assert key(method="ouema", eta=0.2) != key(method="ouema", eta=0.4)
    assert key(method="dema") != key(method="ema")


def test_shared_state_gives_each_methods_own_estimate():
    """One bema state read as ema and as bema equals separate ema and bema stabilizers (float64)."""
    torch.manual_seed(0)
    theta0 = torch.randn(7, dtype=torch.float64)
    trajectory = [theta0 + 0.1 * k + 0.05 * torch.randn(7, dtype=torch.float64) for k in range(1, 6)]
    events = Schedule(method="bema").plan(list(range(1, 6)))
    shared, ema, bema = (Stabilizer(m, theta0) for m in ("bema", "ema", "bema"))
    for event, theta in zip(events, trajectory, strict=True):
        shared.advance(event, theta)
        assert torch.equal(shared.estimate(event, theta, method="ema"), ema.apply(event, theta))
        assert torch.equal(shared.estimate(event, theta), bema.apply(event, theta))
    with pytest.raises(ValueError):
        shared.estimate(events[-1], trajectory[-1], method="dema")
