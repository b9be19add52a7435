"""`bema sweep`: parse stabilize's grid flags and eval's protocol flags, call bema_cli.sweep."""

from __future__ import annotations

from bema_cli import output, stages
from bema_cli.commands.eval_options import (
    ForceOpt,
    LogSamplesOpt,
    TasksOpt,
    eval_settings,
)
from bema_cli.commands.flags import (
    EngineFlags,
    EvalFlags,
    ExecutorFlags,
    FollowFlags,
    GridFlags,
    InputFlags,
    WalkFlags,
    with_flags,
)
from bema_cli.options import (
    JsonOpt,
    MethodOpt,
    argument,
    option,
)


@with_flags(
    grid=GridFlags,
    inputs=InputFlags,
    fol=FollowFlags,
    walk=WalkFlags,
    where=ExecutorFlags,
    ev=EvalFlags,
    eng=EngineFlags,
)
def sweep(
    checkpoint_dir: argument(str, help="Training output folder (checkpoint-N, step_N, ... folders)."),
    out: option(str, "--out", "-o", help="Results folder (results.jsonl; no weights are written)."),
    at: option(
        str, "--at", help="Steps to evaluate: all, last, every:N or a comma list (0 = theta0)."
    ) = "all",
    dry_run: option(
        bool,
        "--dry-run",
        help="Project peak memory and wall time (a short probe of this machine), read no checkpoint.",
    ) = False,
    method: MethodOpt = None,
    tasks: TasksOpt = "boolq,gsm8k,mmlu_hs",
    log_samples: LogSamplesOpt = False,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    *,
    grid: GridFlags,
    inputs: InputFlags,
    fol: FollowFlags,
    walk: WalkFlags,
    where: ExecutorFlags,
    ev: EvalFlags,
    eng: EngineFlags,
) -> None:
    """Evaluate a stabilizer grid at chosen steps with no weight file written: each checkpoint is read
    once, every config's average is kept in memory and streamed into one engine (vLLM or transformers).

    Records equal those of `bema stabilize` followed by `bema eval` (same run names and steps, vanilla
    included), so `bema select OUT` picks the config to ship.
    """
    from pathlib import Path

    from bema_cli.eval.evaluate import LIBRARY_LOG
    from bema_cli.eval.results import records_table
    from bema_cli.sweep.run import sweep as run
    from bema_cli.sweep.session import parse_at

    parse_at(at)  # instantly, before any input is read
    evaluation, engine = eval_settings(ev, eng, tasks, out, log_samples, force)
    follow = fol.follow
    schedules, durations = grid.schedules(method, checkpoint_dir, follow=follow)
    opts = walk.options(checkpoint_dir, schedules, str(Path(out) / ".sweep"), durations, inputs)
    if follow and inputs.min_interval is not None:
        from bema_cli.errors import UsageError

        raise UsageError(
            "--min-interval: the thinned set anchors at the last step, which --follow does not know yet"
        )
    pace = fol.pace()
    doc = run(
        opts,
        evaluation,
        engine,
        walk.sweep_options(at, dry_run),
        executor=where.options(),
        follow=pace,
        validated=lambda: output.send_library_output(Path(out) / LIBRARY_LOG),
        notes=_lag_notes,
    )
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
        for note in doc.get("notes", []):
            output.log(f"note: {note}")


def _lag_notes(plan, step: int) -> list[str]:
    """Why an average may lose at the last step evaluated, read off its vector (as ship says it),
    on the plan the sweep walked."""
    from bema_cli.decide.candidate import lag_notes, menu

    try:
        return lag_notes(plan, menu(plan, step), step)
    except KeyError:  # a step the menu does not hold: the notes are not worth an error
        return []
