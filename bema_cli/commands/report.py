"""`bema report`: results.jsonl from `bema eval` -> tables per task, JSON, and curves."""

from __future__ import annotations

from bema_cli import output
from bema_cli.errors import UsageError
from bema_cli.options import JsonOpt, argument, option


def report(
    inputs: argument(list[str], help="results.jsonl files, or folders holding them (searched below)."),
    plot: option(
        str | None, "--plot", help="Write metric-vs-step curves, one panel per task/metric, to this PNG."
    ) = None,
    scoring: option(
        str,
        "--scoring",
        help="Which generation-task accuracy --plot draws: flexible (default), strict or both. Tables show both.",
    ) = "flexible",
    theta0: option(
        bool,
        "--theta0/--no-theta0",
        help="--plot: draw the base model's points (step 0), or leave them out (its loss can dwarf the rest).",
    ) = True,
    json: JsonOpt = False,
) -> None:
    """Tables and curves from `bema eval` results: per task, each run's final value and its best value and step.

    Records are grouped by run (vanilla, ema-k..., bema-k...-e...) and ordered by training step. A metric X with an X_stderr companion (accuracy, loss) is reported; best = highest accuracy / lowest loss (lm-eval metrics: lm-eval's own higher_is_better); "vs vanilla" compares at the same step. --plot draws one panel per task: metric vs step, a line per run with a +-1 standard-error band, vanilla dashed, one colour per run in every figure.
    """
    from bema_cli import figures, report_plot
    from bema_cli import report as rep

    if scoring not in report_plot.SCORINGS:
        raise UsageError(f"--scoring: {scoring!r} is not one of {', '.join(report_plot.SCORINGS)}")
    if plot is not None:
        figures.check_target(plot, "--plot")
    shipped = rep.ship_record(inputs) if plot is None else None
    if shipped is not None:  # a model folder `bema ship` wrote: its decision, every row on the same items
        doc, decision = shipped
        if json:
            output.print_json(doc)
            return
        output.print_table(rep.ship_table(decision))
        for line in decision.lines():
            output.stdout.print(line, highlight=False, markup=False)
        return
    doc = rep.build(inputs)
    doc["plot"] = plot
    if plot:
        report_plot.plot(doc, plot, scoring, theta0)
        output.log(f"wrote {plot}")
    if json:
        output.print_json(doc)
        return
    for table in rep.tables(doc):
        output.print_table(table)
    from bema_cli.stabilize.motion import describe

    for path, record in doc["motion"].items():  # a sweep's: can averaging help here?
        output.log(f"{path}: {describe(record.get('motion_verdict'))}")
