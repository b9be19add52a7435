"""The stabilizer math on tensors, and nothing else: one-step updates of every method.

Implements Algorithm 1 of Block & Zhang, "EMA Without the Lag" (BEMA,
https://arxiv.org/abs/2508.00180), plus the related stabilizers it is compared with, with the
weights of schedule.py (beta_s = ema_weight, alpha_s = bias_weight):

    ema    <- (1 - beta_s)*ema + beta_s*theta_s        # ema starts at theta0
    bema    = ema + alpha_s*(theta_s - theta0)

The same `Stabilizer` runs on one chunk of one weight tensor (`bema stabilize`, `bema sweep`)
and on a (trials, dim) batch of simulated trajectories (`bema simulate`): all updates are
elementwise, so shapes never matter. No I/O here.

Beside them, the averages that read a trajectory's checkpoints with fixed weights
(docs/math.md has each formula and its source), a `Window` over the last K members:

    lawa   the uniform mean of the last K checkpoints (Kaddour 2022, fairseq average_checkpoints)
    wsm    Megatron-LM weighted_merge coefficients over the last K (WSM, arXiv 2507.17634)

and, as running means in `Stabilizer`:

    swa    the equal-weight running mean from a start step (torch.optim.swa_utils.AveragedModel)
    power  the power-function EMA of Karras et al. 2024 (EDM2, arXiv 2312.02696)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensors arrive from the caller; not importing torch keeps CLI errors instant
    import torch

from bema_cli.errors import UsageError
from bema_cli.schedule import METHODS, WINDOW_METHODS, PlannedStep, Schedule, merge_coefficients

# methods whose `estimate` is a new tensor, not a view of a state (the fused pass and the walk
# compute it straight into a buffer of their own)
BUFFERED = ("bema", "dema", *WINDOW_METHODS)


class Window:
    """The last K-1 members of a trajectory in a ring of slots (member j lives in slot j % len(slots)),
    and the merges of lawa and wsm over them and the current checkpoint.

    `estimate` must come before `advance` at a step: the merge of a full window still needs the
    oldest slice, which `advance` then overwrites with theta_s. A `view` shares the ring's storage.
    """

    def __init__(self, slots: list):
        self.slots = slots

    def view(self, lo: int, hi: int) -> Window:
        return Window([t[lo:hi] for t in self.slots])

    def advance(self, event: PlannedStep, theta: torch.Tensor) -> None:
        if event.action == "update" and self.slots:
            self.slots[event.member % len(self.slots)].copy_(theta)

    def estimate(self, event: PlannedStep, theta: torch.Tensor, schedule: Schedule, out=None) -> torch.Tensor:
        """sum_i c_i theta_i over the last n = min(K, members so far) members, oldest first."""
        import torch

        if event.action == "burnin":
            return theta
        n = min(schedule.window, event.member)
        coefficients = merge_coefficients(schedule.merge_schedule, n)
        members = [self.slots[j % len(self.slots)] for j in range(event.member - n + 1, event.member)]
        members.append(theta)
        first = members[0].to(theta.dtype)  # slots may be held narrower (exact); the sum is in theta's dtype
        out = torch.mul(first, coefficients[0], out=out)
        for c, member in zip(coefficients[1:], members[1:], strict=True):
            out.add_(member, alpha=c)
        return out

    def apply(self, event: PlannedStep, theta: torch.Tensor, schedule: Schedule) -> torch.Tensor | None:
        """estimate + advance in one call (Stabilizer.apply's order reversed: see the class); None
        for a skipped step. The result is a new tensor."""
        if event.action == "skip":
            return None
        out = self.estimate(event, theta, schedule)
        out = out.clone() if out is theta else out
        self.advance(event, theta)
        return out


STATE_TENSORS = {
    "vanilla": (),
    "ema": ("ema",),
    "bema": ("ema",),
    "dema": ("e1", "e2"),
    "ouema": ("ou",),
    "swa": ("avg",),
    "power": ("avg",),
    "lawa": (),
    "wsm": (),  # a window's ring is sized by K: Window
}


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
        self.ema = self.e1 = self.e2 = self.ou = self.avg = None
        for name, buffer in zip(STATE_TENSORS[method], buffers or (), strict=False):
            setattr(self, name, buffer)
        self.restart(theta0)

    def view(self, lo: int, hi: int) -> Stabilizer:
        """This state restricted to elements [lo, hi) of its (flat) tensors: updates through the view
        land in this state's storage. The engine walks a unit in cache-sized blocks this way."""
        part = object.__new__(Stabilizer)
        part.method = self.method
        part.theta0 = None if self.theta0 is None else self.theta0[lo:hi]  # None: the caller passes it
        for name in ("ema", "e1", "e2", "ou", "avg"):
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
            elif self.method in ("swa", "power"):  # mu = mu + beta*(theta - mu), beta 1/n or power_weight
                self.avg.lerp_(theta, beta)

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
        if method in ("swa", "power"):
            return self.avg
        return self.ou

    def apply(self, event: PlannedStep, theta: torch.Tensor) -> torch.Tensor | None:
        """advance + estimate in one call; None for a skipped step."""
        self.advance(event, theta)
        return None if event.action == "skip" else self.estimate(event, theta)


def update(states: list, lo: int, hi: int, theta: torch.Tensor, theta0: torch.Tensor | None = None) -> None:
    """One step of every state that takes it, on positions [lo, hi) (`states`: (Stabilizer or Window,
    its PlannedStep) pairs; `theta`, `theta0`: those positions of theta_s and theta0). A burn-in
    restarts a state at theta0 (the caller has set theta0 = theta_s); ouema's update reads theta0.
    stabilize's fused pass, the sweep's walk and the coefficient vectors all step through here."""
    for state, event in states:
        part = state.view(lo, hi)
        if theta0 is not None and isinstance(part, Stabilizer):
            part.theta0 = theta0
        part.advance(event, theta0 if event.action == "burnin" else theta)


def estimate(part, schedule: Schedule, event: PlannedStep, theta: torch.Tensor, drift=None, out=None):
    """One config's output at `event` from its state `part` (a Stabilizer or Window view) and theta_s;
    `drift` = theta_s - theta0 (bema; shared by the configs of a step), `out` storage for a method
    that computes a new tensor."""
    if schedule.method in ("lawa", "wsm"):
        return part.estimate(event, theta, schedule, out=out)
    return part.estimate(event, theta, drift=drift, out=out, method=schedule.method)


def needs_drift(schedule: Schedule, event: PlannedStep) -> bool:
    """Whether this config's output at `event` reads theta_s - theta0 (bema's correction)."""
    return schedule.method == "bema" and event.action == "update"
