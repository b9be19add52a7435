"""`bema simulate` against an independent float64 theory of the noisy quadratic.

Every estimator is a fixed linear combination sum_k w_k theta_k of the Gaussian SGD iterates, so
its expected squared error is exact: per eigendirection a (contraction c = 1 - lr*a, start d),
    bias = d * sum_k w_k c^k,   variance = lr^2 sigma^2 sum_{j<s} (sum_{k>j} w_k c^(k-1-j))^2.
The weights w are derived here from the paper's formulas in numpy (closed-form products for the
EMA), NOT with bema_cli.recurrence, so a bug there or in the simulator shows up as a mismatch.
Monte-Carlo tolerances are stated per test in standard errors (seeded, hence deterministic).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import run_bema

from bema_cli.errors import UsageError
from bema_cli.simulate import SimSettings, simulate


# -- the independent reference ------------------------------------------------------------
def paper_weights(s: int, kappa: float, eta: float, rho: float, gamma: float = 1.0) -> tuple[float, float]:
    """(alpha_s, beta_s) of Algorithm 1: w = rho + gamma*s, beta = min(1, w^-kappa), alpha = w^-eta."""
    w = rho + gamma * s
    return w**-eta, min(1.0, w**-kappa)


def ema_closed_form(s: int, kappa: float, rho: float, gamma: float = 1.0) -> np.ndarray:
    """Weights of theta_0..theta_s in the EMA started at theta_0: beta_j prod_{i>j} (1 - beta_i)."""
    betas = np.array([1.0] + [paper_weights(i, kappa, 0.0, rho, gamma)[1] for i in range(1, s + 1)])
    keep = np.append(np.cumprod((1 - betas[1:])[::-1])[::-1], 1.0)  # prod_{i=j+1}^{s} (1 - beta_i)
    return betas * keep


def estimator_weights(
    method: str, steps: int, kappa, eta, rho, gamma=1.0, tau=0, phi=None
) -> list[np.ndarray]:
    """Weights over theta_0..theta_s of each method's estimate at s = 1..steps (burn-in, phi cadence)."""
    n = steps + 1
    unit = np.eye(n)
    base = unit[0]
    e1 = e2 = ou = unit[0]
    out, held = [], unit[0]
    for s in range(1, steps + 1):
        alpha, beta = paper_weights(s, kappa, eta, rho, gamma)
        if s <= tau:  # burn-in: restart everything at theta_s
            base = e1 = e2 = ou = unit[s]
            held = unit[s]
        elif phi is None or (s - tau) % phi == 0:
            e1 = (1 - beta) * e1 + beta * unit[s]
            e2 = (1 - beta) * e2 + beta * e1
            ou = (1 - beta) * ou + beta * (unit[s] - alpha * base) / (1 - alpha)
            held = {
                "vanilla": unit[s],
                "ema": e1,
                "bema": e1 + alpha * (unit[s] - base),
                "dema": 2 * e1 - e2,
                "ouema": ou,
            }[method]
        out.append(held)  # a skipped step keeps the last estimate
    return out


def exact_error(w: np.ndarray, eig: np.ndarray, lr: float, sigma: float, distance: float) -> float:
    """E|sum_k w_k theta_k - mu|^2 for theta0 - mu = distance/sqrt(dim) * ones."""
    s = len(w) - 1
    d = distance / math.sqrt(len(eig))
    power = np.subtract.outer(np.arange(s + 1), np.arange(s)) - 1  # [k, j] -> k-1-j; k > j only
    total = 0.0
    for a, count in zip(*np.unique(eig, return_counts=True), strict=True):
        c = 1.0 - lr * a
        bias = d * np.sum(w * c ** np.arange(s + 1))
        g = (np.where(power >= 0, c ** np.maximum(power, 0), 0.0) * w[:, None]).sum(axis=0)
        total += count * (bias**2 + lr**2 * sigma**2 * np.sum(g**2))
    return float(total)


def exact_curve(method, steps, record, eig, lr=0.05, sigma=1.0, distance=10.0, **schedule) -> np.ndarray:
    weights = estimator_weights(method, steps, **schedule)
    return np.array([exact_error(weights[s - 1][: s + 1], eig, lr, sigma, distance) for s in record])


THEORY = dict(kappa=1.0, eta=0.5, rho=1.0)  # the defaults of `bema simulate`
LM = dict(kappa=0.5, eta=0.2, rho=10.0)  # the language-model defaults of `bema stabilize`


# -- exact numbers quoted in the issue ----------------------------------------------------------
def test_reference_reproduces_the_issue_numbers():
    eig, record = np.ones(20), list(range(1, 401))
    ema, bema, vanilla = (exact_curve(m, 400, record, eig, **THEORY) for m in ("ema", "bema", "vanilla"))
    # the EMA of the theory regime is the flat average of theta_0..theta_s
    np.testing.assert_allclose(ema_closed_form(50, 1.0, 1.0), np.full(51, 1 / 51), rtol=1e-12)
    assert bema[49] == pytest.approx(5.73, abs=0.005) and ema[49] == pytest.approx(13.40, abs=0.005)
    assert bema[399] == pytest.approx(0.050, abs=0.0005) and ema[399] == pytest.approx(0.295, abs=0.0005)
    assert np.all(bema < ema)
    # "below vanilla from about step 200": exactly, from step 135 on (and at steps 1-3, by extrapolation)
    below = np.flatnonzero(bema < vanilla) + 1
    assert below[:3].tolist() == [1, 2, 3] and below[3] == 135 and np.all(bema[134:] < vanilla[134:])
    lm_bema, lm_ema = (exact_curve(m, 50, [50], eig, **LM)[0] for m in ("bema", "ema"))
    assert lm_bema == pytest.approx(9.43, abs=0.01) and lm_ema == pytest.approx(1.66, abs=0.01)


# -- Monte Carlo vs exact --------------------------------------------------------------------------
CASES = {
    "theory-regime": (dict(spectrum="ones"), THEORY, {}),
    "lm-defaults-ill-conditioned-burnin-phi": (dict(spectrum="linspace:0.1:1"), LM, dict(tau=5, phi=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_monte_carlo_matches_exact_expected_error(case):
    """Every estimator's mean error is within 4 standard errors of its exact expectation."""
    problem, schedule, cadence = CASES[case]
    st = SimSettings(steps=240, trials=2000, record_every=40, seed=3, **problem, **schedule, **cadence)
    doc = simulate(st)
    eig = np.linspace(0.1, 1, 20) if problem["spectrum"] != "ones" else np.ones(20)
    assert doc["steps"] == [40, 80, 120, 160, 200, 240]
    for method in ("vanilla", "ema", "bema", "dema", "ouema"):
        exact = exact_curve(method, 240, doc["steps"], eig, **schedule, **cadence)
        mean, se = np.array(doc["estimators"][method]["mean"]), np.array(doc["estimators"][method]["stderr"])
        assert np.all(se > 0) and np.all(se < 0.05 * mean), method
        z = (mean - exact) / se
        assert np.all(np.abs(z) < 4), f"{method}: z = {np.round(z, 2)}"
    # the exact vanilla line of the tool is this same expectation (float64 closed form vs sums)
    vanilla = exact_curve("vanilla", 240, doc["steps"], eig, **schedule, **cadence)
    if not cadence:
        np.testing.assert_allclose(doc["theory"]["vanilla_exact"], vanilla, rtol=1e-10)
    # mle = mu - A^-1 sigma mean(xi): its expected error IS the Cramer-Rao-type bound
    bound = np.array([np.sum(eig**-2.0) / s for s in doc["steps"]])
    np.testing.assert_allclose(doc["theory"]["cramer_rao"], bound, rtol=1e-12)
    mle = doc["estimators"]["mle"]
    assert np.all(np.abs(np.array(mle["mean"]) - bound) < 4 * np.array(mle["stderr"]))


def test_bema_removes_the_lag_and_matches_the_issue():
    """Fig. 2: BEMA below EMA at every recorded step; the quoted numbers within 4 standard errors."""
    doc = simulate(
        SimSettings(steps=400, trials=1000, record_every=10, seed=1, methods=("ema", "bema", "vanilla"))
    )
    ema, bema = (np.array(doc["estimators"][m]["mean"]) for m in ("ema", "bema"))
    assert np.all(bema < ema)
    at = {s: i for i, s in enumerate(doc["steps"])}
    for method, step, expected in (
        ("bema", 50, 5.73),
        ("ema", 50, 13.40),
        ("bema", 400, 0.0501),
        ("ema", 400, 0.295),
    ):
        got, se = doc["estimators"][method]["mean"][at[step]], doc["estimators"][method]["stderr"][at[step]]
        assert abs(got - expected) < 4 * se + 0.005 * expected, (method, step, got, se)
    vanilla = np.array(doc["estimators"]["vanilla"]["mean"])
    assert np.all(bema[at[200] :] < vanilla[at[200] :])


def test_seed_reproducible_and_trials_independent():
    a = simulate(SimSettings(steps=30, trials=200, record_every=10, seed=7))
    b = simulate(SimSettings(steps=30, trials=200, record_every=10, seed=7))
    c = simulate(SimSettings(steps=30, trials=200, record_every=10, seed=8))
    assert a["estimators"] == b["estimators"]
    assert a["estimators"]["bema"]["mean"] != c["estimators"]["bema"]["mean"]
    one = simulate(SimSettings(steps=30, trials=1, record_every=10))
    assert all(math.isnan(v) for v in one["estimators"]["ema"]["stderr"])


# -- the CLI -----------------------------------------------------------------------------------------
def test_cli_json_document(tmp_path):
    plot, plot2d = tmp_path / "curves.png", tmp_path / "path.png"
    args = ["--steps", "95", "--trials", "50", "--record-every", "25", "--methods", "ema,bema,mle"]
    r = run_bema("simulate", *args, "--plot", plot, "--plot-2d", plot2d, "--json", "--eta", "inf")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"settings", "steps", "estimators", "theory"}
    assert doc["steps"] == [25, 50, 75, 95]
    assert set(doc["estimators"]) == {"ema", "bema", "mle"}
    for v in [*doc["estimators"].values()]:
        assert set(v) == {"mean", "stderr"} and len(v["mean"]) == len(v["stderr"]) == 4
    assert set(doc["theory"]) == {"vanilla_exact", "cramer_rao"} and all(
        len(v) == 4 for v in doc["theory"].values()
    )
    s = doc["settings"]
    for flag in (
        "dim",
        "lr",
        "sigma",
        "steps",
        "trials",
        "spectrum",
        "distance",
        "seed",
        "record_every",
        "methods",
        "kappa",
        "eta",
        "gamma",
        "rho",
        "tau",
        "phi",
        "preset",
        "beta_min",
        "plot",
        "plot_2d",
    ):
        assert flag in s, flag
    assert s["eta"] is None and s["trials"] == 50 and s["bema_version"] and s["dtype"] == "float64"
    # eta inf: no correction, BEMA is EMA
    assert doc["estimators"]["bema"] == doc["estimators"]["ema"]

    import matplotlib.image

    for path, shape in ((plot, (550, 900)), (plot2d, (600, 750))):
        img = matplotlib.image.imread(path)
        assert img.shape[:2] == shape and img[..., :3].std() > 0.05, path


def test_cli_table_and_errors(tmp_path):
    r = run_bema("simulate", "--steps", "40", "--trials", "20", "--record-every", "20")
    assert r.returncode == 0, r.stderr
    lines = [line.split() for line in r.stdout.splitlines()]
    assert ["step", "vanilla", "ema", "bema", "dema", "ouema", "mle", "exact", "CR"] in lines
    assert [row[0] for row in lines if row and row[0].isdigit()] == ["20", "40"]
    r = run_bema("simulate", "--steps", "5", "--spectrum", "linspace:0:1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--spectrum" in r.stderr, r.stderr
    missing = tmp_path / "nope" / "x.png"
    r = run_bema("simulate", "--steps", "5", "--plot", missing)
    assert r.returncode == 4 and "--plot" in r.stderr and not missing.parent.exists(), r.stderr


@pytest.mark.parametrize(
    "flags, needle",
    [
        (dict(spectrum="linspace:0:1"), "--spectrum"),
        (dict(spectrum="1,2"), "--spectrum"),
        (dict(spectrum="geomspace:1"), "--spectrum"),
        (dict(lr=2.5), "--lr"),
        (dict(trials=0), "--trials"),
        (dict(methods=("ema", "bogus")), "--methods"),
        (dict(eta=0.0, methods=("ouema",)), "--eta"),
        (dict(phi=0), "--phi"),
    ],
)
def test_invalid_settings_name_the_flag(flags, needle):
    with pytest.raises(UsageError, match=needle):
        SimSettings(steps=5, **flags).validated()


def test_window_averages_on_the_quadratic_match_their_definitions():
    """lawa, wsm, swa and power in `bema simulate` are their formulas over the SGD iterates (each step
    a checkpoint), computed here in float64 from the vanilla iterates of the same run."""
    import torch
    from reference import edm2_gamma, megatron_coefficients

    from bema_cli.simulate import parse_spectrum, walk

    st = SimSettings(
        dim=3, trials=4, steps=30, methods=("vanilla", "lawa", "wsm", "swa", "power"), window=5, swa_start=7
    ).validated()
    gen = torch.Generator().manual_seed(0)
    iterates, got = {}, {}
    for k, held in walk(st, parse_spectrum(st.spectrum, st.dim), st.trials, gen, lambda k: True):
        iterates[k] = held["vanilla"].clone()
        got[k] = {m: held[m].clone() for m in ("lawa", "wsm", "swa", "power")}
    gamma, mu = edm2_gamma(st.sigma_rel), None
    for k in iterates:
        last = [iterates[j] for j in range(max(1, k - 4), k + 1)]
        c = megatron_coefficients("minus-sqrt", len(last))
        torch.testing.assert_close(got[k]["lawa"], sum(last) / len(last), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            got[k]["wsm"], sum(ci * x for ci, x in zip(c, last, strict=True)), rtol=1e-12, atol=1e-12
        )
        if k >= 7:
            mean = sum(iterates[j] for j in range(7, k + 1)) / (k - 6)
            torch.testing.assert_close(got[k]["swa"], mean, rtol=1e-12, atol=1e-12)
        w = 1.0 if k == 1 else 1 - ((k - 1) / k) ** (gamma + 1)
        mu = iterates[k] if mu is None else mu + w * (iterates[k] - mu)
        torch.testing.assert_close(got[k]["power"], mu, rtol=1e-9, atol=1e-12)
