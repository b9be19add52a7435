"""decide/fit.py against independent float64 references: ship's candidates' coefficient vectors
(candidate.menu: the stabilize pass's update on a basis) equal the paper's recurrences written out by hand; the
streaming combination equals a float64 sum of the checkpoints; the soup and the simplex search
do what their papers say on scores with a known answer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from trajectory import write_trajectory

from bema_cli.decide import fit
from bema_cli.stabilize import grid

STEPS = [10, 20, 30, 40, 50]


def reference(steps, at, kappa=0.5, eta=0.2, rho=10.0, gamma=1.0) -> dict[str, list[float]]:
    """EMA, BEMA and LAWA-w4 at step `at` as coefficients over (theta0, checkpoints), in float64
    from docs/math.md: w = rho + gamma*s, beta = w^-kappa, alpha = w^-eta, ema_0 = theta0."""
    n = len(steps) + 1
    e = [[float(i == j) for i in range(n)] for j in range(n)]
    ema = e[0][:]
    for j, s in enumerate(steps, start=1):
        w = rho + gamma * s
        beta = w**-kappa
        ema = [(1 - beta) * a + beta * b for a, b in zip(ema, e[j], strict=True)]
        if s == at:
            alpha = w**-eta
            bema = [m + alpha * (t - z) for m, t, z in zip(ema, e[j], e[0], strict=True)]
            k = steps.index(s) + 1  # checkpoints so far; a window not yet full averages those there are
            lawa = [1 / min(4, k) if k - 4 < i <= k and i > 0 else 0.0 for i in range(n)]
            return {"ema-k0.5": ema, "bema-k0.5-e0.2": bema, "lawa-w4": lawa}
    raise AssertionError(at)


def menu_at(tmp_path, schedules, at) -> dict[str, list[float]]:
    """ship's candidates at step `at` (candidate.menu on the sweep's plan of a real run), as lists."""
    from bema_cli.decide import candidate
    from bema_cli.stabilize import Options
    from bema_cli.sweep.walk import plan_sweep

    base, run = write_trajectory(tmp_path / "run", STEPS)
    plan = plan_sweep(Options(checkpoint_dir=str(run), schedules=schedules, out=None,
                              base=str(base)))  # fmt: skip
    return {name: c.coefficients(STEPS) for name, c in candidate.menu(plan, at).items()}


def test_menu_coefficients_equal_the_recurrences_by_hand(tmp_path):
    schedules = grid(["ema", "bema", "lawa"], [0.5], [0.2], windows=[4])
    for at in (30, 50):
        got = menu_at(tmp_path / str(at), schedules, at)
        assert got["vanilla"] == [float(s == at) for s in [0, *STEPS]]
        want = reference(STEPS, at)
        for run, c in want.items():
            assert got[run] == pytest.approx(c, abs=1e-12), run  # float64 throughout
            assert math.fsum(got[run]) == pytest.approx(1.0, abs=1e-12)
        assert got["lawa-w4"][-1] == pytest.approx(0.25 if at == 50 else 0.0)


@pytest.mark.parametrize("block", [fit.COMBINE_BLOCK, 7])  # 7: every tensor summed a few rows at a time
@pytest.mark.parametrize("vector", ["random", "bema-k0.5-e0.2"])
def test_served_written_and_verified_weights_are_the_float64_sum(tmp_path, monkeypatch, block, vector):
    """One vector, one model: what the engine is served (Combiner), what ship writes (write_vector)
    and what verify rebuilds are bitwise equal, and equal the float64 sum of the recorded vector over
    the checkpoints rounded once to the output dtype. For a menu config, stabilize's own output at
    that step agrees within that rounding (one bf16 ulp)."""
    from conftest import run_bema

    from bema_cli.decide.candidate import Candidate
    from bema_cli.publish.write import model_record, write_vector

    monkeypatch.setattr(fit, "COMBINE_BLOCK", block)
    base, run = write_trajectory(tmp_path, STEPS, dtype=torch.bfloat16, with_int=True)
    folders = {"theta0": base, **{str(s): run / f"checkpoint-{s}" for s in STEPS}}
    if vector == "random":
        g = torch.Generator().manual_seed(block)
        c = torch.randn(len(STEPS) + 1, generator=g, dtype=torch.float64)
        c[2] = 0.0
        c = (c / c.sum()).tolist()
    else:
        c = menu_at(tmp_path / "menu", grid(["bema"], [0.5], [0.2]), 50)[vector]
    cand = Candidate.of(vector, c, STEPS)
    record = model_record(cand, 50, {"method": "soup"}, folders, str(base), tmp_path / "out")
    out = write_vector(cand, folders, folders["50"], tmp_path / "out", record)
    got = load_file(out / "model.safetensors")
    combiner = fit.Combiner([base, *(run / f"checkpoint-{s}" for s in STEPS)], folders["50"])
    combiner.set("k", cand.coefficients(STEPS))
    served = dict(combiner.weights("k"))
    models = [load_file(f / "model.safetensors") for f in folders.values()]
    recorded = json.loads((out / "bema.json").read_text())["coefficients"]
    weights = [recorded.get(k, 0.0) for k in folders]
    for name, tensor in got.items():
        assert torch.equal(served[name], tensor), name
        if name == "positions":  # not floating: the template's (theta_s) as it is
            assert torch.equal(tensor, models[-1][name])
            continue
        want = sum(w * m[name].double() for w, m in zip(weights, models, strict=True)).to(torch.bfloat16)
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want), name  # one rounding, at the end
    assert (out / "config.json").read_text() == (folders["50"] / "config.json").read_text()
    r = run_bema("verify", out)
    assert r.returncode == 0 and "bitwise identical" in r.stdout, r.stderr
    if vector != "random":
        st = tmp_path / "st"
        r = run_bema(
            "stabilize", run, "--base", base, "--out", st, "--method", "bema", "--accum-dtype", "float64"
        )
        assert r.returncode == 0, r.stderr
        theirs = load_file(st / vector / "checkpoint-50" / "model.safetensors")
        for name, tensor in got.items():
            if tensor.is_floating_point():
                ulp = tensor.double().abs().clamp_min(1e-30) * 2.0**-7  # bf16: 8 bits of mantissa
                assert ((tensor.double() - theirs[name].double()).abs() <= ulp).all(), name


def test_greedy_soup_keeps_only_what_improves():
    """Score = -(distance of the soup's coefficients from a target): the soup adds b (closer on
    average), refuses c (farther), as Wortsman et al.'s Algorithm 1 does."""
    target = [0.0, 0.5, 0.5, 0.0]

    def score(c):
        return -sum((x - y) ** 2 for x, y in zip(c, target, strict=True))

    a, b, c = [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]
    ingredients = [("c", c, score(c) - 1), ("a", a, score(a)), ("b", b, score(b) - 0.1)]
    names, coef = fit.greedy_soup(ingredients, lambda t, soup: score(t) > score(soup))
    assert names == ["a", "b"] and coef == target


def test_simplex_fit_moves_weight_where_the_score_is_lower():
    """Loss = squared distance to a point of the simplex over the last 3 of 5 basis entries; the
    search starts uniform and must end closer, never worse, within its budget."""
    target = [0.0, 0.0, 0.7, 0.2, 0.1]

    def loss(c):
        return sum((x - y) ** 2 for x, y in zip(c, target, strict=True))

    c, calls = fit.simplex_fit(3, 5, lambda t, best: loss(t) < loss(best))
    uniform = loss([0, 0, 1 / 3, 1 / 3, 1 / 3])
    assert loss(c) < uniform / 2 and calls <= fit.SIMPLEX_BUDGET
    assert c[:2] == [0.0, 0.0] and math.fsum(c) == pytest.approx(1.0) and c[2] > c[3] > c[4]


@pytest.mark.parametrize(
    "target", [[0.0, 0.0, 0.7, 0.2, 0.1], [0.0, 0.0, 0.1, 0.3, 0.6], [0.0, 0.0, 0.2, 0.6, 0.2]]
)
def test_simplex_fit_never_spends_a_trial_on_a_point_already_tried(target):
    """A duel of a point against the same incumbent is decided already (its scores are cached: it
    costs no item and says nothing new), and an incumbent left behind is known worse: each of the
    budget's trials is a new vector (before, a sweep after a win polled its coordinates again)."""

    def loss(c):
        return sum((x - y) ** 2 for x, y in zip(c, target, strict=True))

    trials, incumbents = [], []

    def better(t, best):
        trials.append(tuple(round(x, 12) for x in t))
        incumbents.append(tuple(round(x, 12) for x in best))
        return loss(t) < loss(best)

    c, calls = fit.simplex_fit(3, 5, better)
    assert calls == len(trials) == fit.SIMPLEX_BUDGET  # the whole budget, on new points
    assert len(set(trials)) == len(trials), trials
    assert not set(trials) & {incumbents[0]}  # never back to the uniform start
    assert loss(c) < loss([0, 0, 1 / 3, 1 / 3, 1 / 3])
