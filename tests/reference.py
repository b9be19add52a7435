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
