"""`bema sweep`: parse stabilize's grid flags and eval's protocol flags, call bema_cli.sweep."""

from __future__ import annotations

from typing import Annotated

import typer

from bema_cli import output, stages
from bema_cli.commands.eval_options import (
    BackendOpt,
    BatchSizeOpt,
    ChatTemplateOpt,
    CotOpt,
    DataDirOpt,
    DtypeOpt,
    ForceOpt,
    GpuMemoryUtilizationOpt,
    LimitOpt,
    LmEvalIncludeOpt,
    LogSamplesOpt,
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
    TasksOpt,
    TemperatureOpt,
    eval_settings,
)
from bema_cli.options import (
    AccumDtypeOpt,
    AllowGapsOpt,
    AllowNonfiniteOpt,
    BetaMinOpt,
    CastBaseOpt,
    EtaOpt,
    ExecutorOpt,
    GammaOpt,
    GridConfigOpt,
    HalfLifeOpt,
    IdleTimeoutOpt,
    JsonOpt,
    KappaOpt,
    MethodOpt,
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
    WindowOpt,
    WorkersOpt,
    check_seconds,
    parse_size,
)


def sweep(
    checkpoint_dir: Annotated[
        str, typer.Argument(help="Training output folder (checkpoint-N, step_N, ... folders).")
    ],
    out: Annotated[
        str, typer.Option("--out", "-o", help="Results folder (results.jsonl; no weights are written).")
    ],
    base: Annotated[
        str | None,
        typer.Option(
            "--base", help="theta0: a model folder or Hub repo id (default: as bema stabilize infers it)."
        ),
    ] = None,
    at: Annotated[
        str,
        typer.Option("--at", help="Steps to evaluate: all, last, every:N or a comma list (0 = theta0)."),
    ] = "all",
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Project peak memory and wall time (a short probe of this machine), read no checkpoint.",
        ),
    ] = False,
    method: MethodOpt = None,
    kappa: KappaOpt = None,
    eta: EtaOpt = None,
    window: WindowOpt = None,
    schedule: ScheduleOpt = None,
    swa_start: SwaStartOpt = None,
    half_life: HalfLifeOpt = None,
    tokens_per_step: TokensPerStepOpt = None,
    sigma_rel: SigmaRelOpt = None,
    power_gamma: PowerGammaOpt = None,
    config: GridConfigOpt = None,
    gamma: GammaOpt = 1.0,
    rho: RhoOpt = 10.0,
    tau: TauOpt = 0,
    phi: PhiOpt = None,
    beta_min: BetaMinOpt = None,
    preset: PresetOpt = "paper",
    tasks: TasksOpt = "boolq,gsm8k,mmlu_hs",
    data_dir: DataDirOpt = None,
    loss_data: LossDataOpt = None,
    loss_train_data: LossTrainDataOpt = None,
    loss_samples: LossSamplesOpt = 200,
    loss_max_tokens: LossMaxTokensOpt = 1024,
    n_samples: NSamplesOpt = 50,
    temperature: TemperatureOpt = 1.0,
    seed: SeedOpt = 13337,
    max_new_tokens: MaxNewTokensOpt = None,
    selection_seed: SelectionSeedOpt = 37371,
    limit: LimitOpt = None,
    num_fewshot: NumFewshotOpt = 0,
    cot: CotOpt = False,
    lm_eval_include: LmEvalIncludeOpt = None,
    chat_template: ChatTemplateOpt = None,
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
    gpu_memory_utilization: GpuMemoryUtilizationOpt = 0.7,
    max_model_len: MaxModelLenOpt = None,
    batch_size: BatchSizeOpt = 8,
    log_samples: LogSamplesOpt = False,
    force: ForceOpt = False,
    max_memory: Annotated[
        str | None,
        typer.Option(
            "--max-memory", help="Memory the sweep may hold, states and engine (default: what is available)."
        ),
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="Where the states live: auto (the GPU when present), cpu or cuda.")
    ] = "auto",
    accum_dtype: AccumDtypeOpt = "float32",
    out_dtype: Annotated[
        str | None,
        typer.Option("--out-dtype", help="The dtype the configs are cast to (default: the inputs')."),
    ] = None,
    allow_nonfinite: AllowNonfiniteOpt = False,
    allow_gaps: AllowGapsOpt = False,
    min_interval: MinIntervalOpt = None,
    min_checkpoints: MinCheckpointsOpt = None,
    cast_base: CastBaseOpt = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", help="Keep watching CHECKPOINT_DIR; evaluate each new checkpoint as it lands."
        ),
    ] = False,
    until_step: UntilStepOpt = None,
    idle_timeout: IdleTimeoutOpt = None,
    poll: PollOpt = 2.0,
    settle: SettleOpt = None,
    executor: ExecutorOpt = "local",
    workers: WorkersOpt = 1,
    ray_address: RayAddressOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Evaluate a stabilizer grid at chosen steps with no weight file written: each checkpoint is read
    once, every config's average is kept in memory and streamed into one engine (vLLM or transformers).

    Records equal those of `bema stabilize` followed by `bema eval` (same run names and steps, vanilla
    included), so `bema select OUT` picks the config to ship.
    """
    from pathlib import Path

    from bema_cli.cluster import ExecutorOptions
    from bema_cli.commands.stabilize import schedules_from_flags
    from bema_cli.eval.evaluate import LIBRARY_LOG
    from bema_cli.eval.results import records_table
    from bema_cli.stabilize import Options
    from bema_cli.sweep.run import sweep as run
    from bema_cli.sweep.session import SweepOptions, parse_at

    parse_at(at)  # instantly, before any input is read
    flags = {**locals(), "verify_swap": False, "tensor_parallel_size": 1, "data_parallel_size": 1,
             "enforce_eager": False}  # fmt: skip
    evaluation, engine = eval_settings(flags)
    schedules = schedules_from_flags(flags)
    opts = Options(
        checkpoint_dir=checkpoint_dir, schedules=schedules, out=str(Path(out) / ".sweep"),
        base=base, device=device, accum_dtype=accum_dtype, out_dtype=out_dtype, allow_nonfinite=allow_nonfinite,
        cast_base=cast_base, allow_gaps=allow_gaps, durations=flags.get("durations") or None,
        min_interval=min_interval, min_checkpoints=min_checkpoints,
    )  # fmt: skip
    if follow and min_interval is not None:
        from bema_cli.errors import UsageError

        raise UsageError(
            "--min-interval: the thinned set anchors at the last step, which --follow does not know yet"
        )
    if not follow and (until_step is not None or idle_timeout is not None):
        from bema_cli.errors import UsageError

        raise UsageError("--until-step and --idle-timeout only apply with --follow")
    check_seconds(poll, "--poll")
    check_seconds(settle, "--settle", zero_ok=True)
    check_seconds(idle_timeout, "--idle-timeout", zero_ok=True)
    limit = parse_size(max_memory, "--max-memory") if max_memory is not None else None
    where = ExecutorOptions(executor, workers, ray_address)
    follow_opts = {"poll": poll, "until_step": until_step, "idle_timeout": idle_timeout, "settle": settle}
    doc = run(
        opts, evaluation, engine, SweepOptions(at=at, memory_limit=limit, dry_run=dry_run), executor=where,
        follow=follow_opts if follow else None,
        validated=lambda: output.send_library_output(Path(out) / LIBRARY_LOG),
    )  # fmt: skip
    if json_:
        output.print_json(doc)
    elif dry_run:
        p = doc["projection"]
        output.stdout.print(
            f"bema sweep --dry-run: {doc['pending']} evaluation(s) to do over {len(doc['runs'])} config(s) + vanilla; "
            f"projected peak memory {output.size(p['peak_memory_bytes'])}, wall ~{p.get('seconds', float('nan')):.0f} s"
        )
    else:
        output.print_table(records_table(doc["records"], title="bema sweep"))
        memory = doc["memory"]
        output.log(
            f"sweep: {doc['evaluated']} evaluation(s) over {len(doc['runs'])} config(s) + vanilla, "
            f"{doc['engine_starts']} engine start, 0 bytes of weights written; memory estimate "
            f"{memory['estimate'] / 1e9:.2f} GB, peak RSS {memory['peak_rss'] / 1e9:.2f} GB (bema "
            f"{memory['peak_rss_bema'] / 1e9:.2f} + engine processes {memory['peak_rss_engine'] / 1e9:.2f})"
        )
        output.log(stages.line(doc["stages"]))


PANELS = {
    "Stabilizer (the grid: comma lists)": ["method", "kappa", "eta", "gamma", "rho", "tau", "phi", "beta_min", "preset",
                                           "window", "schedule", "swa_start", "sigma_rel", "power_gamma", "config"],
    "Follow a live run": ["follow", "until_step", "idle_timeout", "poll", "settle", "allow_gaps"],
    "Resources and scale-out": ["max_memory", "device", "accum_dtype", "out_dtype", "executor", "workers",
                                "ray_address"],
}  # fmt: skip
