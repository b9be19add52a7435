"""`bema eval` and `bema rescore`: thin wrappers over bema_cli.eval.evaluate."""

from __future__ import annotations

from bema_cli import output, stages
from bema_cli.commands.eval_options import (
    DEFAULT_OUT,
    BaseOpt,
    DataParallelSizeOpt,
    EnforceEagerOpt,
    ForceOpt,
    LogSamplesOpt,
    OutOpt,
    TasksOpt,
    TensorParallelSizeOpt,
    VerifySwapOpt,
    eval_settings,
)
from bema_cli.commands.flags import EngineFlags, EvalFlags, ExecutorFlags, with_flags
from bema_cli.options import JsonOpt, argument, option


@with_flags(ev=EvalFlags, eng=EngineFlags, where=ExecutorFlags)
def evaluate(
    inputs: argument(list[str] | None, help="Checkpoint folders, bema stabilize outputs or OUT dirs.") = None,
    tasks: TasksOpt = "boolq,gsm8k,mmlu_hs",
    out: OutOpt = None,
    base: BaseOpt = None,
    tensor_parallel_size: TensorParallelSizeOpt = 1,
    data_parallel_size: DataParallelSizeOpt = 1,
    enforce_eager: EnforceEagerOpt = False,
    verify_swap: VerifySwapOpt = False,
    log_samples: LogSamplesOpt = False,
    force: ForceOpt = False,
    with_vanilla: option(
        bool,
        "--with-vanilla",
        help="Also evaluate the run's own checkpoint at every output step of a stabilize OUT folder, so bema report compares each average with vanilla at the same step.",
    ) = False,
    json_: JsonOpt = False,
    *,
    ev: EvalFlags,
    eng: EngineFlags,
    where: ExecutorFlags,
) -> None:
    """Evaluate checkpoints with the paper's protocol: BoolQ, GSM8K, MMLU-HS (50 samples/prompt) and held-out loss."""
    from pathlib import Path

    from bema_cli.eval.evaluate import LIBRARY_LOG, eval_document
    from bema_cli.eval.results import records_table

    if tasks.strip() == "list":
        from bema_cli.eval.tasks import task_list

        rows = task_list()
        if json_:
            output.print_json(rows)
        else:
            for row in rows:
                output.stdout.print(f"{row['task']:<16} {row['description']}", highlight=False, markup=False)
        return
    if out is None:  # ten minutes of evaluation must never end in nothing kept
        out = DEFAULT_OUT
        output.log(f"results go to ./{DEFAULT_OUT}/ (the default; --out DIR chooses)")
    config, engine = eval_settings(
        ev,
        eng,
        tasks,
        out,
        log_samples,
        force,
        tensor_parallel_size,
        data_parallel_size,
        enforce_eager,
        verify_swap,
    )
    if with_vanilla:
        from bema_cli.eval.targets import vanilla_of

        inputs = [*(inputs or []), *vanilla_of(inputs or [])]
    doc = eval_document(
        inputs or [],
        base,
        config,
        engine,
        where.options(),
        validated=lambda: output.send_library_output(Path(out) / LIBRARY_LOG),
    )
    if json_:
        output.print_json(doc)
    else:
        output.print_table(records_table(doc["records"]))
    if doc["stages"]:
        output.log(f"{stages.line(doc['stages'])}; peak RSS {output.size(doc['memory']['peak_rss'])}")


def rescore(
    samples: argument(str, help="samples.jsonl written by bema eval --log-samples."),
    results: option(
        str | None, "--results", help="results.jsonl with the records' provenance (default: next to SAMPLES)."
    ) = None,
    out: option(str | None, "--out", "-o", help="Write the new records to this jsonl file.") = None,
    json_: JsonOpt = False,
) -> None:
    """Recompute the scores of logged samples with the current answer-extraction rules (no generation)."""
    from pathlib import Path

    from bema_cli.eval.rescore import rescore as rescore_samples
    from bema_cli.eval.results import records_table, write_jsonl_atomic

    records = rescore_samples(samples, results)
    if out is not None:
        write_jsonl_atomic(Path(out), records)
        output.log(f"wrote {len(records)} records to {out}")
    if json_:
        output.print_json(records)
    else:
        output.print_table(records_table(records, title="bema rescore"))
