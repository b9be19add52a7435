"""The paper's noisy-quadratic experiment (Block & Zhang, Fig. 1a and Fig. 2).

SGD with Gaussian gradient noise on f(theta) = 1/2 (theta - mu)^T A (theta - mu):

    theta_{k+1} = theta_k - lr * (A (theta_k - mu) + sigma * xi_k),   xi_k ~ N(0, I)

run for `trials` independent trajectories at once as a (trials, dim) float64 tensor.
The estimators are computed online with THE SAME `schedule.Schedule.plan` and
`recurrence.Stabilizer` that `bema stabilize` runs on weight tensors: the iterate after
k SGD steps is checkpoint step s = k, theta0 (the start) is the base weights. Plus `mle`,
the maximum-likelihood estimate of mu with A known (the paper's lower-bound estimator):

    mle_k = A^{-1} (theta_k - theta_0) / T + (1/k) sum_{j<k} theta_j,   T = lr * k

which is exactly mu - A^{-1} sigma mean(xi): its expected error equals the Cramer-Rao-type
bound lr sigma^2 tr(A^{-2}) / T. A is diagonal (its eigenbasis; the noise is isotropic,
so nothing is lost), mu = 0 and theta0 = distance/sqrt(dim) * (1, ..., 1).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where the simulation runs: a bad flag is refused before torch loads
    import torch

import numpy as np

from bema_cli import __version__
from bema_cli.errors import UsageError
from bema_cli.recurrence import Stabilizer, Window
from bema_cli.schedule import METHODS, WINDOW_METHODS, Schedule

ESTIMATORS = (*METHODS, "mle")
DTYPE = "float64"  # torch's dtype of every tensor here
# Memory a run needs, for the up-front check (measured on CPython 3.12 / torch float64):
STATE_TENSORS = 6  # (trials, dim) tensors besides the estimators': theta0, theta, running sum, temporaries
TENSORS_PER_ESTIMATOR = 6  # its Stabilizer's running averages (up to 4), the held output, a temporary
BYTES_PER_STEP = 400  # per estimator and SGD step: one planned schedule entry (~190 B) + list slots, 2-D path
NOISE_BLOCK = 2**21  # normals drawn per torch.randn call (16 MiB of float64): few calls, bounded memory
MAX_SCALE = 1e100  # --sigma, --distance: their squares times lr**2 and the step count stay far inside float64


@dataclass(frozen=True)
class SimSettings:
    """Every flag of `bema simulate`. Stabilizer defaults are the paper's theory regime, not the LM ones."""

    dim: int = 20
    lr: float = 0.05
    sigma: float = 1.0
    steps: int = 1000
    trials: int = 1000
    spectrum: str = "ones"  # eigenvalues of A: ones | linspace:LO:HI | geomspace:LO:HI | a1,a2,...
    distance: float = 10.0  # |theta0 - mu|
    seed: int = 0
    record_every: int = 10
    methods: tuple[str, ...] = ESTIMATORS
    kappa: float = 1.0  # with rho = gamma = 1: beta_s = 1/(1+s), EMA = flat average of theta_0..theta_s
    eta: float = 0.5  # strong correction; the LM default 0.2 (with kappa 0.5, rho 10) overshoots here
    gamma: float = 1.0
    rho: float = 1.0
    tau: int = 0
    phi: int | None = None
    preset: str = "paper"
    beta_min: float | None = None
    window: int = 100  # lawa, wsm: the last K iterates (every SGD step is a checkpoint here)
    merge_schedule: str = "minus-sqrt"  # wsm's decay
    swa_start: int | None = None  # swa: from this step (None: the first)
    sigma_rel: float = 0.05  # power: EDM2's relative width

    def schedule(self, method: str) -> Schedule:
        """The Schedule of one estimator, resolved: the same object `bema stabilize` builds per run."""
        names = {f.name for f in fields(Schedule)}  # kappa ... sigma_rel: a Schedule's own fields
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}
        return Schedule(method=method, **given).resolved()

    def validated(self) -> SimSettings:
        """Check every flag (one-line UsageErrors naming it); returns self with methods de-duplicated."""
        checks = [
            (self.dim >= 1, "--dim", "must be >= 1", self.dim),
            (self.lr > 0 and math.isfinite(self.lr), "--lr", "must be a finite number > 0", self.lr),
            (
                0 <= self.sigma <= MAX_SCALE,
                "--sigma",
                f"must be a number in [0, {MAX_SCALE:g}] (squared errors must stay inside float64)",
                self.sigma,
            ),
            (self.steps >= 1, "--steps", "must be >= 1", self.steps),
            (self.trials >= 1, "--trials", "must be >= 1", self.trials),
            (
                0 <= self.distance <= MAX_SCALE,
                "--distance",
                f"must be a number in [0, {MAX_SCALE:g}]",
                self.distance,
            ),
            (self.record_every >= 1, "--record-every", "must be >= 1", self.record_every),
        ]
        for ok, flag, what, value in checks:
            if not ok:
                raise UsageError(f"{flag}: {what}, got {value}")
        methods = tuple(dict.fromkeys(self.methods))
        ring = (self.window - 1) * len(set(methods) & set(WINDOW_METHODS)) if self.window >= 1 else 0
        check_memory(self.dim, self.trials, self.steps, len(methods), extra_tensors=ring)
        unknown = [m for m in methods if m not in ESTIMATORS]
        if unknown or not methods:
            raise UsageError(
                f"--methods: unknown {unknown or 'empty list'} (choose from {', '.join(ESTIMATORS)})"
            )
        for method in methods:
            if method != "mle":
                self.schedule(method)
        eig = parse_spectrum(self.spectrum, self.dim)
        if self.lr * float(eig.max()) >= 2:
            raise UsageError(f"--lr: lr * max eigenvalue = {self.lr * float(eig.max()):g} >= 2, SGD diverges")
        return replace(self, methods=methods)


def physical_memory() -> int | None:
    """Bytes of RAM of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(
    dim: int, trials: int, steps: int, estimators: int, available: int | None = None, extra_tensors: int = 0
) -> None:
    """Refuse, before allocating anything, a run whose arrays cannot fit in this machine's memory.

    Computed from the sizes (float64 (trials, dim) tensors, per-step schedules), not by catching
    MemoryError: a huge allocation may succeed lazily and the machine then swaps or the OOM killer ends
    the process, and numpy/torch raise different errors (or a traceback) for the ones that fail.
    """
    available = physical_memory() if available is None else available
    if available is None:
        return
    tensors = 8 * dim * (trials * (STATE_TENSORS + TENSORS_PER_ESTIMATOR * estimators + extra_tensors) + 1)
    schedules = BYTES_PER_STEP * steps * max(estimators, 1)
    if tensors + schedules <= available:
        return
    gib = 2**30
    if tensors >= schedules:
        what = f"--dim {dim} x --trials {trials}: {tensors / gib:.3g} GiB of float64 trajectories"
    else:
        what = f"--steps {steps}: {schedules / gib:.3g} GiB of per-step schedules"
    raise UsageError(
        f"{what} for {estimators} estimator(s), more than this machine's {available / gib:.3g} GiB of memory"
    )


def parse_spectrum(spec: str, dim: int) -> np.ndarray:
    """Eigenvalues of A (all > 0): 'ones', 'linspace:LO:HI', 'geomspace:LO:HI' or an explicit comma list."""
    text = spec.strip().lower()
    try:
        if text == "ones":
            eig = np.ones(dim)
        elif text.startswith(("linspace:", "geomspace:")):
            kind, lo, hi = text.split(":")
            eig = (np.linspace if kind == "linspace" else np.geomspace)(float(lo), float(hi), dim)
        else:
            eig = np.array([float(v) for v in text.split(",")])
    except ValueError:
        raise UsageError(
            f"--spectrum: cannot parse {spec!r} (ones, linspace:LO:HI, geomspace:LO:HI, or a1,a2,...)"
        ) from None
    if eig.shape != (dim,):
        raise UsageError(f"--spectrum: {spec!r} gives {eig.size} eigenvalues, --dim is {dim}")
    if not np.all(np.isfinite(eig)) or np.any(eig <= 0):
        raise UsageError(
            f"--spectrum: eigenvalues must be finite and > 0 (A^-1 enters mle and the bound), got {spec!r}"
        )
    return eig.astype(np.float64)


def recorded_steps(steps: int, every: int) -> list[int]:
    """Multiples of `every` up to `steps`, and always the last step."""
    out = list(range(every, steps + 1, every))
    return out if out and out[-1] == steps else [*out, steps]


def start_point(distance: float, dim: int) -> np.ndarray:
    """theta0 - mu: length `distance`, equal in every eigendirection of A."""
    return np.full(dim, distance / math.sqrt(dim))


def walk(
    st: SimSettings, eig: np.ndarray, trials: int, gen: torch.Generator, want: Callable[[int], bool]
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Run SGD and every estimator; yield (k, {estimator: (trials, dim) estimate - mu}) where want(k).

    Yielded tensors may alias running state: use them before the next iteration.
    A step the schedule skips (--phi) keeps that estimator's last output.
    """
    import torch

    dim = eig.size
    steps = list(range(1, st.steps + 1))
    a = torch.as_tensor(eig, dtype=getattr(torch, DTYPE))  # (dim,) the diagonal of A
    theta0 = (
        torch.as_tensor(start_point(st.distance, dim), dtype=getattr(torch, DTYPE))
        .expand(trials, dim)
        .clone()
    )
    stabilized = [m for m in st.methods if m != "mle"]
    schedules = {m: st.schedule(m) for m in stabilized}
    plans = {m: schedules[m].plan(steps) for m in stabilized}
    stabilizers = {
        m: Window([torch.empty_like(theta0) for _ in range(schedules[m].window - 1)])
        if m in WINDOW_METHODS
        else Stabilizer(m, theta0)
        for m in stabilized
    }
    keep_copy = any(e.action == "skip" for p in plans.values() for e in p)
    held: dict[str, torch.Tensor] = {m: theta0 for m in st.methods}
    running_sum = torch.zeros_like(theta0) if "mle" in st.methods else None  # sum_{j<k} theta_j
    theta = theta0  # mu = 0, so theta is also theta - mu
    block = max(1, NOISE_BLOCK // (trials * dim))
    for k in steps:
        if (k - 1) % block == 0:
            noise = torch.randn(
                (min(block, st.steps - k + 1), trials, dim), generator=gen, dtype=getattr(torch, DTYPE)
            )
        if running_sum is not None:
            running_sum += theta
        theta = theta - st.lr * (a * theta + st.sigma * noise[(k - 1) % block])
        for m in stabilized:
            if m in WINDOW_METHODS:  # a merge of the ring: a new tensor each step
                out = stabilizers[m].apply(plans[m][k - 1], theta, schedules[m])
            else:
                out = stabilizers[m].apply(plans[m][k - 1], theta)
                out = out.clone() if keep_copy and out is not None else out
            if out is not None:
                held[m] = out
        if want(k):
            if running_sum is not None:
                held["mle"] = (theta - theta0) / (a * (st.lr * k)) + running_sum / k
            yield k, held


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch single-threaded, then restore: each op here touches ~1e4-1e5 numbers, so OpenMP fork/join
    costs more than it saves, and on shared cores it collapses (2000 x 20 trials: 0.3 s -> 12 s measured)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def theory(st: SimSettings, eig: np.ndarray, steps: list[int]) -> dict[str, list[float]]:
    """Exact E|theta_s - mu|^2 of the discrete recursion, and the bound lr sigma^2 tr(A^-2) / (lr s)."""
    c2 = (1.0 - st.lr * eig) ** 2  # per-eigendirection contraction of the squared deviation
    d2 = start_point(st.distance, eig.size) ** 2
    exact, bound = [], []
    for s in steps:
        geometric = np.where(c2 == 1.0, float(s), (1.0 - c2**s) / np.where(c2 == 1.0, 1.0, 1.0 - c2))
        exact.append(float(np.sum(d2 * c2**s + st.lr**2 * st.sigma**2 * geometric)))
        bound.append(float(st.sigma**2 * np.sum(eig**-2.0) / s))
    return {"vanilla_exact": exact, "cramer_rao": bound}


def simulate(st: SimSettings) -> dict:
    """Monte-Carlo mean and standard error of |estimate - mu|^2 per estimator and recorded step."""
    import torch

    st = st.validated()
    eig = parse_spectrum(st.spectrum, st.dim)
    steps = recorded_steps(st.steps, st.record_every)
    wanted = set(steps)
    gen = torch.Generator().manual_seed(st.seed)
    stats: dict[str, dict[str, list[float]]] = {m: {"mean": [], "stderr": []} for m in st.methods}
    with one_thread():
        for _, estimates in walk(st, eig, st.trials, gen, wanted.__contains__):
            for m, est in estimates.items():
                err = est.square().sum(dim=1)  # (trials,) |estimate - mu|^2
                stats[m]["mean"].append(err.mean().item())
                se = err.std().item() / math.sqrt(st.trials) if st.trials > 1 else math.nan
                stats[m]["stderr"].append(se)
    settings = {**asdict(st), "methods": list(st.methods), "bema_version": __version__, "dtype": "float64"}
    return {"settings": settings, "steps": steps, "estimators": stats, "theory": theory(st, eig, steps)}


def trajectory_2d(st: SimSettings, methods: tuple[str, ...] = ("vanilla", "ema", "bema")) -> dict:
    """One 2-D trajectory (A's smallest and largest eigenvalue): every estimator's path, Fig. 1a style."""
    import torch

    st = replace(st.validated(), methods=methods)
    full = parse_spectrum(st.spectrum, st.dim)
    eig = np.array([full.min(), full.max()])
    gen = torch.Generator().manual_seed(st.seed)
    start = start_point(st.distance, 2)
    paths = {m: [start] for m in methods}
    with one_thread():
        for _, estimates in walk(st, eig, 1, gen, lambda k: True):
            for m in methods:
                paths[m].append(estimates[m][0].numpy().copy())
    return {"eigenvalues": eig, "paths": {m: np.array(p) for m, p in paths.items()}}
