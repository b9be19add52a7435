"""Every edge a user meets in the first hour is a one-line answer: grids whose YAML and flags are
checked alike, a resealed state that is still refused where no key is needed, a finished command
that is up to date, global flags after the subcommand, flags checked before any input is read,
pipes and --json errors, `bema env`, `--tasks list`, other tools' flag names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BEMA, one_line_error, run_bema
from trajectory import write_trajectory

from bema_cli.stabilize.state_doc import seal


@pytest.fixture(scope="module")
def traj(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    base, run = write_trajectory(root, [10, 20, 30, 40])
    return {"root": root, "base": base, "run": run}


def stabilize(traj, out, *args):
    return run_bema("stabilize", traj["run"], "--base", traj["base"], "--out", out, *args)


# -- 6. the YAML grid: each value through its flag's check; duplicates, depth and size refused ------
@pytest.mark.parametrize(
    "text, code, needle",
    [
        ("gamma: abc\nmethods: {bema: {}}\n", 3, "gamma: a number, got 'abc'"),
        ("tau: [1, 2]\nmethods: {bema: {}}\n", 3, "tau: a whole number, got [1, 2]"),
        ("tau: 15.7\nmethods: {bema: {}}\n", 3, "tau: a whole number, got 15.7"),
        ("preset: 3\nmethods: {bema: {}}\n", 3, "preset: a preset name, got 3"),
        ("gamma: -1\nmethods: {bema: {}}\n", 3, "methods.bema: gamma: must be a finite number >= 0"),
        ("methods:\n  ema: {kappa: 0.5}\n  ema: {kappa: 0.9}\n", 3, "duplicate key 'ema' (line 3)"),
        ("methods:\n  bema: {kappa: 0.5, kappa: 0.7}\n", 3, "duplicate key 'kappa'"),
        ("methods: " + "[" * 5000 + "]" * 5000 + "\n", 3, "nested too deeply"),
        (
            "methods:\n  bema: {kappa: [" + ",".join(str(0.1 + i / 1e4) for i in range(3000)) + "], eta: ["
            + ",".join(str(0.1 + i / 1e4) for i in range(3000)) + "]}\n",
            2, "9,000,000 configs, over the limit of 4,096",
        ),
    ],
    ids=["type", "list", "fraction", "preset", "range", "dup-method", "dup-param", "deep", "huge"],
)  # fmt: skip
def test_a_bad_yaml_grid_is_one_line_naming_the_file(traj, tmp_path, text, code, needle):
    config = tmp_path / "grid.yaml"
    config.write_text(text)
    t = time.perf_counter()
    line = one_line_error(stabilize(traj, tmp_path / "out", "--config", config), code)
    assert needle in line and str(config) in line, line
    assert time.perf_counter() - t < 30  # refused before the grid is built (the huge one hung)
    assert not (tmp_path / "out").exists()


def test_a_huge_grid_of_flags_is_refused_by_its_count(traj, tmp_path):
    many = ",".join(str(0.1 + i / 1e4) for i in range(100))
    line = one_line_error(stabilize(traj, tmp_path / "out", "--kappa", many, "--eta", many), 2)
    assert "10,000 configs, over the limit of 4,096" in line


# -- 7. list flags: an empty item or a non-ASCII digit is an error, never dropped or a traceback -----
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--eta", "0.2,,0.5"], "--eta: an empty item in '0.2,,0.5'"),
        (["--kappa", "0.5,"], "--kappa: an empty item in '0.5,'"),
        (["--method", "bema,,ema"], "--method: an empty item"),
        (["--window", "2,²", "--method", "lawa"], "--window: expected comma-separated integers"),
    ],
)
def test_list_flags_refuse_empty_items(traj, tmp_path, args, needle):
    line = one_line_error(stabilize(traj, tmp_path / "out", *args), 2)
    assert needle in line, line


@pytest.mark.parametrize("at", ["every:²", "20,,40", "2٠"])
def test_sweep_at_is_checked_instantly(traj, tmp_path, at):
    t = time.perf_counter()
    r = run_bema("sweep", tmp_path / "no-such-run", "--out", tmp_path / "o", "--at", at)
    line = one_line_error(r, 2)  # the flag, before the missing run folder is even looked at
    assert line.startswith("error: --at:") and repr(at) in line, line
    assert time.perf_counter() - t < 5


# -- 8. a resealed state.json: the checks that need no key stand beside the seal --------------------
def _reseal(path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    doc["seal"] = seal(doc)
    path.write_text(json.dumps(doc))


def test_a_resealed_last_step_past_the_history_is_refused(traj, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for step in (10, 20, 30, 40):
        (run / f"checkpoint-{step}").symlink_to(traj["run"] / f"checkpoint-{step}", target_is_directory=True)
    partial = tmp_path / "partial"
    partial.mkdir()
    for step in (10, 20, 30):
        (partial / f"checkpoint-{step}").symlink_to(traj["run"] / f"checkpoint-{step}")
    out = tmp_path / "out"
    assert run_bema("stabilize", partial, "--base", traj["base"], "--out", out).returncode == 0
    state = out / ".bema-state" / "state.json"
    _reseal(state, lambda d: [r.update(last_step=40) for r in d["runs"]])  # the history ends at 30
    line = one_line_error(run_bema("stabilize", run, "--base", traj["base"], "--out", out), 3)
    assert (
        "runs[0].last_step 40 is not a step of the history (which ends at 30)" in line and str(state) in line
    )


def test_resealed_swapped_state_folders_are_refused(traj, tmp_path):
    out = tmp_path / "out"
    grid = ["--method", "ema", "--kappa", "0.5,0.9", "--steps", "10,20"]
    partial = tmp_path / "partial"
    partial.mkdir()
    for step in (10, 20):
        (partial / f"checkpoint-{step}").symlink_to(traj["run"] / f"checkpoint-{step}")
    assert run_bema("stabilize", partial, "--base", traj["base"], "--out", out, *grid).returncode == 0
    state = out / ".bema-state" / "state.json"

    def swap(doc):
        a, b = doc["runs"]
        a["state"], b["state"] = b["state"], a["state"]

    _reseal(state, swap)
    r = run_bema("stabilize", traj["run"], "--base", traj["base"], "--out", out, *grid[:4])
    line = one_line_error(r, 3)
    assert "names the state folder" in line and "which bema did not compute for it" in line, line


# -- 9. a finished --final-only call, run again, is up to date -------------------------------------
def test_rerunning_a_finished_final_only_call_is_up_to_date(traj, tmp_path):
    out = tmp_path / "out"
    args = ["--method", "bema,ema", "--final-only"]
    assert stabilize(traj, out, *args).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = stabilize(traj, out, *args, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["up_to_date"] is True
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing rewritten
    plain = stabilize(traj, out, *args)
    assert plain.returncode == 0 and "up to date" in plain.stderr
    # another setting into the same OUT is still refused (not silently "up to date")
    line = one_line_error(stabilize(traj, out, "--method", "bema,ema", "--eta", "0.5", "--final-only"), 4)
    assert "already exists" in line


# -- 10. global flags after the subcommand --------------------------------------------------------
def test_global_flags_work_after_the_subcommand(traj, tmp_path):
    r = stabilize(traj, tmp_path / "out", "--eta", "x", "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr  # --debug took effect
    r = stabilize(traj, tmp_path / "out2", "-q")
    assert r.returncode == 0 and r.stderr == ""  # -q: only errors on stderr


# -- 11. flags before inputs, instantly ----------------------------------------------------------
@pytest.mark.parametrize(
    "args, needle",
    [
        (["select", "/no/such/results", "--holdout", "2"], "--holdout: a fraction of the items in (0, 1)"),
        (["select", "/no/such/results", "--at", "x"], "--at: last, all or a step number"),
        (["simulate", "--steps", "-5"], "--steps: must be >= 1, got -5"),
    ],
)
def test_flags_are_checked_before_inputs_and_heavy_imports(args, needle):
    """Refused before torch, transformers or vLLM is imported (simulate imported torch for 4 s before
    it said no): a fresh interpreter runs the console script's `main` and says, as it exits, which of
    them it imported. Not timed: the zygote's processes have them imported already."""
    probe = (
        "import sys\nfrom bema_cli.cli import main\nsys.argv = ['bema', *sys.argv[1:]]\ntry:\n    main()\n"
        "finally:\n    print('imported:', *[m for m in HEAVY if m in sys.modules], file=sys.__stdout__)\n"
    ).replace("HEAVY", repr(("torch", "transformers", "vllm")))
    r = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
    line = one_line_error(r, 2)
    assert needle in line, line
    assert r.stdout.strip() == "imported:", r.stdout


# -- 12. sizes as people write them -----------------------------------------------------------------
def test_dry_run_says_sizes_in_binary_units(traj, tmp_path):
    r = stabilize(traj, tmp_path / "out", "--dry-run", "--max-memory", "2GiB")
    assert r.returncode == 0, r.stderr
    assert "(--max-memory 2 GiB)" in r.stdout and "2147483648" not in r.stdout


# -- 13. pipes and scripts ---------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["--help"], ["stabilize", "--help"]])
def test_help_into_a_closed_pipe_exits_141(args):
    proc = subprocess.Popen([str(BEMA), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()  # `| head -c 10`
    assert proc.wait(timeout=60) == 141, proc.stderr.read()


def test_an_error_under_json_is_one_json_document(traj, tmp_path):
    r = stabilize(traj, tmp_path / "out", "--eta", "0.2,,0.5", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout) == {"error": "--eta: an empty item in '0.2,,0.5'", "exit_code": 2}
    r = run_bema("select", tmp_path / "missing", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 3 == doc["exit_code"] and str(tmp_path / "missing") in doc["error"]
    r = run_bema("select", tmp_path / "missing")  # without --json stdout stays empty
    assert r.stdout == ""


# -- 14. bema env, --tasks list, other tools' flag names ----------------------------------------------
def test_env_names_versions_device_and_memory():
    import torch
    import transformers

    r = run_bema("env", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["torch"] == torch.__version__ and doc["transformers"] == transformers.__version__
    assert doc["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert 0 < doc["memory_available"] <= doc["memory_total"] and doc["cpus"] >= 1
    assert {"bema", "python", "vllm", "lm-eval", "huggingface_hub", "safetensors", "gpus"} <= set(doc)
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert doc["cpu"] and f": {doc['cpu']}\n" in cpuinfo  # the model name, as the kernel reports it
    flags = set(next(x for x in cpuinfo.splitlines() if x.startswith("flags")).split(":", 1)[1].split())
    assert doc["cpu_vector"] and set(doc["cpu_vector"]) <= flags and "avx2" in doc["cpu_vector"]
    text = run_bema("env").stdout
    assert f"- torch: {torch.__version__}" in text and "GiB" in text


@pytest.mark.parametrize("asked, runs", [(None, "OFF"), ("COMPATIBLE", "COMPATIBLE")])
def test_env_says_which_branch_mkl_runs(asked, runs):
    """MKL's own account, not the environment variable: an AMD CPU ignores MKL_CBWR=AVX2."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | ({"MKL_CBWR": asked} if asked else {})
    r = subprocess.run([str(BEMA), "env", "--json"], capture_output=True, text=True, env=env)
    assert json.loads(r.stdout)["mkl_branch"] == runs, r.stderr


def test_eval_tasks_list_names_every_task():
    from bema_cli.eval.tasks import TASKS

    r = run_bema("eval", "--tasks", "list", "--json")
    assert r.returncode == 0, r.stderr
    names = [row["task"] for row in json.loads(r.stdout)]
    assert names == [*TASKS, "lm_eval:<task>"]
    assert "GSM8K" in run_bema("eval", "--tasks", "list").stdout


@pytest.mark.parametrize("flag", ["--output_dir", "--output-path"])
def test_other_tools_output_flags_point_to_out(flag, tmp_path):
    line = one_line_error(run_bema("eval", tmp_path, flag, tmp_path / "x"), 2)
    assert f"no such option: {flag}" in line and "--out" in line, line


def test_select_on_an_lm_eval_metric_says_why(tmp_path):
    line = one_line_error(run_bema("select", tmp_path, "--metric", "lm_eval:arc_easy"), 2)
    assert "no per-item scores" in line and ":strict" not in line, line
