"""Results of `bema eval` -> per-task tables, a JSON summary, and curves (the paper's Fig. 1b/1c).

Input records follow the results.jsonl contract (docs/design.md): one JSON object per line with
"run", "step", "task" and "metrics". A metric X with an "X_stderr" companion is a headline metric:
it gets a table, a JSON entry and a plot panel. Records are grouped by (task, metric, run) and
ordered by step; `--base` records (step 0, "is_base") are the start of every curve.
No printing here: the command turns the summary into a table, JSON or a figure.
"""

from __future__ import annotations

import math
from pathlib import Path

from bema_cli import __version__
from bema_cli.errors import InputError
from bema_cli.eval.results import read_jsonl
from bema_cli.io.checkpoints import read_json
from bema_cli.output import warn
from bema_cli.stabilize import motion

REQUIRED = ("run", "step", "task", "metrics")
# The direction of bema's own headline metrics; an lm_eval: record carries lm-eval's own
# `higher_is_better` table (per task, per metric), which is used as it is.
BEMA_HIGHER_IS_BETTER = {
    "loss": False,
    "accuracy_strict": True,
    "accuracy_flexible": True,
    "accuracy": True,
}  # "accuracy": bema 0.1
MAX_STEP = 2**53  # steps are plotted as float64: larger ones would be rounded (and 10**30 overflows)


# -- reading ----------------------------------------------------------------------------------
def find_results(inputs: list[str]) -> list[Path]:
    """results.jsonl files named directly, or found in (sub)folders; each file once, in input order."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = (
                [path / "results.jsonl"]
                if (path / "results.jsonl").is_file()
                else sorted(path.rglob("results.jsonl"))
            )
            if not found:
                raise InputError(f"{path}: no results.jsonl in this folder or below it")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"{path}: no such file or directory")
    return list(dict.fromkeys(p.resolve() for p in files))


def read_records(path: Path) -> list[dict]:
    """Every record of one results.jsonl, checked. Read as `bema eval` and `bema rescore` read it
    (eval.results.read_jsonl: file:line of bad JSON; a torn final line, what a crash mid-append
    leaves, skipped with a warning and left in place: report never writes its inputs)."""
    records = []
    for number, record in enumerate(read_jsonl(path, skip_torn=True), start=1):
        where = f"{path}, record {number}"
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise InputError(f"{where}: no {', '.join(map(repr, missing))}")
        step = record["step"]
        if step is not None and (
            not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP
        ):
            raise InputError(f"{where}: 'step' must be an integer in [0, 2**53) or null, got {step!r}")
        if not isinstance(record["metrics"], dict):
            raise InputError(f"{where}: 'metrics' must be an object")
        records.append({**record, "_where": where, "_folder": str(path.parent)})
    return records


def load(inputs: list[str]) -> tuple[list[Path], list[dict]]:
    files = find_results(inputs)
    records = [r for f in files for r in read_records(f)]
    if not records:
        raise InputError(f"no result records in {', '.join(map(str, files))}")
    return files, records


# -- summarising ----------------------------------------------------------------------------------
def higher_is_better(record: dict, metric: str) -> bool | None:
    """Whether a larger `metric` is better, as the record's producer says: lm-eval's table for an
    lm_eval: task ("exact_match[strict-match]" looks up "exact_match"; a group's aggregate takes its
    subtasks' shared answer), bema's own table otherwise; None when nobody says (no best is picked)."""
    lm_eval = record.get("lm_eval")
    if isinstance(lm_eval, dict):
        table = lm_eval.get("higher_is_better")
        table = table if isinstance(table, dict) else {}
        name = metric.removesuffix("_stderr").split("[", 1)[0]
        own = table.get(lm_eval.get("task"))
        if isinstance(own, dict) and isinstance(own.get(name), bool):
            return own[name]
        answers = {v.get(name) for v in table.values() if isinstance(v, dict)} - {None}
        return answers.pop() if len(answers) == 1 and isinstance(next(iter(answers)), bool) else None
    return BEMA_HIGHER_IS_BETTER.get(metric)


def headline_metrics(metrics: dict) -> list[str]:
    """Metrics X with an X_stderr companion (numbers or null)."""
    return [k for k in metrics if f"{k}_stderr" in metrics and not k.endswith("_stderr")]


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def run_order(run: str) -> tuple[int, str]:
    """vanilla first, then the stabilized runs by name."""
    return (0 if run == "vanilla" else 1, run)


def reference_label(record: dict) -> str:
    """A step-less model (not checkpoint-<s>): its `label`, else its folder's name."""
    return str(record.get("label") or Path(str(record.get("model_path") or "model")).name)


def summarize(records: list[dict]) -> dict:
    """{task: {metric: {"higher_is_better", "runs": {run: {steps, values, stderr, final, best, stabilizer}},
    "references": {label: {value, stderr}}}}}: records without a step are references, not curve points."""
    points: dict[tuple[str, str, str], dict[int, tuple[float, float]]] = {}
    references: dict[tuple[str, str], dict[str, dict]] = {}
    stabilizers: dict[str, dict] = {}
    directions: dict[tuple[str, str], bool | None] = {}
    theta0_steps: set[int] = set()  # the steps of base-model (theta0) points
    for rec in records:
        run, task, step = str(rec["run"]), str(rec["task"]), rec["step"]
        for metric in headline_metrics(rec["metrics"]):
            if directions.get((task, metric)) is None:
                directions[(task, metric)] = higher_is_better(rec, metric)
        if step is None:
            for metric in headline_metrics(rec["metrics"]):
                value, se = _number(rec["metrics"][metric]), _number(rec["metrics"][f"{metric}_stderr"])
                if math.isfinite(value):
                    references.setdefault((task, metric), {})[reference_label(rec)] = {
                        "value": value,
                        "stderr": se,
                    }
            continue
        if rec.get("is_base"):
            theta0_steps.add(step)
        if not rec.get("is_base") or run not in stabilizers:
            stabilizers[run] = rec.get("stabilizer") or {}
        for metric in headline_metrics(rec["metrics"]):
            series = points.setdefault((task, metric, run), {})
            if step in series:
                warn(
                    f"{rec['_where']}: a second {task}/{metric} record for run {run} at step {step}; keeping this one"
                )
            value, se = _number(rec["metrics"][metric]), _number(rec["metrics"][f"{metric}_stderr"])
            series[step] = (value, se)
    summary: dict[str, dict] = {}
    for task, metric, run in sorted(points, key=lambda k: (k[0], k[1], run_order(k[2]))):
        series = {s: v for s, v in sorted(points[(task, metric, run)].items()) if math.isfinite(v[0])}
        if not series:
            continue
        entry = summary.setdefault(task, {}).setdefault(
            metric, {"higher_is_better": directions.get((task, metric)), "runs": {}}
        )
        steps = list(series)
        values, errors = [series[s][0] for s in steps], [series[s][1] for s in steps]
        best = _best_index(values, steps, entry["higher_is_better"])
        entry["runs"][run] = {
            "steps": steps,
            "values": values,
            "stderr": errors,
            "final": {"step": steps[-1], "value": values[-1], "stderr": errors[-1]},
            "best": None
            if best is None
            else {"step": steps[best], "value": values[best], "stderr": errors[best]},
            "stabilizer": stabilizers.get(run, {}),
            "theta0_step": next((s for s in steps if s in theta0_steps), None),
        }
    for metrics in summary.values():
        for entry in metrics.values():
            _versus_vanilla(entry["runs"])
    for (task, metric), refs in sorted(references.items()):
        entry = summary.setdefault(task, {}).setdefault(
            metric, {"higher_is_better": directions.get((task, metric)), "runs": {}}
        )
        entry["references"] = refs
    return summary


def _versus_vanilla(runs: dict) -> None:
    """Each run's "vs_vanilla": value - vanilla's value at the SAME step (the run's final step when
    vanilla has it, else the last step both have), or None when they share no step."""
    vanilla = runs.get("vanilla")
    at_step = dict(zip(vanilla["steps"], vanilla["values"], strict=True)) if vanilla else {}
    for run, r in runs.items():
        if run == "vanilla":
            continue
        common = [s for s in r["steps"] if s in at_step]
        if not common:
            r["vs_vanilla"] = None
            continue
        step = common[-1]
        value = r["values"][r["steps"].index(step)]
        r["vs_vanilla"] = {
            "step": step,
            "delta": value - at_step[step],
            "final_step": step == r["final"]["step"],
        }


def _best_index(values: list[float], steps: list[int], higher: bool | None) -> int | None:
    """The best point (the earliest of equal bests); None when the metric's direction is unknown."""
    if higher is None:
        return None
    sign = 1.0 if higher else -1.0
    return max(range(len(steps)), key=lambda i: (sign * values[i], -steps[i]))


def build(inputs: list[str]) -> dict:
    """The `--json` document: inputs, record count and the per-task summary."""
    files, records = load(inputs)
    summary = summarize(records)
    if not summary:
        raise InputError(f"no headline metric (X with X_stderr) with a value in {len(records)} records")
    motions = {str(f): read_json(f.parent / motion.FILE) for f in files if (f.parent / motion.FILE).is_file()}
    return {
        "bema_version": __version__,
        "inputs": [str(f) for f in files],
        "n_records": len(records),
        "tasks": summary,
        "motion": motions,  # a sweep's motion.json beside its results: how far each checkpoint moved
    }


# -- presenting -----------------------------------------------------------------------------------
def _fmt(value: float, se: float) -> str:
    return f"{value:.4g}" + ("" if math.isnan(se) else f" ± {se:.2g}")


def direction(higher: bool | None) -> str:
    return {True: "higher is better", False: "lower is better", None: "direction unknown: no best picked"}[
        higher
    ]


def tables(doc: dict) -> list:
    """One rich table per task and headline metric: final and best value per run (best final in bold);
    "vs vanilla" is taken at the same step ("@N" when that is not the run's final step)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    out = []
    for task, metrics in doc["tasks"].items():
        for metric, entry in metrics.items():
            runs, higher = entry["runs"], entry["higher_is_better"]
            top = None
            if higher is not None:
                sign = 1.0 if higher else -1.0
                top = max(runs, key=lambda r: sign * runs[r]["final"]["value"], default=None)
            table = Table(
                title=f"{task}: {metric} ({direction(higher)})",
                caption="n: evaluated steps; final: at the last step; vs vanilla: at the same step; "
                "best: over all steps, @ the step it was reached",
                box=box.SIMPLE_HEAD,
            )
            for col in ("run", "n", "step", "final", "vs vanilla", "best"):
                table.add_column(col, justify="left" if col == "run" else "right")
            for run, r in runs.items():
                final = _fmt(r["final"]["value"], r["final"]["stderr"])
                best = (
                    ""
                    if r["best"] is None
                    else f"{_fmt(r['best']['value'], r['best']['stderr'])} @{r['best']['step']}"
                )
                table.add_row(
                    run,
                    str(len(r["steps"])),
                    str(r["final"]["step"]),
                    Text(final, style="bold") if run == top else final,
                    _delta(run, r.get("vs_vanilla")),
                    best,
                )
            vanilla = runs.get("vanilla")
            for label, ref in entry.get("references", {}).items():  # step-less models: one value, no curve
                value = _fmt(ref["value"], ref["stderr"])
                table.add_row(f"{label} (no step)", "1", "-", value, "", value)
            if vanilla is None and len(runs) > 0:
                table.caption += "; no vanilla run in these records"
            out.append(table)
    return out


def _delta(run: str, versus: dict | None) -> str:
    if run == "vanilla":
        return ""
    if versus is None:
        return "no same step"
    return f"{versus['delta']:+.3g}" + ("" if versus["final_step"] else f" @{versus['step']}")


# -- a shipped model folder: the decision's own table ----------------------------------------------
def ship_record(inputs: list[str]):
    """The decision of `bema report DIR` when DIR is one model folder `bema ship` wrote (else None),
    read from its sealed ship.json: the decision's table is what a reader wants there, not the
    race's partial records. Returns (the document, its Decision)."""
    if len(inputs) != 1:
        return None
    from bema_cli.decide.outcome import Decision
    from bema_cli.publish.records import check_sealed

    path = Path(inputs[0]) / ".bema-ship" / "ship.json"
    if not path.is_file():
        return None
    # what ship itself refuses to answer from (edited or unsealed records), report refuses to print
    check_sealed(path.parent, "bema report prints only a decision as bema sealed it")
    doc = read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("select"), dict):
        raise InputError(f"{path}: not a ship record (no decision); report its records' folder instead")
    try:
        return doc, Decision.of(doc)  # every field the views read, read once before anything is printed
    except (KeyError, TypeError, ValueError, IndexError, StopIteration) as exc:
        raise InputError(f"{path}: not a ship record bema wrote ({type(exc).__name__}: {exc})") from None


def ship_table(decision):
    """Every finalist on the same report items: its value, 95% interval and difference to vanilla,
    what became of each (shipped, blocked by a guard, fitted) marked."""
    from rich.table import Table

    from bema_cli.decide.verdict import fmt_diff

    d = decision
    table = Table(
        title=f"bema ship: {d.metric} at step {d.step} ({direction(d.higher_is_better)}), every row "
        f"on the same {d.report_items} report items"
    )
    for col in ("run", "value", "95% interval", "vs vanilla", ""):
        table.add_column(col, justify="right" if col == "value" else "left")
    for r in d.rows:
        lo_hi = f"{r.interval[0]:.4g} to {r.interval[1]:.4g}" if r.interval else ""
        table.add_row(r.run, f"{r.value:.4g}", lo_hi, fmt_diff(r.vs_vanilla), d.mark(r))
    return table
