"""`bema select`: which config and step to ship, with paired bootstrap intervals (bema_cli/select.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from bema_cli import output
from bema_cli.errors import InputError
from bema_cli.eval.targets import SWEEP_SCHEME
from bema_cli.options import JsonOpt, SeedOpt


def select(
    inputs: Annotated[list[str], typer.Argument(help="results.jsonl files, or folders holding them.")],
    metric: Annotated[
        str, typer.Option("--metric", help="loss, or a task: gsm8k, boolq, mmlu_hs (:strict or :flexible).")
    ] = "loss",
    at: Annotated[
        str, typer.Option("--at", help="last (the last evaluated step), a step number, or all (every step).")
    ] = "last",
    holdout: Annotated[
        float | None,
        typer.Option(
            "--holdout",
            help="Pick on this seeded fraction of the items, report every number on the rest (default: pick and report on all).",
        ),
    ] = None,
    resamples: Annotated[int, typer.Option("--resamples", help="Paired bootstrap resamples.")] = 2000,
    seed: SeedOpt = 0,
    write: Annotated[
        str | None,
        typer.Option(
            "--write",
            help="Write the winner (its config at its step) here, through bema stabilize, with its card.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Rank the evaluated configs (vanilla included) on one metric and name the one to ship.

    For each config: its value, the difference to the best and to vanilla at the same step with a paired bootstrap 95% interval over the items (prompts, or held-out loss records), and whether it is statistically tied with the best (the interval of its difference contains 0). --write writes the winner with its model card.
    """
    from bema_cli import report
    from bema_cli import select as sel

    parsed = sel.parse_metric(metric)
    sel.check_flags(at, holdout, resamples)  # instantly, before the results are read
    _, records = report.load(inputs)
    doc = sel.select(records, parsed, at, holdout, resamples, seed)
    if write:
        doc["written"] = write_winner(doc, records, Path(write))
    if json:
        output.print_json(doc)
    else:
        _print(doc)


def write_winner(doc: dict, records: list[dict], out: Path) -> dict:
    """The winner at its step, written by the streaming stabilize engine into OUT (bitwise what
    `bema stabilize --steps STEP` writes for that config), and a card with the selection in its
    model-index."""
    import json

    from bema_cli import card
    from bema_cli.recurrence import Schedule
    from bema_cli.stabilize import Options, stabilize

    winner = doc["winner"]
    path = Path(winner["path"] or "")
    stab = dict(winner.get("stabilizer") or {"method": "vanilla"})
    bema_json = path / "bema.json"
    if str(winner["path"] or "").startswith(SWEEP_SCHEME):  # evaluated by `bema sweep`, never on disk
        raw = [r for r in records if r.get("run") == "vanilla" and r.get("step") == winner["step"]]
        if not raw:
            raise InputError(
                f"{winner['path']}: no vanilla record at step {winner['step']} names the checkpoint it came from"
            )
        source, base = Path(raw[-1]["model_path"]), stab.get("theta0_source")
    elif bema_json.is_file():
        record = json.loads(bema_json.read_text())
        source = Path(record["source_checkpoint"])
        base = record.get("theta0_source")
    else:  # a vanilla checkpoint of the run itself; theta0 is the evaluated base, when there was one
        source = path
        base = next((r.get("model_path") for r in records if r.get("is_base")), None)
        stab = {"method": "vanilla"}
        base = base or "first"  # vanilla is theta_s itself: theta0 only has to exist (no base evaluated)
    if not source.is_dir():
        raise InputError(f"{source}: the winner's source checkpoint is gone; --write needs it (and its run)")
    names = {"schedule": "merge_schedule"}
    keys = ("method", "preset", "kappa", "eta", "gamma", "rho", "tau", "phi", "beta_min", "window",
            "schedule", "swa_start", "sigma_rel", "power_gamma")  # fmt: skip
    params = {names.get(k, k): _number(stab[k]) for k in keys if stab.get(k) is not None}
    if params.get("sigma_rel") is not None:
        params.pop("power_gamma", None)  # derived from sigma_rel, as on the command line
    opts = Options(
        checkpoint_dir=str(source.parent),
        schedules=[Schedule(**params).resolved()],
        out=str(out),
        base=base,
        steps=[winner["step"]],
        accum_dtype=stab.get("accum_dtype", "float32"),
        no_state=True,
    )
    result = stabilize(opts)
    (written,) = [o for o in result["outputs"] if o["step"] == winner["step"]]
    folder = Path(written["path"])
    versus = winner["vs_vanilla"]
    evaluation = [
        {
            "dataset": doc["task"],
            "metric": doc["metric"],
            "value": winner["value"],
            "interval": winner["interval"],
            "vs": f"vs vanilla {_interval(versus)}" if versus else "",
        }
    ]
    record = json.loads((folder / "bema.json").read_text())
    base_model = card.hub_base_model(record["theta0_source"], None)
    (folder / "README.md").write_text(card.card(record, base_model, evaluation=evaluation))
    output.log(f"wrote {folder} ({winner['run']} at step {winner['step']}) with its model card")
    return {"path": str(folder), "run": written["run"], "step": written["step"]}


def _number(value):
    return float(value) if value in ("inf", "-inf") else value


def _interval(d: dict | None) -> str:
    return "" if d is None else f"{d['value']:+.4g} [{d['low']:+.4g}, {d['high']:+.4g}]"


def _print(doc: dict) -> None:
    from rich.table import Table

    direction = "higher" if doc["higher_is_better"] else "lower"
    table = Table(
        title=f"bema select: {doc['metric']} ({direction} is better), at {doc['at']}",
        caption=f"{doc['level']:.0%} paired bootstrap intervals over {doc['selection']['reported_on']} items, "
        f"{doc['resamples']} resamples (seed {doc['seed']}); {doc['selection']['note']}; "
        "tied: the interval of the difference to the best contains 0",
    )
    for col in ("run", "step", "value", "vs best", "vs vanilla", "tied"):
        table.add_column(col, justify="right" if col in ("step", "value") else "left")
    for c in doc["candidates"]:
        value = f"{c['value']:.4g}" if math.isfinite(c["value"]) else "nan"
        best = "best" if (c["run"], c["step"]) == (doc["winner"]["run"], doc["winner"]["step"]) else ""
        table.add_row(
            c["run"], str(c["step"]), value, best or _interval(c["vs_best"]), _interval(c["vs_vanilla"]),
            "yes" if c["tied_with_best"] else "",
        )  # fmt: skip
    output.print_table(table)
    w = doc["winner"]
    where = f" ({w['path']})" if w["path"] and Path(w["path"]).is_dir() else ""
    if str(w["path"] or "").startswith(SWEEP_SCHEME):
        where = " (evaluated in memory by bema sweep: --write OUT writes it)"
    output.stdout.print(f"winner: {w['run']} at step {w['step']}{where}", highlight=False)
