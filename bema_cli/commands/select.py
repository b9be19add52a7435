"""`bema select`: which config and step to ship, with paired bootstrap intervals (bema_cli/decide/select.py)."""

from __future__ import annotations

import math
from pathlib import Path

from bema_cli import output
from bema_cli.eval.targets import SWEEP_SCHEME
from bema_cli.options import JsonOpt, SeedOpt, argument, option

AllowMissingOpt = option(
    bool,
    "--allow-missing",
    help="Select at a step where some configs have no record (an interrupted run), naming them.",
)
HoldoutOpt = option(
    float | None,
    "--holdout",
    help="Pick on this seeded fraction of the items, report every number on the rest (default: pick and report on all).",
)


def select(
    inputs: argument(list[str], help="results.jsonl files, or folders holding them."),
    metric: option(
        str, "--metric", help="loss, or a task: gsm8k, boolq, mmlu_hs (:strict or :flexible)."
    ) = "loss",
    at: option(
        str,
        "--at",
        help="last (the last step every config has a record at), a step number, or all (every step).",
    ) = "last",
    holdout: HoldoutOpt = None,
    resamples: option(int, "--resamples", help="Paired bootstrap resamples.") = 2000,
    seed: SeedOpt = 0,
    allow_missing: AllowMissingOpt = False,
    write: option(
        str | None,
        "--write",
        help="Write the winner (its config at its step) as this model folder, with its card: its coefficient "
        "vector summed from the checkpoints, as ship writes.",
    ) = None,
    overwrite: option(bool, "--overwrite", help="Replace a model folder bema wrote at --write DIR.") = False,
    json: JsonOpt = False,
) -> None:
    """Rank the evaluated configs (vanilla included) on one metric and name the one to ship.

    For each config: its value, the difference to the winner and to vanilla at the same step with a paired bootstrap 95% interval over the items (prompts, or held-out loss records), an exact McNemar test beside it for yes/no items, and whether it is statistically tied with the best. Ties go to vanilla, then the simplest config, then the later step. --write DIR writes the winner as the model folder DIR, with its model card.
    """
    from bema_cli import report
    from bema_cli.decide import select as sel
    from bema_cli.decide.metric import parse_metric

    parsed = parse_metric(metric)
    sel.check_flags(at, holdout, resamples)  # instantly, before the results are read
    _, records = report.load(inputs)
    doc = sel.select(records, parsed, at, holdout, resamples, seed, allow_missing)
    if write:
        from bema_cli.publish.write import write_winner

        doc["written"] = write_winner(doc, records, Path(write), overwrite)
    if json:
        output.print_json(doc)
    else:
        _print(doc)


def _print(doc: dict) -> None:
    from rich.table import Table

    from bema_cli.decide.verdict import fmt_diff

    direction = "higher" if doc["higher_is_better"] else "lower"
    table = Table(
        title=f"bema select: {doc['metric']} ({direction} is better), at {doc['at']}",
        caption=f"{doc['level']:.0%} paired bootstrap intervals over {doc['selection']['reported_on']} items, "
        f"{doc['resamples']} resamples (seed {doc['seed']}); {doc['selection']['note']}; "
        f"tied: with the best on the pick items; ties: {doc['tie_rule']}",
    )
    for col in ("run", "step", "value", "vs winner", "vs vanilla", "tied"):
        table.add_column(col, justify="right" if col in ("step", "value") else "left")
    for c in doc["candidates"]:
        value = f"{c['value']:.4g}" if math.isfinite(c["value"]) else "nan"
        first = (c["run"], c["step"]) == (doc["winner"]["run"], doc["winner"]["step"])
        table.add_row(
            c["run"],
            str(c["step"]),
            value,
            "winner" if first else fmt_diff(c["vs_best"]),
            fmt_diff(c["vs_vanilla"]),
            "" if first else "yes" if c["tied_with_best"] else "",  # the best is not tied with itself
        )
    output.print_table(table)
    if doc["missing"]:
        output.warn(f"no record at this step of: {', '.join(doc['missing'])} (--allow-missing)")
    w = doc["winner"]
    output.stdout.print(doc["verdict"], highlight=False, markup=False)
    for note in doc.get("notes", []):
        output.stdout.print(f"note: {note}", highlight=False, markup=False)
    where = f"({w['path']})" if w["path"] and Path(w["path"]).is_dir() else ""
    if doc.get("written"):  # --write DIR wrote it: that is where it is now
        where = f"(written to {doc['written']['path']})"
    elif str(w["path"] or "").startswith(SWEEP_SCHEME):
        where = "(evaluated in memory by bema sweep: --write DIR writes it)"
    # vanilla picked by the tie rule is kept, not a winner: an average tied with it may read better
    tied = w["run"] == "vanilla" and bool(w.get("tied_with"))
    what = "kept: vanilla (tied)" if tied else "winner:"
    name = "" if tied else f" {w['run']}"
    output.stdout.print(f"{what}{name} at step {w['step']} {where}".rstrip(), highlight=False, markup=False)
