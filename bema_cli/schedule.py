"""What a stabilizer run is: its hyperparameters (`Schedule`), the plan of which checkpoints
update it and with which weights (`PlannedStep`: beta_s, alpha_s, a window's members), the
weights of the power-function EMA and of WSM's merges, and the names and state keys of runs.
Pure Python floats; the arithmetic on tensors is recurrence.py's.

With w(s) = rho + gamma*s:

    beta_s  = min(1, max(w(s)**-kappa, beta_min))      # ema_weight
    alpha_s = w(s)**-eta                               # bias_weight

The members of a window or mean are the checkpoints the cadence keeps (`update` events);
theta0 never is one.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from bema_cli.errors import UsageError

METHODS = ("vanilla", "ema", "bema", "dema", "ouema", "lawa", "wsm", "swa", "power")
EMA_FAMILY = ("ema", "bema", "dema", "ouema")  # the paper's stabilizers: kappa/eta/gamma/rho/beta_min
WINDOW_METHODS = ("lawa", "wsm")  # merges of the last K members, read from a ring of K-1 slices
DECAYS = (
    "linear",
    "minus-sqrt",
    "cosine",
)  # wsm's decay functions g on [0, 1]; "<name>:reverse", ":scrambled-<seed>" too
PRESETS = ("paper", "reference")
Action = Literal["burnin", "update", "skip"]

# The authors' offline evaluation code floors beta at 1e-4 and updates every 400 steps.
REFERENCE_BETA_MIN = 1e-4
REFERENCE_PHI = 400


EMA_LIKE = (*EMA_FAMILY, "vanilla")  # the methods whose records carry the paper's parameters


def param(default, used_by=METHODS, swept_by=(), record=None, unswept=None, alone=False):
    """A Schedule field and what the rest of bema derives from it: the methods whose records carry it
    (`used_by`: Schedule.params), those a grid sweeps it for (`swept_by`: --kappa 0.5,0.9, a grid
    config's per-method keys), its name in records and on the command line (`record`, else the
    field's), the value a method that records it without sweeping it gets (`unswept`: ema's eta is
    inf, no correction), and whether the grid takes its values one config each (`alone`: power's
    sigma_rel and power_gamma set the same exponent) rather than crossing them with the others."""
    meta = {"used_by": used_by, "swept_by": swept_by, "record": record, "unswept": unswept, "alone": alone}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Schedule:
    """Hyperparameters of one stabilizer run; defaults are the paper's language-model settings. Each
    field's `param` says which methods use it and which a grid sweeps it for: the one list."""

    method: str = "bema"
    preset: str = param("paper")
    # EMA decay power: beta_s ~ s**-kappa (kappa=1 with rho=gamma=1: flat average)
    kappa: float = param(0.5, EMA_LIKE, EMA_FAMILY)
    # bias-correction power: alpha_s ~ s**-eta; inf disables the correction
    eta: float = param(0.2, EMA_LIKE, ("bema", "ouema"), unswept=math.inf)
    gamma: float = param(1.0, EMA_LIKE)  # step multiplier: w(s) = rho + gamma*s
    rho: float = param(10.0, EMA_LIKE)  # lag offset: keeps the first weights from being ~1
    tau: int = param(0)  # burn-in: checkpoints with s <= tau restart the average from theta_s
    phi: int | None = param(None)  # update cadence; None = every checkpoint (paper) / 400 (reference)
    beta_min: float | None = param(None, EMA_LIKE)  # floor on beta_s; None = 0 (paper) / 1e-4 (reference)
    # lawa/wsm: K, the checkpoints merged at each step
    window: int | None = param(None, WINDOW_METHODS, WINDOW_METHODS)
    # wsm: the decay g (records' "schedule"); None = minus-sqrt (lawa: linear)
    merge_schedule: str | None = param(None, ("wsm",), ("wsm",), record="schedule")
    # swa: the first step averaged; None = the first checkpoint
    swa_start: int | None = param(None, ("swa",), ("swa",))
    # power: EDM2's relative width, sets power_gamma
    sigma_rel: float | None = param(None, ("power",), ("power",), alone=True)
    # power: the exponent; None = from sigma_rel (0.05 when neither)
    power_gamma: float | None = param(None, ("power",), ("power",), alone=True)

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
        return _resolve_own(s)

    @classmethod
    def from_record(cls, record: dict) -> Schedule:
        """The schedule a record's stabilizer settings describe (bema.json, an eval record), as the
        command line would give it: every field under its record name (RECORD_NAMES), "inf" read as
        a number; power_gamma dropped where sigma_rel sets it. Not resolved."""
        given = {f.name: record.get(RECORD_NAMES[f.name]) for f in fields(cls)}
        params = {k: float(v) if v in ("inf", "-inf") else v for k, v in given.items() if v is not None}
        if params.get("sigma_rel") is not None:
            params.pop("power_gamma", None)  # derived from sigma_rel, as on the command line
        return cls(**params)

    def params(self) -> dict:
        """The hyperparameters this method uses, keyed as bema.json and --json records name them."""
        return {RECORD_NAMES[n]: getattr(self, n) for n in used_by(self.method)}

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
        """What happens at each checkpoint step (sorted, unique): burn-in, update or skip.

        An update is a member of the trajectory (`member` counts them from 1): the EMA family
        weighs it with (alpha_s, beta_s); swa and power with their own beta; lawa and wsm merge
        the last K members. swa skips the steps before --swa-start.
        """
        s = self.resolved()
        events: list[PlannedStep] = []
        last_update: int | None = None
        members = 0
        for step in steps:
            if s.method == "swa" and s.swa_start is not None and step < s.swa_start:
                events.append(PlannedStep(step, "skip", math.nan, math.nan))  # swa's outputs start at S
                continue
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
            previous, last_update = last_update, step
            members += 1
            if s.method in EMA_LIKE:
                alpha, beta = s.bias_weight(step), s.ema_weight(step)
            elif s.method == "swa":  # the running mean: mu_n = mu_(n-1) + (theta_n - mu_(n-1)) / n
                alpha, beta = math.nan, 1.0 / members
            elif s.method == "power":
                alpha, beta = math.nan, power_weight(previous if members > 1 else 0, step, s.power_gamma)
            else:  # lawa, wsm: no running state, a merge of the last K members
                alpha, beta = math.nan, math.nan
            events.append(PlannedStep(step, "update", alpha, beta, members))
        return events


@dataclass(frozen=True)
class PlannedStep:
    step: int
    action: Action
    alpha: float  # bias_weight used at this step (nan when skipped)
    beta: float  # ema_weight used at this step (nan when skipped)
    member: int = 0  # updates so far, this one included (the ring slot of a window method)


def _resolve_own(s: Schedule) -> Schedule:
    """Defaults and checks of the window, swa and power parameters (those of other methods: None)."""
    window = s.window if s.method in WINDOW_METHODS else None
    if s.method in WINDOW_METHODS:
        window = 8 if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UsageError(f"--window: must be a whole number of checkpoints >= 1, got {window}")
    # lawa is wsm's linear schedule (uniform weights); wsm defaults to WSM's minus-sqrt
    decay = {"lawa": "linear", "wsm": s.merge_schedule or "minus-sqrt"}.get(s.method)
    if decay is not None:
        merge_coefficients(decay, 1)  # an unknown name is refused here
    swa_start = s.swa_start if s.method == "swa" else None
    if swa_start is not None and swa_start < 0:
        raise UsageError(f"--swa-start: must be a step >= 0, got {swa_start}")
    sigma_rel = power_gamma = None
    if s.method == "power":
        sigma_rel, power_gamma = s.sigma_rel, s.power_gamma
        if sigma_rel is None and power_gamma is None:
            sigma_rel = 0.05
        if sigma_rel is not None:
            power_gamma = sigma_rel_to_gamma(sigma_rel)
        elif not math.isfinite(power_gamma) or power_gamma <= -1:
            raise UsageError(f"--power-gamma: must be a finite number > -1, got {power_gamma}")
    return replace(
        s,
        window=window,
        merge_schedule=decay,
        swa_start=swa_start,
        sigma_rel=sigma_rel,
        power_gamma=power_gamma,
    )


# -- the power-function EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics
#    of Diffusion Models", Algorithm 2: https://arxiv.org/abs/2312.02696) ----------------------
def power_weight(previous: int, step: int, gamma: float) -> float:
    """1 - (s_(k-1)/s_k)**(gamma+1): the weight of theta_k in the update mu_k = lerp(mu_(k-1), theta_k, .).
    With every step saved this is EDM2's beta_t = (1 - 1/t)**(gamma+1); a saved checkpoint stands
    for its interval. s_0 = 0, so the first member is taken whole."""
    if previous <= 0 or step <= 0:
        return 1.0
    return 1.0 - (previous / step) ** (gamma + 1.0)


def _width(gamma: float) -> float:
    """EDM2's sigma_rel of exponent gamma: sqrt((gamma+1) / ((gamma+2)**2 (gamma+3)))."""
    return math.sqrt((gamma + 1.0) / ((gamma + 2.0) ** 2 * (gamma + 3.0)))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent gamma with relative width sigma_rel, on the branch where the width falls as gamma
    grows (the root EDM2 and ema-pytorch take), by bisection: no polynomial solver needed."""
    lo, hi = -0.5, 0.0  # the width peaks where d/dg log(width) = 1/(g+1) - 2/(g+2) - 1/(g+3) is 0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 / (mid + 1) - 2 / (mid + 2) - 1 / (mid + 3) > 0 else (lo, mid)
    peak = _width(lo)
    if isinstance(sigma_rel, bool) or not (0 < sigma_rel < peak):  # NaN fails both comparisons
        raise UsageError(f"--sigma-rel: must be in (0, {peak:.4f}), got {sigma_rel}")
    hi = 1.0
    while _width(hi) > sigma_rel:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _width(mid) > sigma_rel else (lo, mid)
    return (lo + hi) / 2


# -- window merges (Megatron-LM tools/checkpoint/weighted_merge.py: linear, minus-sqrt; cosine is
#    bema's, the same rule with WSM's cosine decay shape) ------------------------------------------
_DECAY = {
    "linear": lambda x: 1.0 - x,  # uniform weights: LAWA
    "minus-sqrt": lambda x: 1.0 - math.sqrt(x),  # WSM's best (arXiv 2507.17634)
    "cosine": lambda x: (1.0 + math.cos(math.pi * x)) / 2.0,
}


def merge_coefficients(schedule: str, n: int) -> list[float]:
    """The weights of n checkpoints, oldest first, from a decay g: d_i = g(i/n); c_(n-1) = d_(n-1);
    c_i = d_i - d_(i+1) for 0 < i < n-1; c_0 = 1 - the others. The ablation controls of Megatron-LM's
    merge tool: `<g>:reverse` reverses them, `<g>:scrambled-<seed>` permutes them (seeded by the seed
    and n: the same permutation on every machine and in every call)."""
    name, _, variant = schedule.partition(":")
    scrambled = re.fullmatch(r"scrambled-(\d+)", variant)
    if name not in _DECAY or not (variant in ("", "reverse") or scrambled):
        choices = ", ".join(DECAYS)
        raise UsageError(
            f"--schedule: unknown schedule {schedule!r} (choose from {choices}, each with :reverse or "
            ":scrambled-<seed>)"
        )
    g = _DECAY[name]
    d = [g(i / n) for i in range(n)]
    c = [d[i] - d[i + 1] for i in range(n - 1)] + [d[n - 1]]
    c[0] = 1.0 - sum(c[1:])
    if scrambled:
        order = list(range(n))
        random.Random(f"bema-scrambled:{scrambled.group(1)}:{n}").shuffle(order)
        return [c[i] for i in order]
    return c[::-1] if variant else c


def last_members(events: dict[int, PlannedStep], step: int | None, count: int) -> list[int]:
    """The steps of the last `count` members at or before `step`, oldest first: what a window merge
    at `step` reads (count K), or what a window's ring holds after it (count K-1)."""
    if step is None or count <= 0:
        return []
    members = sorted(e.step for e in events.values() if e.action == "update" and e.step <= step)
    return members[-count:]


# The running tensors each method keeps besides theta0 (memory planning counts them).
def state_key(s: Schedule) -> tuple:
    """Runs with equal keys walk identical state trajectories, so a grid keeps one state per key.

    ema and bema share their EMA (alpha_s only enters bema's output); ouema's state
    depends on alpha_s, hence on eta.
    """
    if s.method in WINDOW_METHODS:  # one ring serves every window: members depend on the cadence only
        return ("window", s.preset, s.tau, s.phi)
    if s.method in ("swa", "power"):
        return (s.method, s.preset, s.tau, s.phi, s.swa_start, s.power_gamma)
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
    if s.method == "lawa":
        return f"lawa-w{s.window}"
    if s.method == "wsm":
        return f"wsm-{s.merge_schedule.replace('-', '_').replace(':', '_')}-w{s.window}"
    if s.method == "swa":
        return "swa" if s.swa_start is None else f"swa-s{s.swa_start}"
    if s.method == "power":
        return f"power-sr{s.sigma_rel!r}" if s.sigma_rel is not None else f"power-g{s.power_gamma!r}"
    if s.method in ("ema", "dema"):
        return f"{s.method}-k{s.kappa!r}"
    eta = "inf" if math.isinf(s.eta) else repr(s.eta)
    return f"{s.method}-k{s.kappa!r}-e{eta}"


# Derived from Schedule's fields and their `param`s, the one list of a stabilizer's parameters (eval
# targets, provenance checks, records, the grid and its flags read them from here):
# each field's name in records and on the command line (wsm's decay is "schedule")
RECORD_NAMES = {f.name: f.metadata.get("record") or f.name for f in fields(Schedule)}
DEFAULTS = {f.name: f.default for f in fields(Schedule)}  # each field's default: the flags' too
RECORD_KEYS = tuple(RECORD_NAMES.values())
NUMBER_KEYS = tuple(k for k in RECORD_KEYS if k not in ("method", "preset", "schedule"))
# the grid's axes (each swept per method: --kappa 0.5,0.9), and the settings every config shares
AXES = tuple(f.name for f in fields(Schedule) if f.metadata.get("swept_by"))
SHARED = tuple(f.name for f in fields(Schedule) if f.metadata and not f.metadata["swept_by"])


def used_by(method: str) -> tuple[str, ...]:
    """The fields a method's records carry (method first)."""
    return tuple(f.name for f in fields(Schedule) if not f.metadata or method in f.metadata["used_by"])


def swept_by(method: str) -> tuple[str, ...]:
    """The axes a grid sweeps for a method."""
    return tuple(n for n in AXES if method in meta(n)["swept_by"])


def meta(name: str) -> dict:
    """A Schedule field's `param`."""
    return next(f.metadata for f in fields(Schedule) if f.name == name)
