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
from bema_cli.output import warn

REQUIRED = ("run", "step", "task", "metrics")
LOWER_IS_BETTER = ("loss", "perplexity", "ppl", "error", "failure")  # substrings of a metric name
PANEL_W, PANEL_H, LEGEND_W = 5.0, 3.8, 2.5  # inches: the figure is (PANEL_W*cols + LEGEND_W) x PANEL_H*rows
MAX_COLS = 3


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
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise InputError(f"{where}: 'step' must be a non-negative integer or null, got {step!r}")
        if not isinstance(record["metrics"], dict):
            raise InputError(f"{where}: 'metrics' must be an object")
        records.append({**record, "_where": where})
    return records


def load(inputs: list[str]) -> tuple[list[Path], list[dict]]:
    files = find_results(inputs)
    records = [r for f in files for r in read_records(f)]
    if not records:
        raise InputError(f"no result records in {', '.join(map(str, files))}")
    return files, records


# -- summarising ----------------------------------------------------------------------------------
def higher_is_better(metric: str) -> bool:
    return not any(word in metric.lower() for word in LOWER_IS_BETTER)


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
    for rec in records:
        run, task, step = str(rec["run"]), str(rec["task"]), rec["step"]
        if step is None:
            for metric in headline_metrics(rec["metrics"]):
                value, se = _number(rec["metrics"][metric]), _number(rec["metrics"][f"{metric}_stderr"])
                if math.isfinite(value):
                    references.setdefault((task, metric), {})[reference_label(rec)] = {
                        "value": value,
                        "stderr": se,
                    }
            continue
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
            metric, {"higher_is_better": higher_is_better(metric), "runs": {}}
        )
        steps = list(series)
        values, errors = [series[s][0] for s in steps], [series[s][1] for s in steps]
        sign = 1.0 if entry["higher_is_better"] else -1.0
        best = max(range(len(steps)), key=lambda i: (sign * values[i], -steps[i]))  # earliest of equal bests
        entry["runs"][run] = {
            "steps": steps,
            "values": values,
            "stderr": errors,
            "final": {"step": steps[-1], "value": values[-1], "stderr": errors[-1]},
            "best": {"step": steps[best], "value": values[best], "stderr": errors[best]},
            "stabilizer": stabilizers.get(run, {}),
        }
    for (task, metric), refs in sorted(references.items()):
        entry = summary.setdefault(task, {}).setdefault(
            metric, {"higher_is_better": higher_is_better(metric), "runs": {}}
        )
        entry["references"] = refs
    return summary


def build(inputs: list[str]) -> dict:
    """The `--json` document: inputs, record count and the per-task summary."""
    files, records = load(inputs)
    summary = summarize(records)
    if not summary:
        raise InputError(f"no headline metric (X with X_stderr) with a value in {len(records)} records")
    return {
        "bema_version": __version__,
        "inputs": [str(f) for f in files],
        "n_records": len(records),
        "tasks": summary,
    }


# -- presenting -----------------------------------------------------------------------------------
def _fmt(value: float, se: float) -> str:
    return f"{value:.4g}" + ("" if math.isnan(se) else f" ± {se:.2g}")


def tables(doc: dict) -> list:
    """One rich table per task and headline metric: final and best value per run (best final in bold)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    out = []
    for task, metrics in doc["tasks"].items():
        for metric, entry in metrics.items():
            runs = entry["runs"]
            sign = 1.0 if entry["higher_is_better"] else -1.0
            top = max(runs, key=lambda r: sign * runs[r]["final"]["value"], default=None)
            vanilla = runs.get("vanilla", {}).get("final", {}).get("value")
            direction = "higher" if entry["higher_is_better"] else "lower"
            table = Table(
                title=f"{task}: {metric} ({direction} is better)",
                caption="n: evaluated steps; final: at the last step; best: over all steps, reached at 'at'",
                box=box.SIMPLE_HEAD,
            )
            for col in ("run", "n", "step", "final", "vs vanilla", "best", "at"):
                table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
            for run, r in runs.items():
                final = _fmt(r["final"]["value"], r["final"]["stderr"])
                delta = "" if vanilla is None or run == "vanilla" else f"{r['final']['value'] - vanilla:+.3g}"
                best = _fmt(r["best"]["value"], r["best"]["stderr"])
                shown = Text(final, style="bold") if run == top else final
                table.add_row(
                    run,
                    str(len(r["steps"])),
                    str(r["final"]["step"]),
                    shown,
                    delta,
                    best,
                    str(r["best"]["step"]),
                )
            for label, ref in entry.get("references", {}).items():  # step-less models: one value, no curve
                value = _fmt(ref["value"], ref["stderr"])
                delta = "" if vanilla is None else f"{ref['value'] - vanilla:+.3g}"
                table.add_row(f"{label} (no step)", "1", "-", value, delta, value, "-")
            out.append(table)
    return out


def figure_inches(panels: int) -> tuple[float, float]:
    """Size of the report figure: a grid of at most MAX_COLS panels per row, plus the legend column."""
    cols = min(MAX_COLS, panels)
    rows = math.ceil(panels / cols)
    return PANEL_W * cols + LEGEND_W, PANEL_H * rows


SCORINGS = ("flexible", "strict", "both")


def plotted(metric: str, scoring: str) -> bool:
    """Generation tasks record accuracy_strict and accuracy_flexible; the plot shows one unless 'both'."""
    other = {"flexible": "_strict", "strict": "_flexible"}.get(scoring)
    return other is None or not metric.endswith(other)


def plot(doc: dict, path: str, scoring: str = "flexible") -> None:
    """One panel per task/metric: value vs training step, one line per run, stderr band, vanilla dashed.

    `scoring` picks which accuracy of the generation tasks is drawn (flexible by default: see
    docs/eval-protocol.md); other metrics (loss, lm-eval metrics) are always drawn.
    """
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.lines import Line2D

    from bema_cli import figures

    panels = [
        (task, metric, entry)
        for task, metrics in doc["tasks"].items()
        for metric, entry in metrics.items()
        if plotted(metric, scoring)
    ]
    refs = {label for *_, e in panels for label in e.get("references", {})}
    all_runs = sorted({run for *_, e in panels for run in e["runs"]} | refs, key=run_order)
    palette = colormaps["tab10" if len(all_runs) <= 10 else "tab20"]
    colors = {run: palette(i % palette.N) for i, run in enumerate(r for r in all_runs if r != "vanilla")}
    colors["vanilla"] = "black"
    fig = figures.new_figure(*figure_inches(len(panels)))
    cols = min(MAX_COLS, len(panels))
    axes = fig.subplots(math.ceil(len(panels) / cols), cols, squeeze=False).ravel()
    for ax, (task, metric, entry) in zip(axes, panels, strict=False):
        for run, r in entry["runs"].items():
            x, y, se = np.array(r["steps"]), np.array(r["values"]), np.array(r["stderr"], dtype=float)
            dashed = run == "vanilla"
            ax.plot(x, y, color=colors[run], ls="--" if dashed else "-", marker="o", ms=3, lw=1.6, label=run)
            ok = np.isfinite(se)
            if ok.any():
                ax.fill_between(x[ok], (y - se)[ok], (y + se)[ok], color=colors[run], alpha=0.15, lw=0)
        for label, ref in entry.get("references", {}).items():  # a step-less model: a horizontal line
            ax.axhline(ref["value"], color=colors[label], ls=":", lw=1.4)
        arrow = "higher" if entry["higher_is_better"] else "lower"
        name = task if metric == task else f"{task}\n{metric}"
        ax.set_title(f"{name} ({arrow} is better; band: ±1 s.e.)", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    handles = [
        Line2D([], [], color=colors[r], ls=":", label=f"{r} (no step)")
        if r in refs
        else Line2D([], [], color=colors[r], ls="--" if r == "vanilla" else "-", marker="o", ms=3, label=r)
        for r in all_runs
    ]
    fig.legend(handles=handles, loc="outside right upper", title="run", ncols=1 if len(all_runs) <= 16 else 2)
    figures.save(fig, path, "--plot")
