"""`bema stabilize`: parse flags, call the engine (bema_cli/stabilize/), print a summary or JSON."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import replace

from bema_cli import output, stages
from bema_cli.commands.flags import ExecutorFlags, FollowFlags, GridFlags, InputFlags, with_flags
from bema_cli.errors import UsageError
from bema_cli.io.writer import MAX_SHARD_SIZE
from bema_cli.options import (
    RESOURCES_PANEL,
    JsonOpt,
    MethodOpt,
    OutDirOpt,
    OverwriteOpt,
    argument,
    option,
    parse_int_list,
    parse_size,
)
from bema_cli.stabilize.plan import MAX_MEMORY
from bema_cli.stabilize.project import projection_line

WRITE_PANEL, INCREMENTAL_PANEL = "What to write", "Incremental runs"  # --help panels of its own options


@with_flags(grid=GridFlags, inputs=InputFlags, fol=FollowFlags, where=ExecutorFlags)
def stabilize(
    checkpoint_dir: argument(
        str,
        help="Training output folder (checkpoint-N, step_N, step-N, global_stepN or iter_N folders), "
        "or - to read 'STEP PATH' lines from stdin.",
    ),
    out: OutDirOpt,
    base: option(
        str | None,
        "--base",
        help="theta0: a model folder, a Hub repo id, or 'first' (default: checkpoint-0, else config _name_or_path).",
    ) = None,
    method: MethodOpt = None,
    max_memory: option(
        str,
        "--max-memory",
        help="Working-set budget (e.g. 2GiB); tensors are chunked to fit.",
        rich_help_panel=RESOURCES_PANEL,
    ) = f"{MAX_MEMORY // 1024**3}GiB",
    max_shard_size: option(
        str, "--max-shard-size", help="Largest output shard (e.g. 5GB).", rich_help_panel=WRITE_PANEL
    ) = f"{MAX_SHARD_SIZE // 10**9}GB",
    device: option(
        str,
        "--device",
        help="auto (the device projected faster for this grid on this machine; said on stderr and in --json), cpu or cuda.",
        rich_help_panel=RESOURCES_PANEL,
    ) = "auto",
    readers: option(
        int | None,
        "--readers",
        min=1,
        max=64,
        help="Threads reading checkpoints ahead of the compute (default: 2, half the cores up to 4).",
        rich_help_panel=RESOURCES_PANEL,
    ) = None,
    out_dtype: option(
        str | None,
        "--out-dtype",
        help="float32, bfloat16, float16 (default: each tensor's input dtype).",
        rich_help_panel=WRITE_PANEL,
    ) = None,
    final_only: option(
        bool,
        "--final-only",
        help="Write only the last processed step of each run.",
        rich_help_panel=WRITE_PANEL,
    ) = False,
    steps: option(
        str | None, "--steps", help="Write only these steps, e.g. 400,800.", rich_help_panel=WRITE_PANEL
    ) = None,
    dry_run: option(
        bool, "--dry-run", help="Print the plan (steps, alpha/beta, bytes, shards); write nothing."
    ) = False,
    json_out: JsonOpt = False,
    overwrite: OverwriteOpt = False,
    lora_output: option(
        str,
        "--lora-output",
        help="LoRA runs: merged (full model folders) or adapter (PEFT adapters of rank --lora-rank).",
        rich_help_panel=WRITE_PANEL,
    ) = "merged",
    lora_rank: option(
        int | None,
        "--lora-rank",
        help="Rank of adapter outputs (truncated SVD; default: the training r).",
        rich_help_panel=WRITE_PANEL,
    ) = None,
    restart: option(
        bool,
        "--restart",
        help="Ignore OUT's saved state for these runs and recompute them from theta0.",
        rich_help_panel=INCREMENTAL_PANEL,
    ) = False,
    keep_state: option(
        bool | None,
        "--state/--no-state",
        help="Write OUT/.bema-state so a later call continues the run [default: on, off with "
        "--final-only]; --no-state saves one model-size write per EMA track.",
        show_default=False,
        rich_help_panel=INCREMENTAL_PANEL,
    ) = None,
    keep_last: option(
        int | None,
        "--keep-last",
        help="Keep only the K newest outputs of each run (like save_total_limit).",
        rich_help_panel=WRITE_PANEL,
    ) = None,
    fingerprint: option(
        str,
        "--fingerprint",
        help="How consumed checkpoints are recorded in OUT's state: full (a digest of every byte, xxh3_128) or sampled "
        "(header, first and last 64 KiB; cheaper on slow storage).",
        rich_help_panel=INCREMENTAL_PANEL,
    ) = "full",
    *,
    grid: GridFlags,
    inputs: InputFlags,
    fol: FollowFlags,
    where: ExecutorFlags,
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
    from bema_cli.io.checkpoints import read_checkpoint_list
    from bema_cli.stabilize import Options, Output
    from bema_cli.stabilize import stabilize as run
    from bema_cli.stabilize.executors import session

    checkpoints = None
    if checkpoint_dir == "-":
        if sys.stdin.isatty():
            raise UsageError(
                "-: reads 'STEP PATH' lines from stdin, which is a terminal here; pipe or redirect a list in (bema stabilize - --out OUT < steps.txt)"
            )
        checkpoints = read_checkpoint_list(sys.stdin.read())

    follow = fol.follow
    schedules, durations = grid.schedules(method, checkpoint_dir, checkpoints, follow)
    opts = Options(
        checkpoint_dir=checkpoint_dir,
        schedules=schedules,
        out=out,
        base=base,
        max_memory=parse_size(max_memory, "--max-memory"),
        device=device,
        readers=readers,
        out_dtype=out_dtype,
        final_only=final_only,
        steps=parse_int_list(steps, "--steps") if steps is not None else None,
        checkpoints=checkpoints,
        durations=durations or None,
        write=Output(
            max_shard_size=parse_size(max_shard_size, "--max-shard-size"),
            dry_run=dry_run,
            overwrite=overwrite,
            lora_output=lora_output,
            lora_rank=lora_rank,
            restart=restart,
            keep_last=keep_last,
            fingerprint=fingerprint,
            no_state=None if keep_state is None else not keep_state,
        ),
        **inputs.options(),
    )
    if inputs.min_interval is not None:
        if keep_state or follow:
            raise UsageError(
                "--min-interval: the thinned set anchors at the last step, so a continued run would "
                "average another one: drop --keep-state/--follow"
            )
        opts = replace(opts, write=replace(opts.write, no_state=True))
    if fingerprint not in ("full", "sampled"):
        raise UsageError(f"--fingerprint: choose full or sampled, got {fingerprint!r}")
    if keep_last is not None and keep_last < 1:
        raise UsageError(f"--keep-last: must be >= 1, got {keep_last}")
    if follow and keep_state is False:
        raise UsageError("--no-state: --follow continues from the state; drop one of them")
    if follow:
        # every round continues the last one's state
        opts = replace(opts, write=replace(opts.write, no_state=False))
    pace = fol.pace()
    executor = where.options()
    with session(executor) if not dry_run else nullcontext():  # Ray's workers start while the driver plans
        if pace is not None:
            _follow(opts, executor, json_out, pace)
            return
        doc = run(opts, executor)
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


def _follow(opts, executor_opts, json_out: bool, pace) -> None:
    from bema_cli.stabilize import stabilize
    from bema_cli.stabilize.follow import follow

    if opts.write.dry_run:
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

    follow(opts, run, emit, pace)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


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
