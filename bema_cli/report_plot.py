"""`bema report --plot`: one panel per task/metric, value vs training step, one line per run.

Kept apart from report.py (which reads and summarises): this is the drawing. A task whose
accuracy never rises above chance is marked so in its panel: the curves there say nothing.
"""

from __future__ import annotations

import math
import textwrap

from bema_cli.report import direction, run_order

PANEL_W, PANEL_H, LEGEND_W = 5.0, 3.8, 2.5  # inches: the figure is (PANEL_W*cols + LEGEND_W) x PANEL_H*rows
MAX_COLS = 3


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


# Axis labels in words. A metric not named here is spelled out from its key ("acc_norm" -> "acc norm").
METRIC_LABELS = {
    "loss": "loss (nats/token)",
    "accuracy_flexible": "accuracy, flexible scoring (share of samples)",
    "accuracy_strict": "accuracy, strict scoring (share of samples)",
    "acc": "accuracy",
    "acc_norm": "length-normalized accuracy",
    "exact_match": "exact match (share of items)",
    "word_perplexity": "word perplexity",
    "byte_perplexity": "byte perplexity",
    "bits_per_byte": "bits per byte",
    "brier_score": "Brier score",
    "f1": "F1",
    "mcc": "Matthews correlation",
}
TASK_LABELS = {"loss": "held-out", "train_loss": "training-data"}


def axis_label(task: str, metric: str) -> str:
    name, _, rest = metric.partition("[")
    words = METRIC_LABELS.get(name, name.replace("_", " "))
    words = f"{TASK_LABELS[task]} {words}" if task in TASK_LABELS else words
    return f"{words}, {rest.rstrip(']')}" if rest else words


def log_scale(task: str, metric: str) -> bool:
    """Losses and perplexities span orders of magnitude between theta0 and a trained model."""
    return metric == "loss" or "perplexity" in metric


def gapped(steps: list[int], values: list[float], grid: list[int]) -> tuple[list[int], list[float]]:
    """The run's points with NaN at every step of `grid` (all the panel's steps) it lacks between its
    first and last: matplotlib breaks the line there instead of drawing across the gap."""
    have = dict(zip(steps, values, strict=True))
    inside = [s for s in grid if steps[0] <= s <= steps[-1]]
    return inside, [have.get(s, math.nan) for s in inside]


CHANCE_BAND = 0.05  # no run above chance + this at any step after theta0: nothing beyond guessing was learned


def chance(task: str, metric: str) -> float | None:
    """The accuracy of guessing, for bema's own tasks (each task module's CHANCE); None elsewhere."""
    from bema_cli.eval.tasks import TASKS, get_task

    if task not in TASKS or not metric.startswith("accuracy"):
        return None
    return getattr(get_task(task), "CHANCE", None)


def never_above_chance(level: float, values: list[float]) -> bool:
    """Below chance is a model that does not answer in the task's format yet, not one that learned."""
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and all(v <= level + CHANCE_BAND for v in finite)


def plot(doc: dict, path: str, scoring: str = "flexible", theta0: bool = True) -> list[str]:
    """One panel per task/metric: value vs training step, one line per run, stderr band, vanilla dashed.

    `scoring` picks which accuracy of the generation tasks is drawn (flexible by default: see
    docs/eval-protocol.md); other metrics (loss, lm-eval metrics) are always drawn. theta0=False
    leaves the base model's points out (its loss can dwarf the rest). A run's colour is the same in
    every figure bema draws (figures.run_color); a line never crosses a step the run lacks.
    Returns the panels' titles.
    """
    import numpy as np
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
    motion = next(iter(doc.get("motion", {}).values()), None)  # the first sweep's (one run, one motion)
    shown = len(panels) + (motion is not None)
    fig = figures.new_figure(*figure_inches(shown))
    cols = min(MAX_COLS, shown)
    axes = fig.subplots(math.ceil(shown / cols), cols, squeeze=False).ravel()
    for ax, (task, metric, entry) in zip(axes, panels, strict=False):
        series = {}
        for run, r in entry["runs"].items():
            keep = [i for i, s in enumerate(r["steps"]) if theta0 or s != r.get("theta0_step")]
            if keep:
                series[run] = [[r[k][i] for i in keep] for k in ("steps", "values", "stderr")]
        grid = sorted({s for steps, _, _ in series.values() for s in steps})
        for run, (steps, values, errors) in series.items():
            x, y = gapped(steps, values, grid)
            _, se = gapped(steps, [math.nan if e is None else e for e in errors], grid)
            x, y, se = np.array(x), np.array(y, dtype=float), np.array(se, dtype=float)
            ax.plot(x, y, ms=4, lw=1.6, label=run, **figures.run_style(run))
            if np.isfinite(se).any():  # NaN rows break the band at the same gaps
                ax.fill_between(x, y - se, y + se, color=figures.run_color(run), alpha=0.15, lw=0)
        for label, ref in entry.get("references", {}).items():  # a step-less model: a horizontal line
            ax.axhline(ref["value"], color=figures.run_color(label), ls=":", lw=1.4)
        name = task if metric == task else f"{task}: {axis_label(task, metric)}"
        level, trained = chance(task, metric), []
        if level is not None:
            ax.axhline(level, color="0.4", ls=(0, (1, 3)), lw=1.2)
            ax.annotate(
                "chance",
                (1.0, level),
                xycoords=("axes fraction", "data"),
                ha="right",
                va="bottom",
                fontsize=8,
                color="0.35",
            )
            trained = [
                v
                for r in entry["runs"].values()
                for s, v in zip(r["steps"], r["values"], strict=True)
                if s != r.get("theta0_step")
            ]
        title = f"{name}\n({direction(entry['higher_is_better'])}; band: ±1 s.e.)"
        if level is not None and never_above_chance(
            level, trained
        ):  # nothing learned: its curves say nothing
            title += "\nNEVER ABOVE CHANCE: nothing learned here"
            ax.set_facecolor("0.93")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel(axis_label(task, metric))
        if log_scale(task, metric) and all(v > 0 for _, vals, _ in series.values() for v in vals):
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    if motion is not None:
        motion_panel(axes[len(panels)], motion)
    for ax in axes[shown:]:
        ax.set_visible(False)
    handles = [
        Line2D([], [], color=figures.run_color(r), ls=":", label=f"{r} (no step)")
        if r in refs
        else Line2D([], [], ms=4, label=figures.run_label(r), **figures.run_style(r))
        for r in all_runs
    ]
    fig.legend(handles=handles, loc="outside right upper", title="run", ncols=1 if len(all_runs) <= 16 else 2)
    figures.save(fig, path, "--plot")
    return [ax.get_title() for ax in axes[:shown]]


def motion_panel(ax, record: dict) -> None:
    """How far each checkpoint moved from the previous one (motion.py), overall and per tensor
    group, on a log scale; the judged last window shaded, the verdict in the title."""
    from bema_cli.stabilize.motion import GROUPS, describe

    rows = [r for r in record["motion"] if r["relative"] is not None]
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["relative"] for r in rows], color="k", lw=2, marker="o", ms=3, label="all weights")
    for group in GROUPS:
        values = [r["groups"].get(group) for r in rows]
        if any(v for v in values):
            ax.plot(steps, [math.nan if not v else v for v in values], lw=1, alpha=0.8, label=group)
    v = record.get("motion_verdict")
    if v:
        ax.axvspan(steps[-v["window"]], steps[-1], color="0.85", zorder=0)
    title = "checkpoint motion: ||θ_s − θ_prev|| / ||θ_s||\n" + textwrap.fill(describe(v), 56)
    if v and v["barely_moves"]:
        title += "\nBARELY MOVES: averaging can change little"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("training step")
    ax.set_ylabel("distance from the previous checkpoint")
    if all(r["relative"] > 0 for r in rows):
        ax.set_yscale("log")
    ax.legend(fontsize=7, loc="best")
    ax.grid(True, alpha=0.3)
