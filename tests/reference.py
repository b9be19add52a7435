"""A deliberately plain float64 reference of the stabilizers, written from issue 2's pseudocode.

Independent of bema_cli.recurrence on purpose: full model state held in float64, one
explicit loop over checkpoints, every formula spelled out. Tests compare `bema stabilize`
and recurrence.py against it.
"""

from __future__ import annotations

import math

import torch


def weights(step, preset, kappa, eta, gamma, rho, tau, beta_min):
    """(alpha_s, beta_s) of one processed step."""
    if preset == "paper":
        w = rho + gamma * step
        beta = min(1.0, max(w**-kappa, beta_min))
        alpha = 0.0 if math.isinf(eta) else w**-eta
    else:  # reference: the authors' offline evaluation code
        t = max(step - tau + rho, 1)
        beta = max((1 + gamma * t) ** -kappa, beta_min)
        alpha = 0.0 if math.isinf(eta) else (1 + t) ** -eta
    return alpha, beta


def reference(
    theta0: dict,
    trajectory: list[tuple[int, dict]],
    method: str,
    preset: str = "paper",
    kappa: float = 0.5,
    eta: float = 0.2,
    gamma: float = 1.0,
    rho: float = 10.0,
    tau: int = 0,
    phi: int | None = None,
    beta_min: float | None = None,
) -> dict[int, dict]:
    """{step: {name: float64 tensor}} for every output step (burn-in and processed steps).

    Non-floating tensors are copied from theta_s.
    """
    if preset == "reference":
        phi = 400 if phi is None else phi
        beta_min = 1e-4 if beta_min is None else beta_min
    beta_min = beta_min or 0.0
    floats = [k for k, v in theta0.items() if v.is_floating_point()]
    th0 = {k: theta0[k].double() for k in floats}
    ema = dict(th0)
    e1 = dict(th0)
    e2 = dict(th0)
    ou = dict(th0)
    last = None
    outputs = {}
    for step, state in trajectory:
        theta = {k: state[k].double() for k in floats}
        copied = {k: v.clone() for k, v in state.items() if not v.is_floating_point()}
        if step <= tau:  # burn-in: restart everything from theta_s
            th0 = dict(theta)
            ema, e1, e2, ou = dict(theta), dict(theta), dict(theta), dict(theta)
            outputs[step] = {**theta, **copied}
            continue
        if preset == "paper":
            if phi is not None and (step - tau) % phi != 0:
                continue
        elif last is not None and step - last < phi:
            continue
        last = step
        alpha, beta = weights(step, preset, kappa, eta, gamma, rho, tau, beta_min)
        out = {}
        for k in floats:
            if method == "vanilla":
                out[k] = theta[k]
            elif method in ("ema", "bema"):
                ema[k] = (1 - beta) * ema[k] + beta * theta[k]
                out[k] = ema[k] + alpha * (theta[k] - th0[k]) if method == "bema" else ema[k]
            elif method == "dema":
                e1[k] = (1 - beta) * e1[k] + beta * theta[k]
                e2[k] = (1 - beta) * e2[k] + beta * e1[k]
                out[k] = 2 * e1[k] - e2[k]
            elif method == "ouema":
                d = (theta[k] - alpha * th0[k]) / (1 - alpha)
                ou[k] = (1 - beta) * ou[k] + beta * d
                out[k] = ou[k]
            else:
                raise ValueError(method)
        outputs[step] = {**out, **copied}
    return outputs


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |x| (float64), floored at the dtype's smallest subnormal step."""
    info = torch.finfo(dtype)
    mag = x.double().abs().clamp_min(info.tiny)
    return torch.maximum(
        torch.exp2(torch.floor(torch.log2(mag))) * info.eps, torch.tensor(info.tiny * info.eps)
    )


# -- the window and schedule-weighted averages, from issue 21's formulas (not from recurrence.py) --
DECAY = {
    "linear": lambda x: 1 - x,
    "minus-sqrt": lambda x: 1 - math.sqrt(x),
    "cosine": lambda x: (1 + math.cos(math.pi * x)) / 2,
}


def megatron_coefficients(schedule: str, n: int) -> list[float]:
    """Megatron-LM weighted_merge: d_i = g(i/n); c_(n-1) = d_(n-1); c_i = d_i - d_(i+1) (0 < i < n-1);
    c_0 = 1 - sum of the others; oldest first. ':reverse' reverses the list."""
    name, _, variant = schedule.partition(":")
    d = [DECAY[name](i / n) for i in range(n)]
    c = [0.0] * n
    c[n - 1] = d[n - 1]
    for i in range(1, n - 1):
        c[i] = d[i] - d[i + 1]
    c[0] = 1 - sum(c[1:])
    return c[::-1] if variant == "reverse" else c


def edm2_gamma(sigma_rel: float) -> float:
    """EDM2 Algorithm 2's gamma for sigma_rel: the largest real root of the cubic it solves."""
    import numpy as np

    t = sigma_rel**-2
    return float(np.roots([1, 7, 16 - t, 12 - t]).real.max())


def members_of(trajectory, tau: int = 0, phi: int | None = None, swa_start: int | None = None) -> list[int]:
    """The steps that are members (after burn-in, on the paper cadence, from swa_start)."""
    return [
        s
        for s, _ in trajectory
        if s > tau and (phi is None or (s - tau) % phi == 0) and (swa_start is None or s >= swa_start)
    ]


def window_reference(
    trajectory: list[tuple[int, dict]],
    method: str,
    window: int = 8,
    schedule: str = "linear",
    swa_start: int | None = None,
    power_gamma: float | None = None,
    tau: int = 0,
    phi: int | None = None,
) -> dict[int, dict]:
    """{step: {name: float64 tensor}} of lawa, wsm, swa or power at each written step.

    Burn-in steps (s <= tau) output theta_s. lawa/wsm: sum_i c_i theta_i over the last
    min(K, members so far) members; swa: the plain mean of the members so far; power:
    mu_k = mu_(k-1) + (1 - (s_(k-1)/s_k)**(gamma+1)) (theta_k - mu_(k-1)) with s_0 = 0.
    """
    floats = [k for k, v in trajectory[0][1].items() if v.is_floating_point()]
    members = members_of(trajectory, tau, phi, swa_start if method == "swa" else None)
    states = {s: {k: v[k].double() for k in floats} for s, v in trajectory}
    outputs = {}
    mu, previous = None, 0
    for step, state in trajectory:
        copied = {k: v.clone() for k, v in state.items() if not v.is_floating_point()}
        if step <= tau and not (method == "swa" and swa_start is not None and step < swa_start):
            outputs[step] = {**states[step], **copied}
            continue
        if step not in members:
            continue
        so_far = [m for m in members if m <= step]
        if method in ("lawa", "wsm"):
            last = so_far[-window:]
            c = megatron_coefficients("linear" if method == "lawa" else schedule, len(last))
            out = {k: sum(ci * states[m][k] for ci, m in zip(c, last, strict=True)) for k in floats}
        elif method == "swa":
            out = {k: sum(states[m][k] for m in so_far) / len(so_far) for k in floats}
        elif method == "power":
            w = 1.0 if previous == 0 else 1 - (previous / step) ** (power_gamma + 1)
            mu = {
                k: states[step][k].clone() if mu is None else mu[k] + w * (states[step][k] - mu[k])
                for k in floats
            }
            previous = step
            out = dict(mu)
        else:
            raise ValueError(method)
        outputs[step] = {**out, **copied}
    return outputs
