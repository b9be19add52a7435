"""What the demo prints and draws at the end: held-out loss and accuracy per step for every run,
as tables (rich on a terminal, plain in a pipe) and as `summary.png`."""

from __future__ import annotations

from pathlib import Path

from bema_cli import output


def summarize(records: list[dict]) -> dict:
    """{"runs", "steps", "loss": {run: {step: v}}, "accuracy": {task: {run: {step: v}}}} from results.jsonl."""
    loss: dict[str, dict[int, float]] = {}
    acc: dict[str, dict[str, dict[int, float]]] = {}
    for r in records:
        run, step, metrics = r["run"], int(r["step"]), r["metrics"]
        if r["task"] == "loss":
            loss.setdefault(run, {})[step] = metrics["loss"]
        elif "accuracy_flexible" in metrics:
            acc.setdefault(r["task"], {}).setdefault(run, {})[step] = metrics["accuracy_flexible"]
    every = [loss, *acc.values()]
    runs = sorted(
        {run for by in every for run in by}, key=lambda n: (n != "vanilla", not n.startswith("ema"), n)
    )
    steps = sorted({s for by in every for per_run in by.values() for s in per_run})
    return {"runs": runs, "steps": steps, "loss": loss, "accuracy": acc}


def _table(title: str, values: dict, runs: list[str], steps: list[int], fmt: str):
    from rich.table import Table

    table = Table(title=title)
    table.add_column("step", justify="right")
    for run in runs:
        table.add_column(run, justify="right")
    for step in steps:
        cells = [values.get(run, {}).get(step) for run in runs]
        table.add_row(str(step), *("-" if v is None else fmt.format(v) for v in cells))
    return table


def print_summary(summary: dict, out: Path) -> None:
    """Held-out loss and GSM8K-style accuracy per step and run; the other tasks' final accuracy."""
    runs, steps, acc = summary["runs"], summary["steps"], summary["accuracy"]
    output.print_table(
        _table("held-out loss (nats/token, lower is better)", summary["loss"], runs, steps, "{:.4f}")
    )
    if "gsm8k" in acc:
        output.print_table(_table("gsm8k accuracy (higher is better)", acc["gsm8k"], runs, steps, "{:.3f}"))
    last = steps[-1]
    for task in sorted(set(acc) - {"gsm8k"}):
        finals = ", ".join(
            f"{run} {acc[task][run][last]:.3f}" for run in runs if last in acc[task].get(run, {})
        )
        output.stdout.print(f"{task} accuracy at step {last}: {finals}")
    if summary.get("quick"):  # what a user reads as a result is only the install being checked
        output.stdout.print(
            f"quick demo: {last} fine-tuning steps check that the install works end to end; the model has not "
            "learned the tasks yet (accuracies near 0, and ship finds nothing to beat vanilla): `make demo` "
            "runs the full one"
        )
    output.stdout.print(
        f"base model (theta0): {out / 'base'}\n"
        f"fine-tuning checkpoints: {out / 'sft'}/checkpoint-*\n"
        f"stabilized checkpoints: {out / 'stabilized'}/<run>/checkpoint-* (manifest.json)\n"
        f"results: {out / 'results' / 'results.jsonl'} (all tasks: bema report {out / 'results'})\n"
        f"plots: {out / 'curves.png'} (every task, by bema report), {out / 'summary.png'} (the two tables)"
    )


def plot_summary(summary: dict, path: Path) -> Path:
    """Three panels for the README: held-out loss from the first fine-tuning step on (log scale: the
    lag), the same loss over the run's second half on a linear scale (where the end-of-run gain
    lives, a few thousandths of a nat that the log axis flattens), and gsm8k accuracy; vanilla dashed.
    The base model's loss is off every scale and only named. `bema report` draws every task (curves.png)."""
    from bema_cli import figures, report, report_plot

    steps = summary["steps"]
    tail_from = steps[len(steps) // 2] if steps else 0
    fig = figures.new_figure(14.0, 3.8)
    axes = fig.subplots(1, 3)
    panels = [
        (summary["loss"], "held-out loss (nats/token)", lambda s: s > 0),
        (summary["loss"], "held-out loss (nats/token)", lambda s: s >= tail_from),
        (summary["accuracy"].get("gsm8k", {}), "gsm8k accuracy", lambda s: True),
    ]
    for ax, (values, label, shown) in zip(axes, panels, strict=True):
        grid = sorted({s for run in summary["runs"] for s in values.get(run, {}) if shown(s)})
        for run in summary["runs"]:
            run_steps = sorted(s for s in values.get(run, {}) if shown(s))
            if run_steps:
                x, y = report_plot.gapped(run_steps, [values[run][s] for s in run_steps], grid)
                ax.plot(x, y, ms=4, lw=1.6, label=run, **figures.run_style(run))
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    last = steps[-1] if steps else None
    final = {run: summary["loss"].get(run, {}).get(last) for run in summary["runs"]}
    best = min((v, run) for run, v in final.items() if v is not None) if any(final.values()) else None
    base = summary["loss"].get("vanilla", {}).get(0)
    note = f"; base model {base:.2f}, not shown" if base is not None else ""
    axes[0].set_title(f"held-out loss, log scale: the lag\n(lower is better{note})", fontsize=10)
    tail = f"steps {tail_from}-{last}, linear scale: the end of the run"
    if best is not None and final.get("vanilla") is not None:
        tail += f"\nat {last}: {best[1]} {best[0]:.4f}, vanilla {final['vanilla']:.4f}"
    axes[1].set_title(tail, fontsize=10)
    axes[2].set_title("gsm8k-style task accuracy\n(higher is better)", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: report.run_order(labels[i]))
    fig.legend(
        [handles[i] for i in order], [labels[i] for i in order], loc="outside right upper", title="run"
    )
    return figures.save(fig, path, "summary plot")
