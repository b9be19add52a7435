"""`bema report` on results.jsonl files written here: numbers, table, JSON, plot, errors."""

from __future__ import annotations

import json

import matplotlib.image
import numpy as np
import pytest
from conftest import run_bema

from bema_cli import report
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
    # run n step final ± se [vs vanilla] best ± se at
    ema_acc, ema_loss = rows["ema-k0.5"]
    assert ema_acc == ["ema-k0.5", "4", "300", "0.43", "±", "0.015", "+0.03", "0.45", "±", "0.015", "200"]
    assert ema_loss == ["ema-k0.5", "4", "300", "1.58", "±", "0.0075", "-0.02", "1.55", "±", "0.0075", "200"]
    assert rows["vanilla"][0] == ["vanilla", "4", "300", "0.4", "±", "0.015", "0.4", "±", "0.015", "300"]


def test_plot_renders(results, tmp_path):
    png = tmp_path / "curves.png"
    r = run_bema("report", results, "--plot", png)
    assert r.returncode == 0, r.stderr
    img = matplotlib.image.imread(png)
    w, h = report.figure_inches(2)
    assert img.shape[:2] == (round(h * 100), round(w * 100)) == (380, 1250)
    rgb = img[..., :3]
    assert rgb.std() > 0.05
    # tab10 blue (the first stabilized run) and black (vanilla, dashed) are drawn
    assert (np.abs(rgb - np.array([31, 119, 180]) / 255).max(axis=-1) < 0.05).sum() > 200
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
    report.plot(doc, str(png))
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
    one, two = report.figure_inches(1), report.figure_inches(2)
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
            ", record 2: 'step' must be a non-negative integer",
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
    assert r.returncode == 3 and f"{bad}:2: invalid JSON" in r.stderr and r.stdout == "", r.stderr
    r = run_bema("report", results, "--plot", tmp_path / "nope" / "x.png")
    assert r.returncode == 4 and "--plot" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_bema("report", empty)
    assert r.returncode == 3 and "no results.jsonl" in r.stderr
