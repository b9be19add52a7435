"""The stabilizer math, and nothing else: schedules and one-step updates.

Implements Algorithm 1 of Block & Zhang, "EMA Without the Lag" (BEMA), plus the
related stabilizers it is compared with. With w(s) = rho + gamma*s:

    beta_s  = min(1, max(w(s)**-kappa, beta_min))      # ema_weight
    alpha_s = w(s)**-eta                               # bias_weight
    ema    <- (1 - beta_s)*ema + beta_s*theta_s        # ema starts at theta0
    bema    = ema + alpha_s*(theta_s - theta0)

The same `Stabilizer` runs on one chunk of one weight tensor (`bema stabilize`)
and on a (trials, dim) batch of simulated trajectories (`bema simulate`): all
updates are elementwise, so shapes never matter. No I/O here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # tensors arrive from the caller; not importing torch keeps CLI errors instant
    import torch

from bema_cli.errors import UsageError

METHODS = ("vanilla", "ema", "bema", "dema", "ouema")
PRESETS = ("paper", "reference")
Action = Literal["burnin", "update", "skip"]

# The authors' offline evaluation code floors beta at 1e-4 and updates every 400 steps.
REFERENCE_BETA_MIN = 1e-4
REFERENCE_PHI = 400


@dataclass(frozen=True)
class Schedule:
    """Hyperparameters of one stabilizer run; defaults are the paper's language-model settings."""

    method: str = "bema"
    preset: str = "paper"
    kappa: float = 0.5  # EMA decay power: beta_s ~ s**-kappa (kappa=1 with rho=gamma=1: flat average)
    eta: float = 0.2  # bias-correction power: alpha_s ~ s**-eta; inf disables the correction
    gamma: float = 1.0  # step multiplier: w(s) = rho + gamma*s
    rho: float = 10.0  # lag offset: keeps the first weights from being ~1
    tau: int = 0  # burn-in: checkpoints with s <= tau restart the average from theta_s
    phi: int | None = None  # update cadence; None = every checkpoint (paper) / 400 (reference)
    beta_min: float | None = None  # floor on beta_s; None = 0 (paper) / 1e-4 (reference)

    def resolved(self) -> Schedule:
        """Fill preset-dependent defaults and validate; every caller goes through this."""
        if self.method not in METHODS:
            raise UsageError(f"--method: unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.preset not in PRESETS:
            raise UsageError(f"--preset: unknown preset {self.preset!r} (choose from {', '.join(PRESETS)})")
        reference = self.preset == "reference"
        s = replace(
            self,
            phi=self.phi if self.phi is not None else (REFERENCE_PHI if reference else None),
            beta_min=self.beta_min
            if self.beta_min is not None
            else (REFERENCE_BETA_MIN if reference else 0.0),
        )
        for name in ("kappa", "gamma", "beta_min"):
            value = getattr(s, name)
            if not math.isfinite(value) or value < 0:
                raise UsageError(f"--{name.replace('_', '-')}: must be a finite number >= 0, got {value}")
        if s.beta_min > 1:
            raise UsageError(f"--beta-min: must be <= 1, got {s.beta_min}")
        if math.isnan(s.eta) or s.eta < 0:
            raise UsageError(f"--eta: must be >= 0 (or inf), got {s.eta}")
        if not math.isfinite(s.rho):
            raise UsageError(f"--rho: must be finite, got {s.rho}")
        if s.tau < 0:
            raise UsageError(f"--tau: must be >= 0, got {s.tau}")
        if s.phi is not None and s.phi <= 0:
            raise UsageError(f"--phi: must be a positive number of steps, got {s.phi}")
        if s.method == "ouema" and s.eta == 0:
            raise UsageError(
                "--eta 0 with ouema: alpha_s = 1 makes (theta_s - alpha*theta0)/(1 - alpha) undefined"
            )
        return s

    # -- the two schedules ------------------------------------------------
    def _weight_base(self, step: int) -> tuple[float, float]:
        """(base of beta, base of alpha): both w(s) for `paper`; (1+gamma*t, 1+t) for `reference`."""
        if self.preset == "paper":
            w = self.rho + self.gamma * step
            if w <= 0:
                raise UsageError(
                    f"rho + gamma*s must be > 0, got {w} at step {step} (rho={self.rho}, gamma={self.gamma})"
                )
            return w, w
        t = max(step - self.tau + self.rho, 1.0)
        return 1.0 + self.gamma * t, 1.0 + t

    def ema_weight(self, step: int) -> float:
        """beta_s: the weight of theta_s in the EMA update."""
        base, _ = self._weight_base(step)
        beta_min = self.beta_min or 0.0
        return min(1.0, max(base**-self.kappa, beta_min))

    def bias_weight(self, step: int) -> float:
        """alpha_s: the weight of (theta_s - theta0) added back to the EMA; 0 when eta is inf."""
        if math.isinf(self.eta):
            return 0.0
        _, base = self._weight_base(step)
        return base**-self.eta

    # -- cadence ------------------------------------------------------------
    def plan(self, steps: list[int]) -> list[PlannedStep]:
        """What happens at each checkpoint step (sorted, unique): burn-in, update or skip."""
        s = self.resolved()
        events: list[PlannedStep] = []
        last_update: int | None = None
        for step in steps:
            if step <= s.tau:
                events.append(PlannedStep(step, "burnin", 0.0, 1.0))
                continue
            if s.preset == "paper":
                due = s.phi is None or (step - s.tau) % s.phi == 0
            else:  # reference: the first checkpoint after burn-in, then every >= phi steps
                due = last_update is None or step - last_update >= s.phi
            if not due:
                events.append(PlannedStep(step, "skip", math.nan, math.nan))
                continue
            last_update = step
            events.append(PlannedStep(step, "update", s.bias_weight(step), s.ema_weight(step)))
        return events


@dataclass(frozen=True)
class PlannedStep:
    step: int
    action: Action
    alpha: float  # bias_weight used at this step (nan when skipped)
    beta: float  # ema_weight used at this step (nan when skipped)


# The running tensors each method keeps besides theta0 (memory planning counts them).
STATE_TENSORS = {"vanilla": (), "ema": ("ema",), "bema": ("ema",), "dema": ("e1", "e2"), "ouema": ("ou",)}


class Stabilizer:
    """Running state of one method over one tensor (any shape; updates are elementwise).

    `advance` moves the state to a checkpoint (burn-in restarts it, theta0 = ema = ... =
    theta_s); `estimate` reads the stabilized weights there. They are split so a caller
    that writes only some steps (`--final-only`) pays for the cheap state update at every
    step and for the output only where it is written. Tensors are used in the caller's
    dtype and device (the accumulation dtype). theta0 is held by reference and never
    modified: the caller keeps it unchanged while the stabilizer lives.
    """

    def __init__(self, method: str, theta0: torch.Tensor, buffers: list | None = None):
        """`buffers`: optional storage for the state tensors (STATE_TENSORS order, theta0's shape),
        reused across calls so a streaming caller does not allocate (and page-fault) fresh ones."""
        if method not in METHODS:
            raise UsageError(f"unknown method {method!r}")
        self.method = method
        self.ema = self.e1 = self.e2 = self.ou = None
        for name, buffer in zip(STATE_TENSORS[method], buffers or (), strict=False):
            setattr(self, name, buffer)
        self.restart(theta0)

    def view(self, lo: int, hi: int) -> Stabilizer:
        """This state restricted to elements [lo, hi) of its (flat) tensors: updates through the view
        land in this state's storage. The engine walks a unit in cache-sized blocks this way."""
        part = object.__new__(Stabilizer)
        part.method, part.theta0 = self.method, self.theta0[lo:hi]
        for name in ("ema", "e1", "e2", "ou"):
            state = getattr(self, name)
            setattr(part, name, None if state is None else state[lo:hi])
        return part

    def restart(self, theta: torch.Tensor) -> torch.Tensor:
        """Burn-in: start over from theta (reusing the state's storage when the shape allows)."""
        self.theta0 = theta
        for name in STATE_TENSORS[self.method]:
            state = getattr(self, name)
            if state is not None and state.shape == theta.shape:
                state.copy_(theta)
            else:
                setattr(self, name, theta.clone())
        return theta

    def advance(self, event: PlannedStep, theta: torch.Tensor) -> None:
        """Apply one planned event to the state: restart, update with (alpha_s, beta_s), or nothing."""
        if event.action == "burnin":
            self.restart(theta)
        elif event.action == "update":
            beta = event.beta
            if self.method in ("ema", "bema"):
                self.ema.lerp_(theta, beta)  # ema = (1-beta)*ema + beta*theta
            elif self.method == "dema":
                self.e1.lerp_(theta, beta)
                self.e2.lerp_(self.e1, beta)
            elif (
                self.method == "ouema"
            ):  # average the debiased targets d = (theta - alpha*theta0)/(1 - alpha)
                debiased = (theta - event.alpha * self.theta0) / (1.0 - event.alpha)
                self.ou.lerp_(debiased, beta)

    def estimate(
        self,
        event: PlannedStep,
        theta: torch.Tensor,
        drift: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        method: str | None = None,
    ) -> torch.Tensor:
        """The stabilized weights after `advance(event, theta)`.

        `drift` = theta - theta0 may be passed in when several configs share it; `out` is
        optional storage for the result; `method` reads another method of the same state
        (ema and bema share one EMA, see `state_key`). The result may alias the state:
        use it before the next `advance`.
        """
        import torch  # already loaded by the caller that made the tensors

        method = method or self.method
        if STATE_TENSORS[method] != STATE_TENSORS[self.method]:
            raise ValueError(f"a {self.method} state cannot give a {method} estimate")
        if event.action == "burnin" or method == "vanilla":
            return theta
        if method == "ema":
            return self.ema
        if method == "bema":  # ema + alpha*(theta - theta0)
            drift = theta - self.theta0 if drift is None else drift
            return torch.add(self.ema, drift, alpha=event.alpha, out=out)
        if method == "dema":  # 2*e1 - e2
            return torch.sub(torch.mul(self.e1, 2, out=out), self.e2, out=out)
        return self.ou

    def apply(self, event: PlannedStep, theta: torch.Tensor) -> torch.Tensor | None:
        """advance + estimate in one call; None for a skipped step."""
        self.advance(event, theta)
        return None if event.action == "skip" else self.estimate(event, theta)


def state_key(s: Schedule) -> tuple:
    """Runs with equal keys walk identical state trajectories, so a grid keeps one state per key.

    ema and bema share their EMA (alpha_s only enters bema's output); ouema's state
    depends on alpha_s, hence on eta.
    """
    family = "ema" if s.method in ("ema", "bema") else s.method
    return (
        family,
        s.preset,
        s.kappa,
        s.gamma,
        s.rho,
        s.tau,
        s.phi,
        s.beta_min,
        s.eta if family == "ouema" else None,
    )


def run_name(s: Schedule) -> str:
    """Output folder name of a run: bema-k0.5-e0.2, ema-k0.5, dema-k0.5, ouema-k0.5-e0.2, vanilla."""
    if s.method == "vanilla":
        return "vanilla"
    if s.method in ("ema", "dema"):
        return f"{s.method}-k{s.kappa!r}"
    eta = "inf" if math.isinf(s.eta) else repr(s.eta)
    return f"{s.method}-k{s.kappa!r}-e{eta}"
