"""What `bema ship` is asked: its options (ShipOptions), the default menu and the flags' checks,
before anything is read, and the request they make once the run is planned (`ShipRequest`: what
every stage of a ship takes whole). The decision itself is contest.py's; publishing it is
bema_cli/ship.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from bema_cli.decide import guard, select
from bema_cli.decide.metric import Metric, parse_metric
from bema_cli.decide.search import FITS
from bema_cli.errors import UsageError
from bema_cli.eval.job import EvalConfig

# The default search space (docs/math.md, "Which average when"): EMA and BEMA at the language-model
# defaults (kappa 0.5; eta 0.2, the paper's, and 0.5, a stronger correction), LAWA and WSM windows
# of 4 and 8 checkpoints. Vanilla is always a candidate.
DEFAULT_GRID = {
    "methods": ["ema", "bema", "lawa", "wsm"],
    "kappas": [0.5],
    "etas": [0.2, 0.5],
    "windows": [4, 8],
    "schedules": ["minus-sqrt"],
}


@dataclass
class ShipOptions:
    out: Path
    metric: str | None = None  # None: loss with --loss-data, else the first task
    holdout: float = 0.5
    at: str = "last"
    fits: tuple[str, ...] | None = None  # None: the metric's (fits_for)
    resamples: int = select.RESAMPLES
    seed: int = 0
    overwrite: bool = False
    push: str | None = None
    max_evaluations: int | None = None  # (candidate, item) pairs the race may evaluate; None: no bound
    min_effect: float = 0.0  # an average ships only if its interval against vanilla lies beyond this
    guard_margin: float | None = None  # the other tasks' non-inferiority margin (None: guard.DEFAULT_MARGIN)
    dry_run: bool = False  # say the budget (budget.py), evaluate nothing
    trust_held_out: bool = False  # ship on held-out rows that look like another shape than the run's
    reads: tuple[Path, ...] = ()  # other files the request reads (a grid --config): never replaced


def default_metric(config: EvalConfig) -> str:
    """Held-out loss when it is evaluated (--loss-data adds the task), else the first task."""
    return "loss" if "loss" in config.tasks else next(t for t in config.tasks if t != "train_loss")


def check(ship_opts: ShipOptions, config: EvalConfig) -> Metric:
    """The flags alone, before anything is read."""
    if ship_opts.holdout is None:
        raise UsageError("--holdout: ship picks on one part of the items and reports on the other")
    select.check_flags("last", ship_opts.holdout, ship_opts.resamples)
    bad = sorted(set(ship_opts.fits or ()) - set(FITS))
    if bad:
        raise UsageError(f"--fit: unknown fit {bad[0]!r} (choose from {', '.join(FITS)}, or none)")
    metric = parse_metric(ship_opts.metric or default_metric(config))
    if metric.task not in config.tasks:
        raise UsageError(f"--metric {metric.name}: not among the evaluated tasks ({', '.join(config.tasks)})")
    if "train_loss" in config.tasks and metric.task != "train_loss":  # scored by nothing in ship
        raise UsageError(
            "--tasks train_loss: ship neither decides nor guards on the training rows' loss (--metric decides, "
            "the other tasks guard); evaluate it with `bema eval`, or leave out --loss-train-data"
        )
    if ship_opts.guard_margin is not None and not guard.guard_tasks(config.tasks, metric.task):
        raise UsageError(
            f"--guard-margin: no guard task (--tasks {','.join(config.tasks)}: only --metric {metric.name}); "
            "a guard is a task other than the metric"
        )
    return metric


def fits_for(ship_opts: ShipOptions, metric: Metric) -> ShipOptions:
    """The options with their fits said: as given, else the simplex on loss and the soup on accuracy.
    On loss the soup found no better model than the simplex in bench_decide's worlds (the same power
    and true gain) at a third more swaps, so it runs only when asked for (--fit soup,simplex)."""
    if ship_opts.fits is not None:
        return ship_opts
    return replace(ship_opts, fits=("simplex",) if metric.key == "loss" else ("soup",))


class DecisionRun(NamedTuple):
    """The run as ship walks it, planned once per ship: its options (as a sweep plans them), the
    plan, {step: folder}, the step decided at."""

    stab: object
    plan: object
    folder_of: dict
    step: int


def decision_run(stab, at: str) -> DecisionRun:
    """The run as ship walks it (the decision, its inputs and its dry run alike: `ship` plans it
    once). theta0 (0) is refused: ship decides at a checkpoint's step."""
    from bema_cli.sweep.session import at_steps
    from bema_cli.sweep.walk import plan_sweep, sweep_options

    stab = sweep_options(stab)
    plan = plan_sweep(stab)
    folder_of = {c.step: c.path for c in plan.checkpoints}
    step = at_steps(at, sorted(folder_of))[-1]
    if step == 0:
        raise UsageError("--at: ship decides at a checkpoint's step, not at theta0 (0)")
    return DecisionRun(stab, plan, folder_of, step)


@dataclass(frozen=True)
class ShipRequest:
    """One ship's question, typed and built once, before anything is evaluated: the run as ship walks
    it, the evaluation's settings, the decision's options (their fits said: `fits_for`), the walk's
    memory options and the metric. The decision (contest), the dry run (budget) and publishing take
    it whole; publish/records.request_key is what makes two of them the same question."""

    run: DecisionRun
    config: EvalConfig
    options: ShipOptions
    sweep: object  # sweep/session.SweepOptions: the walk's memory limit
    metric: Metric

    @classmethod
    def of(cls, stab, config: EvalConfig, options: ShipOptions, sweep) -> ShipRequest:
        """The flags checked (`check`), the fits said, the run planned (`decision_run`)."""
        metric = check(options, config)
        return cls(decision_run(stab, options.at), config, fits_for(options, metric), sweep, metric)
