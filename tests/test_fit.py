"""decide/fit.py against independent float64 references: the menu's coefficient vectors (from the
stabilize engine on a basis trajectory) equal the paper's recurrences written out by hand; the
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


def test_menu_coefficients_equal_the_recurrences_by_hand(tmp_path):
    schedules = grid(["ema", "bema", "lawa"], [0.5], [0.2], windows=[4])
    for at in (30, 50):
        got = fit.coefficients(schedules, STEPS, at, tmp_path / "basis")
        want = reference(STEPS, at)
        for run, c in want.items():
            assert got[run] == pytest.approx(c, abs=1e-12), run  # float64 throughout
            assert math.fsum(got[run]) == pytest.approx(1.0, abs=1e-12)
        assert got["lawa-w4"][-1] == pytest.approx(0.25 if at == 50 else 0.0)


@pytest.mark.parametrize("block", [fit.COMBINE_BLOCK, 7])  # 7: every tensor summed a few rows at a time
def test_combine_is_the_float64_sum_of_the_checkpoints(tmp_path, monkeypatch, block):
    monkeypatch.setattr(fit, "COMBINE_BLOCK", block)
    base, run = write_trajectory(tmp_path, STEPS, dtype=torch.bfloat16, with_int=True)
    folders = [base, *(run / f"checkpoint-{s}" for s in STEPS)]
    c = [0.1, -0.05, 0.0, 0.3, 0.25, 0.4]
    out = fit.combine(list(zip(folders, c, strict=True)), folders[-1], tmp_path / "out", {"run": "x"})
    got = load_file(out / "model.safetensors")
    models = [load_file(f / "model.safetensors") for f in folders]
    for name, tensor in got.items():
        if name == "positions":  # not floating: the template's (theta_s) as it is
            assert torch.equal(tensor, models[-1][name])
            continue
        want = sum(w * m[name].double() for w, m in zip(c, models, strict=True)).to(torch.bfloat16)
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want), name  # one rounding, at the end
    assert json.loads((out / "bema.json").read_text()) == {"run": "x"}
    assert (out / "config.json").read_text() == (folders[-1] / "config.json").read_text()


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
