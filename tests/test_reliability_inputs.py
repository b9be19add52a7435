"""Nothing lost, round two: hostile inputs to discovery, the readers' file checks and follow mode.

A FIFO or socket named like a file bema reads must be refused by name (exit 3), never opened:
opening a FIFO blocks forever, in plain runs and in --follow (where it would defeat
--idle-timeout). Every run here has a subprocess timeout, so a regression fails instead of
hanging. Follow mode must take every checkpoint layout plain stabilize takes, and must not read a
weight file that was created at full size and is still being filled. Steps are ASCII digits
only. Impossible `bema simulate` sizes are usage errors computed up front.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import one_line_error, run_bema
from test_follow import Lines, follow_cmd, weight_files
from trajectory import write_trajectory

LIMIT = 90  # seconds: a run that blocks on a FIFO is killed here and the test fails


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _socket(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(path.parent)  # bound by its short name: AF_UNIX paths are limited to ~108 bytes
    try:
        sock.bind(path.name)
    finally:
        os.chdir(here)
    return sock


@pytest.fixture
def traj(tmp_path) -> tuple[Path, Path]:
    return write_trajectory(tmp_path / "traj", [10, 20])


def _refused(proc, name: str) -> None:
    line = one_line_error(proc, 3)
    assert name in line and "not a regular file" in line, line


# --- 1. non-regular files are refused by name, before any open -------------------------------
@pytest.mark.parametrize(
    "where",
    [
        "run/checkpoint-20/model.safetensors",
        "base/model.safetensors",
        "run/checkpoint-10/config.json",
        "run/checkpoint-20/model.safetensors.index.json",
    ],
)
@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_special_file_named_like_an_input_is_refused(traj, tmp_path, where, kind):
    base, run = traj
    target = tmp_path / "traj" / where
    sock = _socket(target) if kind == "socket" else _fifo(target)
    try:
        proc = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "out", timeout=LIMIT)
    finally:
        if sock:
            sock.close()
    _refused(proc, str(target))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["bin", "dcp"])
def test_fifo_weights_of_other_formats_are_refused(traj, tmp_path, fmt):
    from formats import convert

    base, run = traj
    other = tmp_path / "other"
    for step in (10, 20):
        convert(run / f"checkpoint-{step}", other / f"checkpoint-{step}", fmt)
    folder = other / "checkpoint-20"
    target = folder / "pytorch_model.bin" if fmt == "bin" else next(folder.rglob("*.distcp"))
    _fifo(target)
    proc = run_bema("stabilize", other, "--base", base, "--out", tmp_path / "out", timeout=LIMIT)
    _refused(proc, str(target))


def test_fifo_lora_adapter_is_refused(tiny_model_dir, tmp_path):
    from lora_run import perturbed_adapters

    run = perturbed_adapters(tiny_model_dir, tmp_path / "run", [10, 20])
    target = run / "checkpoint-20" / "adapter_model.safetensors"
    _fifo(target)
    proc = run_bema("stabilize", run, "--base", tiny_model_dir, "--out", tmp_path / "out", timeout=LIMIT)
    _refused(proc, str(target))


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.json"])
def test_follow_refuses_a_fifo_instead_of_blocking(traj, tmp_path, name):
    """A FIFO appearing in a followed run ends the follower with the error, well within --idle-timeout."""
    base, full = traj
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(full / "checkpoint-10", run / "checkpoint-10")
    shutil.copytree(full / "checkpoint-20", run / "checkpoint-20")
    _fifo(run / "checkpoint-20" / name)
    t0 = time.monotonic()
    proc = subprocess.run(
        follow_cmd(run, base, tmp_path / "out", "--poll", "0.2", "--idle-timeout", "20"),
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    assert time.monotonic() - t0 < 20 + 15  # did not wait out --idle-timeout
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    assert str(run / "checkpoint-20" / name) in lines[0] and "Traceback" not in proc.stderr


# --- 2. follow takes every layout plain stabilize takes ---------------------------------------
@pytest.mark.parametrize("layout", ["step_{}", "step-{}", "global_step{}", "iter_{:07d}"])
def test_follow_reads_every_checkpoint_layout(traj, tmp_path, layout):
    base, full = traj
    run = tmp_path / "run"
    run.mkdir()
    for step in (10, 20):
        shutil.copytree(full / f"checkpoint-{step}", run / layout.format(step))
    proc = subprocess.run(
        follow_cmd(run, base, tmp_path / "out", "--json", "--poll", "0.2", "--until-step", "20",
                   "--idle-timeout", "30"),
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(x)["step"] for x in proc.stdout.splitlines()) == [10, 20]
    assert "--until-step 20" in proc.stderr  # stopped because step 20 was processed, not idle
    one = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "one", timeout=LIMIT)
    assert one.returncode == 0, one.stderr
    assert weight_files(tmp_path / "out") == weight_files(tmp_path / "one") != {}


# --- 3. durations must be finite --------------------------------------------------------------
@pytest.mark.parametrize(
    "flag, value",
    [
        ("--poll", "nan"),
        ("--poll", "inf"),
        ("--poll", "-1"),
        ("--idle-timeout", "nan"),
        ("--idle-timeout", "inf"),
        ("--idle-timeout", "-0.5"),
        ("--until-step", "-1"),
    ],
)
def test_follow_durations_must_be_finite(traj, tmp_path, flag, value):
    base, run = traj
    proc = run_bema(
        "stabilize", run, "--base", base, "--out", tmp_path / "out", "--follow", flag, value, timeout=LIMIT
    )
    assert flag in one_line_error(proc, 2)
    assert not (tmp_path / "out").exists()


# --- 4. a weight file preallocated at full size and filled over seconds -----------------------
WRITER = r"""
import os, sys, time
src, dst, state_first = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
data = open(os.path.join(src, "model.safetensors"), "rb").read()
os.makedirs(dst)
for name in ("config.json",) + (("trainer_state.json",) if state_first else ()):
    open(os.path.join(dst, name), "wb").write(open(os.path.join(src, name), "rb").read())
n = 8 + int.from_bytes(data[:8], "little")
with open(os.path.join(dst, "model.safetensors"), "wb", buffering=0) as f:
    f.truncate(len(data))  # full size at once, zeros behind a valid header
    f.write(data[:n])
    chunk = max(1, (len(data) - n) // 60)
    for at in range(n, len(data), chunk):  # filled over ~3 s, a write every 0.05 s
        time.sleep(0.05)
        f.seek(at)
        f.write(data[at : at + chunk])
print("done", flush=True)
"""


@pytest.mark.parametrize("state_first", [True, False], ids=["trainer_state-first", "no-trainer_state"])
def test_follow_waits_for_a_preallocated_file_being_filled(tmp_path, state_first):
    shapes = {"w": (256, 256), "b": (256,)}  # 256 KiB of float32: 60 chunks of ~4 KiB
    base, full = write_trajectory(tmp_path / "traj", [10, 20], shapes=shapes, with_int=False)
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    shutil.copytree(full / "checkpoint-10", run / "checkpoint-10")
    proc = subprocess.Popen(
        follow_cmd(run, base, out, "--json", "--poll", "0.5", "--until-step", "20"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = Lines(proc)
    try:
        lines.wait(1, timeout=LIMIT)  # step 10 processed: the follower is polling
        writer = subprocess.run(
            [sys.executable, "-c", WRITER, str(full / "checkpoint-20"), str(run / "checkpoint-20"),
             "1" if state_first else "0"],
            capture_output=True, text=True, timeout=LIMIT,
        )  # fmt: skip
        assert writer.returncode == 0, writer.stderr
        rc = proc.wait(timeout=LIMIT)
    finally:
        proc.kill()
    assert rc == 0, proc.stderr.read()
    one = run_bema("stabilize", full, "--base", base, "--out", tmp_path / "one", timeout=LIMIT)
    assert one.returncode == 0, one.stderr
    assert weight_files(out) == weight_files(tmp_path / "one") != {}


def test_a_held_file_that_changes_while_read_is_refused(tmp_path):
    """The engine's after-read check (io/watch.check_unchanged) on a real file rewritten in place."""
    from bema_cli.errors import InputError
    from bema_cli.io.watch import check_unchanged, held_stats, hold_files, release

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x" * 4096)
    _, fds = hold_files([path])
    try:
        before = held_stats(fds)
        check_unchanged([path], fds, before)  # untouched: fine
        with open(path, "r+b") as f:
            f.write(b"y")
        os.utime(path, ns=(before[0][1] + 10**9, before[0][1] + 10**9))  # a later write, a later mtime
        with pytest.raises(InputError, match="changed while it was being read"):
            check_unchanged([path], fds, before)
    finally:
        release(fds)


# --- 5. steps are ASCII digits ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["checkpoint-\u0661\u0662", "checkpoint-\uff11\uff12", "checkpoint-\u00b2"])
def test_non_ascii_digit_folder_is_refused_by_name(traj, tmp_path, name):
    """Arabic-Indic, fullwidth and superscript digits are not a step: no trainer writes them, so the
    folder is treated like checkpoint-final (step from trainer_state.json, else refused by name)."""
    base, run = traj
    shutil.copytree(run / "checkpoint-20", run / name)
    (run / name / "trainer_state.json").unlink()
    proc = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "out", timeout=LIMIT)
    line = one_line_error(proc, 3)
    assert name in line and "digits 0-9" in line
    proc = run_bema("eval", run, "--out", tmp_path / "eval", timeout=LIMIT)
    assert name in one_line_error(proc, 3)


def test_non_ascii_digit_folder_takes_its_step_from_trainer_state(traj, tmp_path):
    base, run = traj
    shutil.move(run / "checkpoint-20", run / "checkpoint-\u0662\u0660")
    proc = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "out", "--json", timeout=LIMIT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(o["step"] for o in json.loads(proc.stdout)["outputs"]) == [10, 20]


@pytest.mark.parametrize("step", ["\u0661\u0662", "\uff11\uff12", "\u00b2", "12.0", True, -5])
def test_trainer_state_step_must_be_ascii_digits(traj, tmp_path, step):
    base, run = traj
    final = run / "checkpoint-final"
    shutil.move(run / "checkpoint-20", final)
    (final / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    proc = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "out", timeout=LIMIT)
    line = one_line_error(proc, 3)
    assert str(final / "trainer_state.json") in line and "global_step" in line


@pytest.mark.parametrize("step", ["\u0661\u0662", "\uff11\uff12", "\u00b2"])
def test_stdin_list_step_must_be_ascii_digits(traj, tmp_path, step):
    base, run = traj
    text = f"10 {run / 'checkpoint-10'}\n{step} {run / 'checkpoint-20'}\n"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("bema")), "stabilize", "-", "--base", str(base),
         "--out", str(tmp_path / "out")],
        input=text, capture_output=True, text=True, timeout=LIMIT,
    )  # fmt: skip
    line = one_line_error(proc, 3)
    assert "line 2" in line and "STEP PATH" in line


# --- 6. impossible simulate sizes ----------------------------------------------------------------
@pytest.mark.parametrize(
    "args, flag",
    [
        (["--dim", "1000000000000"], "--dim"),
        (["--trials", "100000000000000"], "--trials"),
        (["--steps", "100000000000"], "--steps"),
    ],
)
def test_simulate_too_big_is_a_usage_error(args, flag):
    proc = run_bema("simulate", *args, timeout=LIMIT)
    line = one_line_error(proc, 2)
    assert flag in line and "GiB" in line and "memory" in line


def test_simulate_memory_check_is_computed_from_the_sizes():
    from bema_cli.errors import UsageError
    from bema_cli.simulate import check_memory

    check_memory(20, 1000, 1000, 6, available=2**30)  # the defaults: ~1 MiB
    with pytest.raises(UsageError, match="--dim 20 x --trials 1000"):
        check_memory(20, 1000, 1000, 6, available=2**20)
