"""`bema stabilize`: parse flags, call the engine (bema_cli/stabilize/), print a summary or JSON."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import replace
from typing import Annotated

import typer

from bema_cli import output, stages
from bema_cli.errors import UsageError
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
    OutDirOpt,
    OverwriteOpt,
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
    parse_float_list,
    parse_int_list,
    parse_size,
    parse_str_list,
)
from bema_cli.stabilize.project import projection_line


def stabilize(
    checkpoint_dir: Annotated[
        str,
        typer.Argument(
            help="Training output folder (checkpoint-N, step_N, step-N, global_stepN or iter_N folders), "
            "or - to read 'STEP PATH' lines from stdin."
        ),
    ],
    out: OutDirOpt,
    base: Annotated[
        str | None,
        typer.Option(
            "--base",
            help="theta0: a model folder, a Hub repo id, or 'first' (default: checkpoint-0, else config _name_or_path).",
        ),
    ] = None,
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
    max_memory: Annotated[
        str, typer.Option("--max-memory", help="Working-set budget (e.g. 2GiB); tensors are chunked to fit.")
    ] = "2GiB",
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="Largest output shard (e.g. 5GB).")
    ] = "5GB",
    device: Annotated[
        str,
        typer.Option(
            "--device",
            help="auto (the device projected faster for this grid on this machine; said on stderr and in --json), cpu or cuda.",
        ),
    ] = "auto",
    readers: Annotated[
        int | None,
        typer.Option(
            "--readers",
            min=1,
            max=64,
            help="Threads reading checkpoints ahead of the compute (default: 2, half the cores up to 4).",
        ),
    ] = None,
    accum_dtype: AccumDtypeOpt = "float32",
    out_dtype: Annotated[
        str | None,
        typer.Option("--out-dtype", help="float32, bfloat16, float16 (default: each tensor's input dtype)."),
    ] = None,
    final_only: Annotated[
        bool, typer.Option("--final-only", help="Write only the last processed step of each run.")
    ] = False,
    steps: Annotated[
        str | None, typer.Option("--steps", help="Write only these steps, e.g. 400,800.")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the plan (steps, alpha/beta, bytes, shards); write nothing."),
    ] = False,
    json_out: JsonOpt = False,
    overwrite: OverwriteOpt = False,
    allow_nonfinite: AllowNonfiniteOpt = False,
    allow_gaps: AllowGapsOpt = False,
    lora_output: Annotated[
        str,
        typer.Option(
            "--lora-output",
            help="LoRA runs: merged (full model folders) or adapter (PEFT adapters of rank --lora-rank).",
        ),
    ] = "merged",
    lora_rank: Annotated[
        int | None,
        typer.Option("--lora-rank", help="Rank of adapter outputs (truncated SVD; default: the training r)."),
    ] = None,
    restart: Annotated[
        bool,
        typer.Option(
            "--restart", help="Ignore OUT's saved state for these runs and recompute them from theta0."
        ),
    ] = False,
    keep_state: Annotated[
        bool | None,
        typer.Option(
            "--state/--no-state",
            help="Write OUT/.bema-state so a later call continues the run [default: on, off with "
            "--final-only]; --no-state saves one model-size write per EMA track.",
            show_default=False,
        ),
    ] = None,
    keep_last: Annotated[
        int | None,
        typer.Option(
            "--keep-last", help="Keep only the K newest outputs of each run (like save_total_limit)."
        ),
    ] = None,
    min_interval: MinIntervalOpt = None,
    min_checkpoints: MinCheckpointsOpt = None,
    fingerprint: Annotated[
        str,
        typer.Option(
            "--fingerprint",
            help="How consumed checkpoints are recorded in OUT's state: full (a digest of every byte, xxh3_128) or sampled "
            "(header, first and last 64 KiB; cheaper on slow storage).",
        ),
    ] = "full",
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            help="Keep watching CHECKPOINT_DIR and process each new checkpoint once it is complete.",
        ),
    ] = False,
    until_step: UntilStepOpt = None,
    idle_timeout: IdleTimeoutOpt = None,
    poll: PollOpt = 2.0,
    settle: SettleOpt = None,
    cast_base: CastBaseOpt = False,
    executor: ExecutorOpt = "local",
    workers: WorkersOpt = 1,
    ray_address: RayAddressOpt = None,
) -> None:
    """Stabilize a fine-tuning run's checkpoints with BEMA/EMA/DEMA/OUEMA or a window/schedule average
    (LAWA, WSM, SWA, power EMA), streaming tensor by tensor.

    Writes OUT/<run>/checkpoint-<step>/ (loadable HF model folders with bema.json) and OUT/manifest.json.
    Reads safetensors, PyTorch .bin, DCP (FSDP sharded) checkpoints and PEFT LoRA adapters (stabilized
    in weight space).
    A grid (comma lists in --method/--kappa/--eta/--window/--schedule/...) is computed in one pass over the inputs.
    OUT/.bema-state/ keeps the recurrences, so a re-run reads only new checkpoints; --follow
    keeps going while training runs (one JSON line per output with --json).
    """
    from bema_cli.cluster import ExecutorOptions
    from bema_cli.io.checkpoints import read_checkpoint_list
    from bema_cli.stabilize import Options
    from bema_cli.stabilize import stabilize as run
    from bema_cli.stabilize.executors import session

    checkpoints = None
    if checkpoint_dir == "-":
        if sys.stdin.isatty():
            raise UsageError(
                "-: reads 'STEP PATH' lines from stdin, which is a terminal here; pipe or redirect a list in (bema stabilize - --out OUT < steps.txt)"
            )
        checkpoints = read_checkpoint_list(sys.stdin.read())

    flags = dict(locals())
    schedules = schedules_from_flags(flags)
    opts = Options(
        checkpoint_dir=checkpoint_dir, schedules=schedules, out=out, base=base,
        max_memory=parse_size(max_memory, "--max-memory"), max_shard_size=parse_size(max_shard_size, "--max-shard-size"),
        device=device, readers=readers, accum_dtype=accum_dtype, out_dtype=out_dtype, final_only=final_only,
        steps=parse_int_list(steps, "--steps") if steps is not None else None, dry_run=dry_run, overwrite=overwrite,
        allow_nonfinite=allow_nonfinite, allow_gaps=allow_gaps, cast_base=cast_base, checkpoints=checkpoints,
        lora_output=lora_output, lora_rank=lora_rank, restart=restart, keep_last=keep_last, fingerprint=fingerprint,
        no_state=None if keep_state is None else not keep_state, durations=flags.get("durations") or None,
        min_interval=min_interval, min_checkpoints=min_checkpoints,
    )  # fmt: skip
    if min_interval is not None:
        if keep_state or follow:
            raise UsageError("--min-interval: the thinned set anchors at the last step, so a continued run would "
                             "average another one: drop --keep-state/--follow")  # fmt: skip
        opts = replace(opts, no_state=True)
    if fingerprint not in ("full", "sampled"):
        raise UsageError(f"--fingerprint: choose full or sampled, got {fingerprint!r}")
    if keep_last is not None and keep_last < 1:
        raise UsageError(f"--keep-last: must be >= 1, got {keep_last}")
    if follow and keep_state is False:
        raise UsageError("--no-state: --follow continues from the state; drop one of them")
    if follow:
        opts = replace(opts, no_state=False)  # every round continues the last one's state
    if not follow and (until_step is not None or idle_timeout is not None):
        raise UsageError("--until-step and --idle-timeout only apply with --follow")
    check_seconds(poll, "--poll")
    check_seconds(settle, "--settle", zero_ok=True)
    check_seconds(idle_timeout, "--idle-timeout", zero_ok=True)  # 0: process what is there, then stop
    if until_step is not None and until_step < 0:
        raise UsageError(f"--until-step: must be a step >= 0, got {until_step}")
    where = ExecutorOptions(executor, workers, ray_address)
    with session(where) if not dry_run else nullcontext():  # Ray's workers start while the driver plans
        if follow:
            _follow(opts, where, json_out, poll, until_step, idle_timeout, settle)
            return
        doc = run(opts, where)
    if opts.durations:
        doc["durations"] = opts.durations
    if json_out:
        output.print_json(doc)
    elif dry_run:
        _print_plan(doc)
    elif doc["up_to_date"]:
        output.log(f"up to date: last step {doc['last_step']} (nothing new to stabilize in {opts.out})")
    else:
        _print_summary(doc)


def schedules_from_flags(f: dict) -> list:
    """The grid (stabilize and sweep alike): --config FILE, or --method and the parameter lists."""
    from bema_cli.durations import resolve_flags
    from bema_cli.stabilize import grid
    from bema_cli.stabilize.grids import grid_from_config

    common = {k: f[k] for k in ("preset", "gamma", "rho", "tau", "phi", "beta_min")}
    if f["config"] is not None:
        flags = {"--method": f["method"], "--kappa": f["kappa"], "--eta": f["eta"], "--window": f["window"],
                 "--schedule": f["schedule"], "--swa-start": f["swa_start"], "--sigma-rel": f["sigma_rel"],
                 "--power-gamma": f["power_gamma"], "--half-life": f.get("half_life")}  # fmt: skip
        given = [flag for flag, v in flags.items() if v is not None]
        if given:
            raise UsageError(f"--config: the grid comes from {f['config']}; drop {given[0]}")
        return grid_from_config(f["config"], **common)

    def numbers(key: str, flag: str, parse, resolved: str | None = None):
        if resolved in spans:  # given as spans of training: already resolved on the run
            return spans[resolved]
        return parse(f[key], flag) if f[key] is not None else None

    methods = parse_str_list(f["method"] or "bema", "--method")
    spans = resolve_flags(f, methods)
    return grid(
        methods,
        numbers("kappa", "--kappa", parse_float_list),
        numbers("eta", "--eta", parse_float_list),
        windows=numbers("window", "--window", parse_int_list, "window"),
        schedules=parse_str_list(f["schedule"], "--schedule") if f["schedule"] is not None else None,
        swa_starts=numbers("swa_start", "--swa-start", parse_int_list, "swa_start"),
        sigma_rels=numbers("sigma_rel", "--sigma-rel", parse_float_list),
        power_gammas=numbers("power_gamma", "--power-gamma", parse_float_list, "half_life"),
        **common,
    )


def _follow(opts, executor_opts, json_out: bool, poll: float, until_step, idle_timeout, settle=None) -> None:
    from bema_cli.stabilize import stabilize
    from bema_cli.stabilize.follow import follow

    if opts.dry_run:
        raise UsageError("--dry-run cannot be combined with --follow")
    if opts.checkpoints is not None:
        raise UsageError("--follow watches a run folder: give CHECKPOINT_DIR, not a list on stdin")

    def emit(o: dict) -> None:  # one line per output, flushed, so `| while read -r line` sees it at once
        if json_out:
            output.print_json(o, indent=None)
        else:
            output.stdout.print(f"{o['run']}  step {o['step']}  {o['path']}", highlight=False)

    def run(o):
        return stabilize(o, executor_opts)

    follow(opts, run, emit, poll=poll, until_step=until_step, idle_timeout=idle_timeout, settle=settle)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


# `bema stabilize --help` groups its options in panels (cli.command applies them), as eval's are.
PANELS = {
    "Stabilizer (the grid: comma lists)": ["method", "kappa", "eta", "gamma", "rho", "tau", "phi", "beta_min", "preset",
                                           "window", "schedule", "swa_start", "sigma_rel", "power_gamma", "config"],
    "What to write": ["final_only", "steps", "out_dtype", "accum_dtype", "max_shard_size", "lora_output", "lora_rank",
                      "keep_last"],
    "Incremental runs and follow mode": ["keep_state", "restart", "fingerprint", "follow", "until_step",
                                         "idle_timeout", "poll", "settle", "allow_gaps"],
    "Safety": ["overwrite", "allow_nonfinite", "cast_base", "dry_run"],
    "Resources and scale-out": ["max_memory", "device", "readers", "executor", "workers", "ray_address"],
}  # fmt: skip
NUMERIC = ("step", "alpha", "beta")  # right-aligned: kept whole on a narrow terminal (output.print_table)


def _weight(x: float | None) -> str:
    """alpha_s or beta_s for a table; '-' where the method has none (NaN: swa/power alpha, a window's both)."""
    return "-" if x is None or x != x else f"{x:.4g}"


def _print_plan(doc: dict) -> None:
    from rich.table import Table

    plan = doc["plan"]
    table = Table(title=f"bema stabilize --dry-run (theta0: {plan['theta0_source']})")
    for col in ("run", "step", "action", "alpha", "beta", "written"):
        table.add_column(col, justify="right" if col in NUMERIC else "left")
    for run in plan["runs"]:
        for e in run["events"]:
            weights = [_weight(e[k]) if e["action"] != "skip" else "" for k in ("alpha", "beta")]
            table.add_row(run["run"], str(e["step"]), e["action"], *weights, "yes" if e["output"] else "")
    output.print_table(table)
    shards = ", ".join(f"{s['file']} ({_gb(s['bytes'])}, {s['tensors']} tensors)" for s in plan["shards"])
    output.stdout.print(f"{len(doc['outputs'])} outputs; shards of each: {shards}")
    output.stdout.print(
        f"would read {_gb(doc['read_bytes'])} and write {_gb(doc['written_bytes'])} "
        f"in {plan['work_units']} work units (--max-memory {output.size(plan['max_memory'])})"
    )
    if doc.get("projection"):
        output.stdout.print(projection_line(doc["projection"]))


def _print_summary(doc: dict) -> None:
    from rich.table import Table

    table = Table(title="bema stabilize")
    for col in ("run", "step", "alpha", "beta", "path"):
        table.add_column(col, justify="right" if col in NUMERIC else "left")
    for o in doc["outputs"]:
        table.add_row(o["run"], str(o["step"]), _weight(o["alpha"]), _weight(o["beta"]), o["path"])
    output.print_table(table)
    rate = doc["read_bytes"] / doc["seconds"] / 1e6 if doc["seconds"] else 0.0
    output.stdout.print(
        f"read {_gb(doc['read_bytes'])}, wrote {_gb(doc['written_bytes'])} in {doc['seconds']:.1f} s ({rate:.0f} MB/s read)"
    )
    if doc.get("stages"):
        output.stdout.print(stages.line(doc["stages"]))
