"""`bema ship`: a run folder in, the model folder to ship out (bema_cli/decide/ship.py)."""

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
    eval_settings,
)
from bema_cli.commands.select import CardPathsOpt
from bema_cli.options import (
    AccumDtypeOpt,
    AllowGapsOpt,
    AllowNonfiniteOpt,
    BetaMinOpt,
    CastBaseOpt,
    EtaOpt,
    GammaOpt,
    GridConfigOpt,
    HalfLifeOpt,
    JsonOpt,
    KappaOpt,
    MinCheckpointsOpt,
    MinIntervalOpt,
    PhiOpt,
    PowerGammaOpt,
    PresetOpt,
    RhoOpt,
    ScheduleOpt,
    SigmaRelOpt,
    SwaStartOpt,
    TauOpt,
    TokensPerStepOpt,
    WindowOpt,
    parse_size,
    parse_str_list,
)


def ship(
    checkpoint_dir: Annotated[str, typer.Argument(help="Training output folder (checkpoint-N folders).")],
    out: Annotated[
        str, typer.Option("--out", "-o", help="The model folder to write (weights, config, tokenizer, card).")
    ],
    base: Annotated[str | None, typer.Option("--base", help="theta0: a model folder or Hub repo id.")] = None,
    at: Annotated[
        str, typer.Option("--at", help="The step to judge: last (the last saved) or a step.")
    ] = "last",
    metric: Annotated[
        str | None,
        typer.Option(
            "--metric", help="Default: loss with --loss-data, else the first task (gsm8k:strict, ...)."
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Say what the decision will cost (evaluations at most, generated tokens, projected time) "
            "and the smallest difference its report items can resolve; evaluate nothing.",
        ),
    ] = False,
    holdout: Annotated[
        float,
        typer.Option(
            "--holdout", help="Pick on this seeded fraction of the items, report every number on the rest."
        ),
    ] = 0.5,
    fit: Annotated[
        str,
        typer.Option(
            "--fit", help="Fitted averages after the menu: soup,simplex (simplex: loss only), or none."
        ),
    ] = "soup,simplex",
    resamples: Annotated[int, typer.Option("--resamples", help="Paired bootstrap resamples.")] = 2000,
    select_seed: Annotated[
        int, typer.Option("--select-seed", help="Seed of the pick/report split and the bootstrap.")
    ] = 0,
    max_evaluations: Annotated[
        int | None,
        typer.Option(
            "--max-evaluations",
            help="Stop the menu's race before a round would pass this many (candidate, item) pairs, and "
            "decide on what it has (no fits); the first round always runs.",
            min=1,
        ),
    ] = None,
    method: Annotated[
        str | None,
        typer.Option(
            "--method",
            help="Replace the menu: bema, ema, dema, ouema, lawa, wsm, swa, power, vanilla; comma list for a grid (default: the menu: vanilla, ema, bema at eta 0.2 and 0.5, lawa and wsm over 4 and 8 checkpoints).",
        ),
    ] = None,
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
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks",
            help="Comma list of tasks, as bema eval takes them (default: loss alone with --loss-data, which then decides; else gsm8k).",
        ),
    ] = None,
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
    max_memory: Annotated[str | None, typer.Option("--max-memory", help="Memory the sweep may hold.")] = None,
    device: Annotated[
        str,
        typer.Option(
            "--device", help="Where the sweep's states live: auto (the GPU when present), cpu or cuda."
        ),
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
    card_paths: CardPathsOpt = "short",
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Decide again and replace the model folder bema wrote at --out."),
    ] = False,
    push: Annotated[
        str | None, typer.Option("--push", help="Then upload it to this Hub model repo (ORG/NAME).")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Judge the run's averages in memory, pick with intervals, fit an average, and write the one to ship.

    The menu (default: vanilla, EMA, BEMA at eta 0.2 and 0.5, LAWA and WSM over 4 and 8 checkpoints) is judged at the last saved step in one engine; the pick is made on --holdout of the items and every number reported on the rest. An average is written only if it beats vanilla beyond its 95% interval; else the raw checkpoint is, and the verdict says so. Ties go to vanilla, then the simplest config, then the later step.
    """
    from pathlib import Path

    from bema_cli.card import CARD_PATHS
    from bema_cli.commands.stabilize import schedules_from_flags
    from bema_cli.decide.budget import budget_line
    from bema_cli.decide.push import check_repo_id
    from bema_cli.decide.ship import DEFAULT_GRID, ShipOptions, check
    from bema_cli.decide.ship import ship as run
    from bema_cli.errors import UsageError
    from bema_cli.eval.evaluate import LIBRARY_LOG
    from bema_cli.stabilize import Options, grid
    from bema_cli.sweep.session import SweepOptions, parse_at

    parse_at(at)
    if card_paths not in CARD_PATHS:
        raise UsageError(f"--card-paths: choose {' or '.join(CARD_PATHS)}, got {card_paths!r}")
    if push:
        check_repo_id(push)
    fits = () if fit.strip() == "none" else tuple(parse_str_list(fit, "--fit"))
    if tasks is None:  # the decision is made on loss when there is held-out data: no generation task
        tasks = "loss" if loss_data is not None else "gsm8k"
    flags = {**locals(), "out": str(Path(out).parent / f".{Path(out).name}.bema-ship" / "race"),
             "log_samples": False, "force": False,
             "verify_swap": False, "tensor_parallel_size": 1, "data_parallel_size": 1, "enforce_eager": False}  # fmt: skip
    evaluation, engine = eval_settings(flags)
    ship_opts = ShipOptions(
        Path(out),
        metric,
        holdout,
        at,
        fits,
        resamples,
        select_seed,
        card_paths,
        overwrite,
        push,
        max_evaluations,
        dry_run,
        reads=(Path(config).expanduser(),) if config else (),
    )
    check(ship_opts, evaluation)
    given = [method, kappa, eta, window, schedule, swa_start, sigma_rel, power_gamma, half_life, config]
    common = {"preset": preset, "gamma": gamma, "rho": rho, "tau": tau, "phi": phi, "beta_min": beta_min}
    schedules = (
        schedules_from_flags(flags) if any(v is not None for v in given) else grid(**DEFAULT_GRID, **common)
    )
    opts = Options(checkpoint_dir=checkpoint_dir, schedules=schedules, out=flags["out"], base=base, device=device,
                   accum_dtype=accum_dtype, out_dtype=out_dtype, allow_nonfinite=allow_nonfinite,
                   cast_base=cast_base, allow_gaps=allow_gaps, durations=flags.get("durations") or None,
                   min_interval=min_interval, min_checkpoints=min_checkpoints)  # fmt: skip
    limit = parse_size(max_memory, "--max-memory") if max_memory is not None else None
    doc = run(opts, evaluation, engine, ship_opts, SweepOptions(at=at, memory_limit=limit),
              validated=lambda: output.send_library_output(Path(flags["out"]) / LIBRARY_LOG))  # fmt: skip
    if doc.get("stages"):
        output.log(stages.line(doc["stages"]))
    if json_:
        output.print_json(doc)
    else:
        text = budget_line(doc) if doc.get("dry_run") else doc["verdict"]
        output.stdout.print(text, highlight=False, markup=False)
