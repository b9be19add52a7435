"""`bema report` on results.jsonl files written here: numbers, table, JSON, plot, errors."""

from __future__ import annotations

import json
import math

import matplotlib.image
import numpy as np
import pytest
from conftest import run_bema

from bema_cli import figures, output, report, report_plot
from bema_cli.errors import InputError

STEPS = [0, 100, 200, 300]
# run -> task -> values per step (step 0 is the base model, the same for every run)
DATA = {
    "vanilla": {"gsm8k": [0.20, 0.35, 0.31, 0.40], "loss": [2.00, 1.70, 1.72, 1.60]},
    "ema-k0.5": {"gsm8k": [0.20, 0.30, 0.45, 0.43], "loss": [2.00, 1.80, 1.55, 1.58]},
    "bema-k0.5-e0.2": {"gsm8k": [0.20, 0.41, 0.47, 0.46], "loss": [2.00, 1.66, 1.52, 1.50]},
}
STDERR = 0.015


def record(run: str, step: int, task: str, value: float) -> dict:
    metrics = (
        {"accuracy": value, "accuracy_stderr": STDERR, "parse_failure_rate": 0.05}
        if task != "loss"
        else {"loss": value, "loss_stderr": STDERR / 2, "tokens": 1234}
    )
    return {
        "bema_version": "0.1.0", "created": "2025-01-01T00:00:00", "model_path": f"/x/{run}/checkpoint-{step}",
        "run": run, "step": step, "stabilizer": {"method": run.split("-")[0]}, "task": task, "metrics": metrics,
        "n_prompts": 50, "n_samples": 1, "backend": "transformers", "dtype": "float32",
        "seeds": {"sampling": 0, "selection": 0}, "protocol": {}, "seconds": 1.0, "is_base": step == 0,
    }  # fmt: skip


def write_results(path, runs=DATA) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # deliberately out of order: report must sort by step
    lines = [
        record(r, s, t, v[i])
        for r, tasks in runs.items()
        for t, v in tasks.items()
        for i, s in enumerate(STEPS)
    ]
    lines.reverse()
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "eval" / "results.jsonl"
    write_results(path)
    return path


def test_json_numbers_match_the_input(results):
    r = run_bema("report", results.parent, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["inputs"] == [str(results.resolve())] and doc["n_records"] == 24 and doc["bema_version"]
    assert set(doc["tasks"]) == {"gsm8k", "loss"}
    acc, loss = doc["tasks"]["gsm8k"]["accuracy"], doc["tasks"]["loss"]["loss"]
    assert acc["higher_is_better"] is True and loss["higher_is_better"] is False
    assert list(acc["runs"]) == ["vanilla", "bema-k0.5-e0.2", "ema-k0.5"]  # vanilla first
    for run, tasks in DATA.items():
        a, lo = acc["runs"][run], loss["runs"][run]
        assert a["steps"] == STEPS and a["values"] == tasks["gsm8k"] and a["stderr"] == [STDERR] * 4
        assert lo["values"] == tasks["loss"] and lo["stderr"] == [STDERR / 2] * 4
        best_acc = int(np.argmax(tasks["gsm8k"]))
        best_loss = int(np.argmin(tasks["loss"]))
        assert a["best"] == {"step": STEPS[best_acc], "value": tasks["gsm8k"][best_acc], "stderr": STDERR}
        assert lo["best"] == {
            "step": STEPS[best_loss],
            "value": tasks["loss"][best_loss],
            "stderr": STDERR / 2,
        }
        assert a["final"] == {"step": 300, "value": tasks["gsm8k"][-1], "stderr": STDERR}
    # best != final somewhere, so the two columns are really different computations
    assert acc["runs"]["ema-k0.5"]["best"]["step"] == 200 and loss["runs"]["vanilla"]["best"]["step"] == 300


def test_table_shows_final_and_best(results):
    r = run_bema("report", results)
    assert r.returncode == 0, r.stderr
    assert "gsm8k: accuracy (higher is better)" in r.stdout and "loss: loss (lower is better)" in r.stdout
    rows = {}
    for line in r.stdout.splitlines():
        cells = line.split()
        if cells and cells[0] in DATA:
            rows.setdefault(cells[0], []).append(cells)
    # run n step final ± se [vs vanilla] best ± se @at
    ema_acc, ema_loss = rows["ema-k0.5"]
    assert ema_acc == ["ema-k0.5", "4", "300", "0.43", "±", "0.015", "+0.03", "0.45", "±", "0.015", "@200"]
    assert ema_loss == ["ema-k0.5", "4", "300", "1.58", "±", "0.0075", "-0.02", "1.55", "±", "0.0075", "@200"]
    assert rows["vanilla"][0] == ["vanilla", "4", "300", "0.4", "±", "0.015", "0.4", "±", "0.015", "@300"]


def test_plot_renders(results, tmp_path):
    png = tmp_path / "curves.png"
    r = run_bema("report", results, "--plot", png)
    assert r.returncode == 0, r.stderr
    img = matplotlib.image.imread(png)
    w, h = report_plot.figure_inches(2)
    assert img.shape[:2] == (round(h * 100), round(w * 100)) == (380, 1250)
    rgb = img[..., :3]
    assert rgb.std() > 0.05
    # each stabilized run in its own fixed colour (figures.run_color) and black (vanilla, dashed) are drawn
    for run in ("ema-k0.5", "bema-k0.5-e0.2"):
        color = np.array(matplotlib.colors.to_rgb(figures.run_color(run)))
        assert (np.abs(rgb - color).max(axis=-1) < 0.05).sum() > 200, run
    assert (rgb.max(axis=-1) < 0.1).sum() > 500
    assert not list(tmp_path.glob(".curves.png*")), "temp file left behind"


def test_plot_grid_of_panels(tmp_path):
    tasks = {
        "boolq": [0.5, 0.6, 0.62, 0.61],
        "gsm8k": [0.2, 0.3, 0.4, 0.5],
        "mmlu_hs": [0.3, 0.31, 0.33, 0.32],
    }
    runs = {"vanilla": dict(tasks), "bema-k0.5-e0.2": dict(tasks)}
    path = tmp_path / "a" / "results.jsonl"
    write_results(path, runs)
    extra = tmp_path / "b" / "results.jsonl"  # one more panel, in another file
    extra.parent.mkdir()
    extra.write_text(json.dumps(record("vanilla", 100, "loss", 1.0)) + "\n")
    doc = report.build([str(tmp_path)])  # a folder: both results.jsonl below it
    assert len(doc["inputs"]) == 2 and set(doc["tasks"]) == {"boolq", "gsm8k", "mmlu_hs", "loss"}
    png = tmp_path / "grid.png"
    report_plot.plot(doc, str(png))
    assert matplotlib.image.imread(png).shape[:2] == (760, 1750)  # 2 rows x 3 columns + legend


def test_plot_draws_flexible_accuracy_by_default(tmp_path):
    """Generation records carry strict and flexible accuracy: one panel each way, both with --scoring both."""
    path = tmp_path / "results.jsonl"
    lines = []
    for step, value in zip(STEPS, [0.2, 0.3, 0.4, 0.5], strict=True):
        rec = record("vanilla", step, "gsm8k", value)
        rec["metrics"] = {"accuracy_strict": value / 2, "accuracy_strict_stderr": 0.01,
                          "accuracy_flexible": value, "accuracy_flexible_stderr": 0.01}  # fmt: skip
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    shapes = {}
    for scoring in ("flexible", "strict", "both"):
        png = tmp_path / f"{scoring}.png"
        r = run_bema("report", path, "--plot", png, "--scoring", scoring)
        assert r.returncode == 0, r.stderr
        shapes[scoring] = matplotlib.image.imread(png).shape[:2]
    one, two = report_plot.figure_inches(1), report_plot.figure_inches(2)
    assert shapes["flexible"] == shapes["strict"] == (round(one[1] * 100), round(one[0] * 100))
    assert shapes["both"] == (round(two[1] * 100), round(two[0] * 100))
    r = run_bema("report", path, "--json")
    assert set(json.loads(r.stdout)["tasks"]["gsm8k"]) == {
        "accuracy_strict",
        "accuracy_flexible",
    }  # JSON: both
    r = run_bema("report", path, "--plot", tmp_path / "x.png", "--scoring", "loose")
    assert r.returncode == 2 and "--scoring" in r.stderr


def test_duplicates_keep_the_last_and_warn(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    lines = [report_record(0.1), report_record(0.9)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")  # a blank line is fine
    doc = report.build([str(path)])
    assert doc["tasks"]["gsm8k"]["accuracy"]["runs"]["vanilla"]["values"] == [0.9]
    assert f"{path}, record 2" in capsys.readouterr().err


def report_record(value):
    return record("vanilla", 100, "gsm8k", value)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"run": "vanilla"', ":2: invalid JSON"),
        ("[1, 2]", ":2: expected a JSON object"),
        (json.dumps({"run": "x", "step": 1, "metrics": {}}), ", record 2: no 'task'"),
        (
            json.dumps({"run": "x", "step": "5", "task": "t", "metrics": {}}),
            ", record 2: 'step' must be an integer in [0, 2**53) or null",
        ),
        (
            json.dumps({"run": "x", "step": 5, "task": "t", "metrics": [1]}),
            ", record 2: 'metrics' must be an object",
        ),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(report_record(0.5)) + "\n" + bad_line + "\n")
    with pytest.raises(InputError) as err:
        report.build([str(path)])
    assert str(err.value).startswith(f"{path}{message}"), err.value


def test_no_records_or_no_headline_metric(tmp_path):
    empty = tmp_path / "results.jsonl"
    empty.write_text("\n")
    with pytest.raises(InputError, match="no result records"):
        report.build([str(empty)])
    empty.write_text(json.dumps({"run": "x", "step": 5, "task": "t", "metrics": {"accuracy": 0.5}}) + "\n")
    with pytest.raises(InputError, match="no headline metric"):
        report.build([str(empty)])


def test_cli_errors(tmp_path, results):
    missing = tmp_path / "missing.jsonl"
    r = run_bema("report", missing)
    assert r.returncode == 3 and str(missing) in r.stderr and r.stderr.count("\n") == 1, r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(report_record(0.5)) + "\nnot json\n")
    r = run_bema("report", bad, "--json")
    assert r.returncode == 3 and f"{bad}:2: invalid JSON" in r.stderr, r.stderr
    if "--json" in r.args:  # the error as the one JSON document on stdout (a pipe into jq sees it)
        assert json.loads(r.stdout) == {"error": r.stderr.strip().removeprefix("error: "), "exit_code": 3}
    else:
        assert r.stdout == ""
    r = run_bema("report", results, "--plot", tmp_path / "nope" / "x.png")
    assert r.returncode == 4 and "--plot" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_bema("report", empty)
    assert r.returncode == 3 and "no results.jsonl" in r.stderr


def lm_eval_record(run: str, step: int, metric: str, value: float, higher: bool | None) -> dict:
    """An lm_eval: record as bema eval writes it: lm-eval's own higher_is_better table inside."""
    table = {} if higher is None else {"toy": {metric.split("[")[0]: higher}}
    return {**record(run, step, "loss", 0.0), "task": "lm_eval:toy",
            "metrics": {metric: value, f"{metric}_stderr": 0.01},
            "lm_eval": {"task": "toy", "higher_is_better": table}}  # fmt: skip


@pytest.mark.parametrize(
    "metric, higher, best_step",
    [("bits_per_byte", False, 200), ("brier_score", False, 200), ("ter", False, 200), ("acc", True, 100),
     ("exact_match[strict-match]", True, 100), ("some_metric", None, None)],
)  # fmt: skip
def test_best_follows_lm_evals_higher_is_better(tmp_path, metric, higher, best_step):
    """'best' comes from the direction lm-eval returned (bema stores it), not from words in the
    name: ter, brier_score and bits_per_byte (lower is better) picked the worst step by name."""
    path = tmp_path / "results.jsonl"
    values = {100: 0.9, 200: 0.1, 300: 0.5}
    path.write_text(
        "".join(json.dumps(lm_eval_record("vanilla", s, metric, v, higher)) + "\n" for s, v in values.items())
    )
    doc = report.build([str(path)])
    entry = doc["tasks"]["lm_eval:toy"][metric]
    assert entry["higher_is_better"] is higher
    best = entry["runs"]["vanilla"]["best"]
    assert (best and best["step"]) == best_step
    table = output.plain_table(report.tables(doc)[0])
    assert ("direction unknown" in table) == (higher is None)


def test_vs_vanilla_compares_at_the_same_step(tmp_path):
    """bema evaluated up to step 200 (and at step 0 only, for another run): vanilla's value at THAT
    step, never vanilla's last (step 300); no shared step at all is said, not computed."""
    path = tmp_path / "results.jsonl"
    lines = [record("vanilla", s, "loss", v) for s, v in ((100, 2.0), (200, 1.5), (300, 0.2))]
    lines += [record("bema-k0.5-e0.2", s, "loss", v) for s, v in ((100, 1.8), (200, 1.4))]
    lines += [{**record("ema-k0.5", 50, "loss", 1.9), "is_base": False}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    doc = report.build([str(path)])
    runs = doc["tasks"]["loss"]["loss"]["runs"]
    assert runs["bema-k0.5-e0.2"]["vs_vanilla"] == {
        "step": 200,
        "delta": pytest.approx(-0.1),
        "final_step": True,
    }
    assert runs["ema-k0.5"]["vs_vanilla"] is None
    table = output.plain_table(report.tables(doc)[0])
    assert "-0.1" in table and "no same step" in table and "-1.2" not in table


LONG = "bema-k0.5-e0.123456789-with-a-long-suffix"


def test_tables_never_cut_a_value_in_a_pipe_or_on_a_narrow_terminal(tmp_path, monkeypatch):
    """A pipe gets plain complete text at any width; an 80-column terminal folds the run name and
    keeps every number whole (or leaves a column out and says so): no '…' anywhere."""
    path = tmp_path / "results.jsonl"
    lines = [
        record(run, s, "gsm8k", v)
        for run in ("vanilla", LONG)
        for s, v in ((1000, 0.123456), (2000, 0.654321))
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = run_bema("report", path, env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert LONG in r.stdout and "2000" in r.stdout and "0.6543 ± 0.015" in r.stdout and "@2000" in r.stdout
    assert "…" not in r.stdout and "\x1b" not in r.stdout  # plain text: no ellipsis, no colour codes
    from rich.console import Console

    for width in (80, 60):
        console = Console(width=width, force_terminal=True, no_color=True, record=True, soft_wrap=True)
        monkeypatch.setattr(output, "stdout", console)
        for table in report.tables(report.build([str(path)])):
            output.print_table(table)
        text = console.export_text()
        rows = [
            line for line in text.splitlines() if not line.startswith("n: evaluated")
        ]  # the caption soft-wraps
        assert "…" not in text and all(len(line) <= width for line in rows)
        assert "0.6543 ± 0.015" in text and "2000" in text
        firsts = "".join(line.split()[0] for line in text.splitlines() if line.split())
        assert LONG in firsts  # the folded run name, read down its column, is whole


def test_plot_breaks_lines_at_missing_steps_and_labels_axes_in_words(tmp_path):
    """A run lacking step 200 of the panel's grid gets a NaN there (matplotlib breaks the line);
    axes read in words; --no-theta0 leaves the base point out and still draws."""
    x, y = report_plot.gapped([100, 300], [1.0, 2.0], [0, 100, 200, 300, 400])
    assert x == [100, 200, 300] and y[0] == 1.0 and math.isnan(y[1]) and y[2] == 2.0
    assert report_plot.axis_label("loss", "loss") == "held-out loss (nats/token)"
    assert (
        report_plot.axis_label("gsm8k", "accuracy_flexible")
        == "accuracy, flexible scoring (share of samples)"
    )
    assert (
        report_plot.axis_label("lm_eval:gsm8k", "exact_match[flexible-extract]")
        == "exact match (share of items), flexible-extract"
    )
    path = tmp_path / "results.jsonl"
    lines = [record("vanilla", s, "loss", v) for s, v in ((0, 9.0), (100, 2.0), (200, 1.5), (300, 1.2))]
    lines += [record("bema-k0.5-e0.2", s, "loss", v) for s, v in ((0, 9.0), (100, 1.8), (300, 1.1))]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for flag in ("--theta0", "--no-theta0"):
        r = run_bema("report", path, "--plot", tmp_path / f"c{flag}.png", flag)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "c--theta0.png").read_bytes() != (tmp_path / "c--no-theta0.png").read_bytes()


def test_window_runs_are_told_apart_from_the_ema_family(tmp_path):
    """lawa/wsm/swa runs: their own hues, dash-dot lines (the EMA family's are solid), readable legends."""
    assert figures.run_style("lawa-w8")["ls"] == figures.run_style("wsm-minus_sqrt-w8")["ls"] == "-."
    assert figures.run_style("bema-k0.5-e0.2")["ls"] == figures.run_style("power-sr0.05")["ls"] == "-"
    assert figures.run_label("wsm-minus_sqrt-w8") == "wsm-minus_sqrt-w8 (WSM minus-sqrt: last 8)"
    assert figures.run_label("wsm-cosine_reverse-w4") == "wsm-cosine_reverse-w4 (WSM cosine reversed: last 4)"
    assert figures.run_label("lawa-w8") == "lawa-w8 (LAWA: mean of the last 8)"
    assert figures.run_label("swa-s1000") == "swa-s1000 (SWA from step 1000)"
    assert figures.run_label("bema-k0.5-e0.2") == "bema-k0.5-e0.2"
    names = ["vanilla", "bema-k0.5-e0.2", "lawa-w8", "wsm-minus_sqrt-w8"]
    colors = [np.array(matplotlib.colors.to_rgb(figures.run_color(r))) for r in names]
    assert min(np.abs(a - b).max() for i, a in enumerate(colors) for b in colors[i + 1 :]) > 0.2
    path = tmp_path / "r" / "results.jsonl"
    write_results(path, {r: {"gsm8k": DATA["vanilla"]["gsm8k"]} for r in names})
    png = tmp_path / "curves.png"
    r = run_bema("report", path, "--plot", png)
    assert r.returncode == 0, r.stderr
    rgb = matplotlib.image.imread(png)[..., :3]
    for run, color in zip(names[2:], colors[2:], strict=True):  # the window runs are drawn in their hues
        assert (np.abs(rgb - color).max(axis=-1) < 0.05).sum() > 100, run
