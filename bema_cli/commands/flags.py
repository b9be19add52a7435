"""The option lists several commands share, each declared once as a small frozen settings class.

A class's fields are typer options (the `Annotated` aliases of options.py and eval_options.py) with
their defaults; `with_flags` adds them to a command's parameters and hands the command one instance
per concern (the grid, the inputs, following a run, the executor, the evaluation, the engine), so a
layer sees what it was given and nothing else (vLLM's `EngineArgs` is the pattern). A class's
`PANEL` is where `--help` shows its options (an option's own panel, as the engine's, wins).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Annotated, ClassVar

from bema_cli.commands.eval_options import (
    BackendOpt,
    BatchSizeOpt,
    ChatTemplateOpt,
    CotOpt,
    DataDirOpt,
    DtypeOpt,
    GpuMemoryUtilizationOpt,
    LimitOpt,
    LmEvalIncludeOpt,
    LossDataOpt,
    LossMaxTokensOpt,
    LossSamplesOpt,
    LossTrainDataOpt,
    MaxModelLenOpt,
    MaxNewTokensOpt,
    NSamplesOpt,
    NumFewshotOpt,
    SeedOpt,
    SelectionSeedOpt,
    TemperatureOpt,
)
from bema_cli.errors import UsageError
from bema_cli.eval.backends.base import Sampling
from bema_cli.eval.tasks import SELECTION_SEED
from bema_cli.eval.tasks import loss as loss_task
from bema_cli.options import (
    GRID_PANEL,
    RESOURCES_PANEL,
    AccumDtypeOpt,
    AllowGapsOpt,
    AllowNonfiniteOpt,
    BetaMinOpt,
    CastBaseOpt,
    EtaOpt,
    ExecutorOpt,
    FollowOpt,
    GammaOpt,
    GridConfigOpt,
    HalfLifeOpt,
    IdleTimeoutOpt,
    KappaOpt,
    MinCheckpointsOpt,
    MinIntervalOpt,
    PhiOpt,
    PollOpt,
    PowerGammaOpt,
    PresetOpt,
    RayAddressOpt,
    RhoOpt,
    ScheduleOpt,
    SettleOpt,
    SigmaRelOpt,
    SwaStartOpt,
    TauOpt,
    TokensPerStepOpt,
    UntilStepOpt,
    WalkBaseOpt,
    WalkDeviceOpt,
    WalkDtypeOpt,
    WalkMemoryOpt,
    WindowOpt,
    WorkersOpt,
    check_seconds,
    parse_float_list,
    parse_int_list,
    parse_size,
    parse_str_list,
)
from bema_cli.schedule import AXES, DEFAULTS, RECORD_NAMES, SHARED, Schedule


def with_flags(**groups: type):
    """Each settings class's fields become keyword options of the command (after its own), and the
    command is called with one instance per group under the given parameter name."""

    def wrap(command):
        sig = inspect.signature(command, eval_str=True)  # typer reads the Annotated options
        own = [p for name, p in sig.parameters.items() if name not in groups]
        added = []
        for cls in groups.values():
            hints = typing.get_type_hints(cls, include_extras=True)
            added += [
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=f.default,
                    annotation=_in_panel(hints[f.name], getattr(cls, "PANEL", None)),
                )
                for f in dataclasses.fields(cls)
            ]

        @functools.wraps(command)
        def run(*args, **kwargs):
            for name, cls in groups.items():
                kwargs[name] = cls(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls)})
            return command(*args, **kwargs)

        run.__signature__ = sig.replace(parameters=own + added)
        run.__annotations__ = {k: v for k, v in command.__annotations__.items() if k not in groups}
        return run

    return wrap


def _in_panel(annotation, panel: str | None):
    """An option's annotation shown in `panel` (a copy: the alias itself serves other commands)."""
    kind, *extras = typing.get_args(annotation)
    if panel is None or not extras or getattr(extras[0], "rich_help_panel", None) is not None:
        return annotation
    info = copy.copy(extras[0])
    info.rich_help_panel = panel
    return Annotated[kind, info]


# the axes a flag may give as spans of training, resolved on the run (durations.py): the key it resolves to
SPANS = {"window": "window", "swa_start": "swa_start", "power_gamma": "half_life"}


def _kind(name: str) -> str:
    """An axis's value type, from its Schedule field ("float", "int | None": float, int)."""
    return next(f.type for f in dataclasses.fields(Schedule) if f.name == name).split(" ")[0]


@dataclass(frozen=True)
class GridFlags:
    """The stabilizer grid's settings besides --method (stabilize, sweep, ship)."""

    PANEL: ClassVar[str] = GRID_PANEL

    kappa: KappaOpt = None
    eta: EtaOpt = None
    window: WindowOpt = None
    schedule: ScheduleOpt = None
    swa_start: SwaStartOpt = None
    half_life: HalfLifeOpt = None
    tokens_per_step: TokensPerStepOpt = None
    sigma_rel: SigmaRelOpt = None
    power_gamma: PowerGammaOpt = None
    config: GridConfigOpt = None
    gamma: GammaOpt = DEFAULTS["gamma"]
    rho: RhoOpt = DEFAULTS["rho"]
    tau: TauOpt = DEFAULTS["tau"]
    phi: PhiOpt = DEFAULTS["phi"]
    beta_min: BetaMinOpt = DEFAULTS["beta_min"]
    preset: PresetOpt = DEFAULTS["preset"]

    def common(self) -> dict:
        """The settings every config of the grid shares (schedule.SHARED)."""
        return {n: getattr(self, n) for n in SHARED}

    def axes(self) -> dict:
        """{flag: its text} of the axes the grid sweeps (schedule.AXES; --schedule is merge_schedule)."""
        from bema_cli.stabilize.grids import flag

        return {flag(n): getattr(self, RECORD_NAMES[n]) for n in AXES}

    def given(self, method: str | None) -> bool:
        """Whether any flag that shapes the grid's configs was given (ship: else its default menu)."""
        shaping = (method, *self.axes().values(), self.half_life, self.config)
        return any(v is not None for v in shaping)

    def schedules(self, method: str | None, checkpoint_dir, checkpoints=None, follow: bool = False):
        """(the grid's schedules, how each span of training resolved on the run): --config FILE, or
        --method and the parameter lists (stabilize, sweep and ship alike)."""
        from bema_cli.durations import resolve_flags
        from bema_cli.stabilize import grid
        from bema_cli.stabilize.grids import flag, grid_from_config, plural

        if self.config is not None:
            flags = {"--method": method, **self.axes(), "--half-life": self.half_life}
            given = [flag for flag, v in flags.items() if v is not None]
            if given:
                raise UsageError(f"--config: the grid comes from {self.config}; drop {given[0]}")
            return grid_from_config(self.config, **self.common()), {}
        methods = parse_str_list(method or "bema", "--method")
        spans, durations = resolve_flags(self, methods, checkpoint_dir, checkpoints, follow)

        def numbers(value, flag: str, parse, resolved: str | None = None):
            if resolved in spans:  # given as spans of training: already resolved on the run
                return spans[resolved]
            return parse(value, flag) if value is not None else None

        parse = {"float": parse_float_list, "int": parse_int_list, "str": parse_str_list}
        lists = {
            plural(n): numbers(text, flag(n), parse[_kind(n)], SPANS.get(n))
            for n, text in zip(AXES, self.axes().values(), strict=True)
        }
        return grid(methods, **lists, **self.common()), durations


@dataclass(frozen=True)
class InputFlags:
    """How a run's checkpoints are read (stabilize, sweep, ship)."""

    PANEL: ClassVar[str] = "Reading the run"

    accum_dtype: AccumDtypeOpt = "float32"
    allow_nonfinite: AllowNonfiniteOpt = False
    allow_gaps: AllowGapsOpt = False
    min_interval: MinIntervalOpt = None
    min_checkpoints: MinCheckpointsOpt = None
    cast_base: CastBaseOpt = False

    def options(self) -> dict:
        """These as stabilize.Options' keywords."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FollowFlags:
    """--follow and its pacing (stabilize, sweep)."""

    PANEL: ClassVar[str] = "Follow a live run"

    follow: FollowOpt = False
    until_step: UntilStepOpt = None
    idle_timeout: IdleTimeoutOpt = None
    poll: PollOpt = 2.0
    settle: SettleOpt = None

    def pace(self):
        """The follower's io.watch.Pace, or None without --follow (where its pacing flags are refused)."""
        from bema_cli.io.watch import Pace

        if not self.follow and (self.until_step is not None or self.idle_timeout is not None):
            raise UsageError("--until-step and --idle-timeout only apply with --follow")
        check_seconds(self.poll, "--poll")
        check_seconds(self.settle, "--settle", zero_ok=True)
        check_seconds(self.idle_timeout, "--idle-timeout", zero_ok=True)  # 0: take what is there, then stop
        if self.until_step is not None and self.until_step < 0:
            raise UsageError(f"--until-step: must be a step >= 0, got {self.until_step}")
        return Pace(self.poll, self.until_step, self.idle_timeout, self.settle) if self.follow else None


@dataclass(frozen=True)
class WalkFlags:
    """The walk that holds every config's average in memory (sweep, ship): theta0, memory, device, dtype."""

    PANEL: ClassVar[str] = "The walk in memory"

    base: WalkBaseOpt = None
    max_memory: WalkMemoryOpt = None
    device: WalkDeviceOpt = "auto"
    out_dtype: WalkDtypeOpt = None

    def options(self, checkpoint_dir: str, schedules, out: str, durations: dict, inputs: InputFlags):
        """The run to walk, as stabilize.Options."""
        from bema_cli.stabilize import Options

        return Options(
            checkpoint_dir=checkpoint_dir,
            schedules=schedules,
            out=out,
            base=self.base,
            device=self.device,
            out_dtype=self.out_dtype,
            durations=durations or None,
            **inputs.options(),
        )

    def sweep_options(self, at: str, dry_run: bool = False):
        """The sweep's own settings (sweep.session.SweepOptions): --at and the memory it may hold."""
        from bema_cli.sweep.session import SweepOptions

        limit = parse_size(self.max_memory, "--max-memory") if self.max_memory is not None else None
        return SweepOptions(at=at, memory_limit=limit, dry_run=dry_run)


@dataclass(frozen=True)
class ExecutorFlags:
    """Where the work runs (stabilize, sweep, eval: bema_cli/cluster.py)."""

    PANEL: ClassVar[str] = RESOURCES_PANEL

    executor: ExecutorOpt = "local"
    workers: WorkersOpt = 1
    ray_address: RayAddressOpt = None

    def options(self):
        from bema_cli.cluster import ExecutorOptions

        return ExecutorOptions(self.executor, self.workers, self.ray_address)


@dataclass(frozen=True)
class EvalFlags:
    """What an evaluation runs and on what (eval, sweep, ship), besides --tasks."""

    data_dir: DataDirOpt = None
    loss_data: LossDataOpt = None
    loss_train_data: LossTrainDataOpt = None
    # each default is the protocol's own (eval/backends/base.Sampling, eval/tasks), written there once
    loss_samples: LossSamplesOpt = loss_task.DEFAULT_SAMPLES
    loss_max_tokens: LossMaxTokensOpt = loss_task.MAX_TOKENS
    n_samples: NSamplesOpt = Sampling.n
    temperature: TemperatureOpt = Sampling.temperature
    seed: SeedOpt = Sampling.seed
    max_new_tokens: MaxNewTokensOpt = None
    selection_seed: SelectionSeedOpt = SELECTION_SEED
    limit: LimitOpt = None
    num_fewshot: NumFewshotOpt = 0
    cot: CotOpt = False
    lm_eval_include: LmEvalIncludeOpt = None
    chat_template: ChatTemplateOpt = None


@dataclass(frozen=True)
class EngineFlags:
    """The inference engine (eval, sweep, ship)."""

    backend: BackendOpt = "auto"
    dtype: DtypeOpt = "auto"
    gpu_memory_utilization: GpuMemoryUtilizationOpt = 0.7
    max_model_len: MaxModelLenOpt = None
    batch_size: BatchSizeOpt = 8
