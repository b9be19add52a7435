"""What a newcomer met in the first hour (issue: the first hour on a real machine), each as a test:
files readable as any file the user writes, TRL's data formats read, -h and `bema version`, help
that says the real defaults, the backend `auto` chose said on stderr, counted evaluation lines with
the time left, nothing left behind by a refused run, at-chance panels marked."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from conftest import run_bema

from bema_cli import report_plot
from bema_cli.errors import InputError
from bema_cli.eval import data
from bema_cli.eval.results import write_jsonl_atomic

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_files_written_through_a_temp_file_keep_the_users_mode(tmp_path):
    """mkstemp makes 0600 files, and the rename kept it: the demo's data and plots were private."""
    from bema_cli import figures

    old = os.umask(0o022)
    try:
        write_jsonl_atomic(tmp_path / "rows.jsonl", [{"a": 1}])
        fig = figures.new_figure(2, 2)
        fig.subplots().plot([0, 1], [0, 1])
        figures.save(fig, tmp_path / "plot.png", "--plot")
        os.umask(0o027)
        write_jsonl_atomic(tmp_path / "group.jsonl", [{"a": 1}])
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"rows.jsonl": 0o644, "plot.png": 0o644, "group.jsonl": 0o640}


def test_loss_rows_in_trls_formats_are_read_and_others_refused_naming_the_line(tmp_path):
    rows = [
        {"text": "plain"},
        {"messages": CHAT},
        {"prompt": "2 + 2 =", "completion": " 4"},
        {"prompt": CHAT[:1], "completion": CHAT[1:]},
    ]
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_loss_records(path, 10) == rows
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "only a prompt"}) + "\n")
    with pytest.raises(InputError) as err:
        data.read_loss_records(path, 10)
    said = str(err.value)  # the line, what it holds, and what is expected
    assert (
        said.startswith(f"{path}:2: an object with keys 'prompt'; expected ")
        and '{"prompt": str, "completion": str}' in said
    )


def test_prompt_completion_scores_the_completion_tokens_only(tiny_model_dir):
    """TRL's completion_only_loss: the prompt's tokens are context, not targets; a whole text scores all."""
    from bema_cli.eval import chat
    from bema_cli.eval.tasks import loss

    tokenizer, _ = chat.load_tokenizer(tiny_model_dir)
    ids, first = loss.encode_record({"prompt": "the cat", "completion": " sees the dog"}, tokenizer)
    assert ids == tokenizer("the cat sees the dog")["input_ids"]
    assert ids[:first] == tokenizer("the cat")["input_ids"] and 1 < first < len(ids)
    ids, first = loss.encode_record({"prompt": CHAT[:1], "completion": CHAT[1:]}, tokenizer)
    prompt = chat.encode(tokenizer, chat.render(tokenizer, CHAT[:1], generation_prompt=True))
    assert ids == chat.encode(tokenizer, chat.render(tokenizer, CHAT, generation_prompt=False))
    assert first == len(prompt) and ids[:first] == prompt
    assert loss.encode_record({"text": "the cat"}, tokenizer)[1] == 1


def test_h_is_help_and_version_is_a_command():
    for args in (["-h"], ["ship", "-h"], ["stabilize", "-h"]):
        r = run_bema(*args)
        assert r.returncode == 0 and "Usage: bema" in r.stdout, (args, r.stderr)
    r = run_bema("version")
    assert r.returncode == 0 and r.stdout.split()[0] == "bema" and r.stdout == run_bema("--version").stdout
    assert json.loads(run_bema("version", "--json").stdout)["bema"] == r.stdout.split()[1]


def test_ship_help_says_the_menu_is_the_default():
    text = " ".join(run_bema("ship", "--help", env={"COLUMNS": "300"}).stdout.split())
    assert (
        "(default: the menu: vanilla, ema, bema at eta 0.2 and 0.5" in text and "(default: bema)" not in text
    )


def test_backend_auto_says_its_choice_and_evaluations_are_counted(tiny_model_dir, tmp_path):
    """In a pipe: `[k/N]` on every evaluation line, the time left from the second on."""
    path = tmp_path / "heldout.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    r = run_bema("eval", tiny_model_dir, "--tasks", "loss", "--loss-data", path,
                 "--out", tmp_path / "out")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--backend auto: transformers (loss only" in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("[1/1] loss: ") and "ETA" not in lines[0]


def test_countdown_lines_in_a_pipe(capsys, monkeypatch):
    from bema_cli import output

    monkeypatch.setattr(output, "progress_enabled", lambda: False)
    with output.countdown(3, "evaluations"):
        for name in ("a", "b", "c"):
            output.step(name)
    lines = capsys.readouterr().err.splitlines()
    assert (
        lines[0] == "[1/3] a"
        and lines[1].startswith("[2/3] b  ETA ")
        and lines[2].startswith("[3/3] c  ETA ")
    )
    assert (
        output.duration(42) == "42 s" and output.duration(540) == "9 min" and output.duration(5400) == "1.5 h"
    )


def test_a_refused_eval_leaves_nothing_behind(tiny_model_dir, tmp_path):
    """Offline, no data for gsm8k: refused before any record; no ./results with an empty libraries.log."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = run_bema("eval", tiny_model_dir, "--tasks", "gsm8k", cwd=tmp_path, env=env)
    assert r.stderr.splitlines()[-1].startswith("error: no data") and r.returncode == 3
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()  # a folder the user made stays, empty
    r = run_bema("eval", tiny_model_dir, "--tasks", "gsm8k", "--out", tmp_path / "mine", env=env)
    assert r.returncode == 3 and [p.name for p in tmp_path.iterdir()] == ["mine"]
    assert list((tmp_path / "mine").iterdir()) == []


def _panel(values: list[float]) -> dict:
    steps = list(range(0, 100 * len(values), 100))
    return {"runs": {"vanilla": {"steps": steps, "values": values, "stderr": [0.01] * len(values),
                                 "theta0_step": 0}}, "higher_is_better": True}  # fmt: skip


def test_panels_that_never_rise_above_chance_are_marked(tmp_path):
    doc = {"tasks": {
        "boolq": {"accuracy_flexible": _panel([0.0, 0.1, 0.52, 0.49])},  # format first, then guessing
        "mmlu_hs": {"accuracy_flexible": _panel([0.0, 0.25, 0.45, 0.6])},  # learned
        "gsm8k": {"accuracy_flexible": _panel([0.0, 0.0, 0.0, 0.0])},  # no chance level to compare
    }}  # fmt: skip
    titles = report_plot.plot(doc, str(tmp_path / "curves.png"))
    marked = [t.startswith(("boolq", "mmlu_hs", "gsm8k")) and "NEVER ABOVE CHANCE" in t for t in titles]
    assert [t.split(":")[0] for t in titles] == ["boolq", "mmlu_hs", "gsm8k"] and marked == [
        True,
        False,
        False,
    ]
    assert report_plot.chance("boolq", "accuracy_flexible") == 0.5
    assert (
        report_plot.chance("mmlu_hs", "accuracy_strict") == 0.25
        and report_plot.chance("loss", "loss") is None
    )


def _install_line(env: dict, index: str) -> str:
    import subprocess

    made = subprocess.run(["make", "-n", "-B", ".venv/.base", f"TORCH_CPU_INDEX={index}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return next(line for line in made.stdout.splitlines() if "install -q torch==" in line)


def test_make_takes_torchs_cpu_build_where_no_gpu_is(tmp_path):
    """PyPI's torch is a multi-GB CUDA build: without a GPU, make adds PyTorch's CPU index where it
    answers (here a local stand-in); with nvidia-smi on PATH, or no index answering, pip's sources decide."""
    import http.server
    import threading

    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "index"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    index = f"http://127.0.0.1:{server.server_port}"
    no_gpu = {**os.environ, "PATH": "/usr/bin:/bin"}
    gpu_bin = tmp_path / "bin"
    gpu_bin.mkdir()
    (gpu_bin / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (gpu_bin / "nvidia-smi").chmod(0o755)
    gpu = {**no_gpu, "PATH": f"{gpu_bin}:/usr/bin:/bin"}
    try:
        assert _install_line(no_gpu, index).endswith(f"torch==2.13.0 --extra-index-url {index}")
        assert _install_line(gpu, index).rstrip().endswith("torch==2.13.0")
    finally:
        server.shutdown()
    assert _install_line(no_gpu, index).rstrip().endswith("torch==2.13.0")  # the index no longer answers


def test_eval_with_vanilla_adds_the_runs_own_checkpoint_at_each_output_step(
    tiny_model_dir, tiny_trained_dir, tmp_path
):
    """The tour's `bema eval GRID` had no vanilla at the grid's step, so every "vs vanilla" read `no same
    step`; --with-vanilla evaluates the run's checkpoint there (the manifest names it)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "checkpoint-10")
    shutil.copytree(tiny_trained_dir, run / "checkpoint-20")
    grid = tmp_path / "grid"
    r = run_bema("stabilize", run, "--base", tiny_model_dir, "--out", grid, "--method", "ema", "--final-only")
    assert r.returncode == 0, r.stderr
    path = tmp_path / "heldout.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    r = run_bema("eval", grid, "--with-vanilla", "--tasks", "loss", "--loss-data", path, "--out", tmp_path / "res",
                 "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    runs = sorted((rec["run"], rec["step"], rec["model_path"]) for rec in json.loads(r.stdout)["records"])
    assert runs == [("ema-k0.5", 20, "grid/ema-k0.5/checkpoint-20"),  # named inside the folder shared with --out
                    ("vanilla", 20, "run/checkpoint-20")]  # fmt: skip
    report = json.loads(run_bema("report", tmp_path / "res", "--json").stdout)
    versus = report["tasks"]["loss"]["loss"]["runs"]["ema-k0.5"]["vs_vanilla"]
    assert versus is not None and versus["step"] == 20
