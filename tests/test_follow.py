"""`bema stabilize --follow` beside a training run, and the completeness rules it waits by.

The main test runs a real HF Trainer (tiny Qwen2, save_total_limit=2, tests/training_run.py)
in this process while `bema stabilize --follow --json` runs in a subprocess; every output it
streams must be byte-for-byte what a one-shot run over the copied-aside trajectory writes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import BEMA, run_bema
from safetensors.torch import save_file
from trajectory import tensor_section, write_trajectory

from bema_cli.io.watch import Watcher, declared_size, wait_for


def follow_cmd(run: Path, base: Path, out: Path, *args) -> list[str]:
    return [
        str(BEMA),
        "stabilize",
        str(run),
        "--base",
        str(base),
        "--out",
        str(out),
        "--follow",
        *map(str, args),
    ]


def weight_files(out: Path) -> dict[str, tuple]:
    """Every output's tensors, bitwise (its header's provenance names the run folder it was read from)."""
    return {
        str(p.relative_to(out)): tensor_section(p)
        for p in sorted(out.glob("[!.]*/checkpoint-*/*.safetensors"))
    }


class Lines:
    """Collect a subprocess's stdout lines with their arrival time (a reader thread)."""

    def __init__(self, proc: subprocess.Popen):
        self.items: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.items.append((time.monotonic(), line))

    def wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.items) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.items) >= n, f"only {len(self.items)} lines after {timeout} s"


# -- completeness rules (io/watch.py) on real files ------------------------------------------
def test_a_checkpoint_is_complete_by_trainer_state_or_settled_content(tmp_path, monkeypatch):
    import torch

    from bema_cli.io import watch

    run = tmp_path / "run"
    folder = run / "checkpoint-10"
    folder.mkdir(parents=True)
    save_file({"w": torch.randn(64, 64)}, tmp_path / "full.safetensors")
    data = (tmp_path / "full.safetensors").read_bytes()
    assert declared_size(tmp_path / "full.safetensors") == len(data)
    now = [0.0]
    watcher = Watcher(run, settle=5.0, clock=lambda: now[0])
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # being written
    assert watcher.complete() == {} and watcher.complete() == {}
    # created at full size (header first, data zero-filled), filled later: sizes match the header
    (folder / "model.safetensors").write_bytes(data[: len(data) - 64 * 64 * 4] + bytes(64 * 64 * 4))
    assert watcher.complete() == {} and watcher.complete() == {}  # stable across two polls: settling starts
    now[0] += 4.0
    assert watcher.complete() == {}  # not settled yet
    (folder / "model.safetensors").write_bytes(data)  # the writer fills it after a long pause
    now[0] += 10.0
    assert watcher.complete() == {}  # its content changed: not complete, settling starts again
    assert watcher.complete() == {}
    now[0] += 5.0
    assert watcher.complete() == {10: folder}  # content held still for --settle
    # settled once: later polls find it complete from its sizes and times alone, reading nothing
    hashed = []
    real_digest = watch.content_digest
    monkeypatch.setattr(watch, "content_digest", lambda *a: hashed.append(a) or real_digest(*a))
    now[0] += 5.0
    assert watcher.complete() == {10: folder} and watcher.complete() == {10: folder} and not hashed
    # rewritten after it settled (other bytes, a later mtime): complete again only once it settles
    (folder / "model.safetensors").write_bytes(data[:-64] + bytes(64))
    os.utime(folder / "model.safetensors", ns=(1, os.stat(folder / "model.safetensors").st_mtime_ns + 10**9))
    assert watcher.complete() == {} and watcher.complete() == {}
    now[0] += 5.0
    assert watcher.complete() == {10: folder} and len(hashed) == 2  # settled again, its content read twice
    monkeypatch.setattr(watch, "content_digest", real_digest)
    # a trainer_state.json no older than the weights counts at once
    other = run / "checkpoint-20"
    other.mkdir()
    (other / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-1.safetensors"}})
    )
    assert 20 not in watcher.complete() and 20 not in watcher.complete()
    (other / "model-1.safetensors").write_bytes(data)
    (other / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    assert watcher.complete()[20] == other
    # a marker written BEFORE the weights (older than them) does not count: the settle rule applies
    third = run / "checkpoint-30"
    third.mkdir()
    (third / "trainer_state.json").write_text(json.dumps({"global_step": 30}))
    os.utime(third / "trainer_state.json", ns=(1, 1))
    (third / "model.safetensors").write_bytes(data)
    assert 30 not in watcher.complete() and 30 not in watcher.complete()
    now[0] += 5.0
    assert watcher.complete()[30] == third
    assert set(watcher.seen) == {10, 20, 30}


def test_wait_sleeps_between_polls():
    """The wait loop sleeps `interval` between polls and gives up at the timeout (no busy loop)."""
    calls, sleeps = [], []
    assert not wait_for(
        lambda: calls.append(1) and False, 0.5, 1.2, sleep=lambda s: (sleeps.append(s), time.sleep(s))
    )
    assert len(calls) == len(sleeps) + 1 <= 4 and all(0 < s <= 0.5 for s in sleeps)
    t0 = time.process_time()
    assert not wait_for(lambda: False, 0.2, 1.0)
    assert time.process_time() - t0 < 0.1  # CPU time while waiting 1 s


# -- --follow end to end ----------------------------------------------------------------------
@pytest.mark.slow
def test_follow_beside_a_real_trainer_with_rotation(tiny_model_dir, tmp_path):
    """HF Trainer, 12 steps, a checkpoint every 2, save_total_limit=2; `--follow --json --until-step 12`
    prints one line per output while training goes on, and every output equals a one-shot run's."""
    from training_run import train_with_rotation

    run, copies, out = tmp_path / "run", tmp_path / "copies", tmp_path / "out"
    proc = subprocess.Popen(
        follow_cmd(
            run, tiny_model_dir, out, "--method", "bema,ema", "--poll", "0.2", "--until-step", "12", "--json"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = Lines(proc)
    try:
        time.sleep(3)  # let it start (imports) before the first checkpoint lands
        saved = train_with_rotation(tiny_model_dir, run, copies, steps=12, save_every=2, pause=1.5)
        training_done = time.monotonic()
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert rc == 0, proc.stderr.read()
    assert saved == [2, 4, 6, 8, 10, 12]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-10",
        "checkpoint-12",
    ]
    docs = [json.loads(line) for _, line in lines.items]
    assert sorted((d["run"], d["step"]) for d in docs) == sorted(
        (r, s) for r in ("bema-k0.5-e0.2", "ema-k0.5") for s in saved
    )
    assert lines.items[0][0] < training_done - 3  # streamed while training, not at the end
    r = run_bema(
        "stabilize", copies, "--base", tiny_model_dir, "--out", tmp_path / "one", "--method", "bema,ema"
    )
    assert r.returncode == 0, r.stderr
    assert weight_files(out) == weight_files(tmp_path / "one")
    for d in docs:
        assert Path(d["path"]).is_dir() and {"alpha", "beta", "kappa", "eta", "path"} <= set(d)


def test_follow_idle_timeout_sigterm_and_resume(tmp_path):
    base, full = write_trajectory(tmp_path / "traj", [10, 20, 30])
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    shutil.copytree(full / "checkpoint-10", run / "checkpoint-10")
    # --idle-timeout: exits 0 after processing what is there
    r = subprocess.run(
        follow_cmd(run, base, out, "--json", "--poll", "0.2", "--idle-timeout", "1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["step"] for x in r.stdout.splitlines()] == [10]
    # SIGTERM while waiting: a clean exit, a consistent state; a later run resumes
    proc = subprocess.Popen(
        follow_cmd(run, base, out, "--json", "--poll", "0.2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = Lines(proc)
    shutil.copytree(full / "checkpoint-20", run / "checkpoint-20")
    lines.wait(1, timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert json.loads(lines.items[0][1])["step"] == 20
    assert not list(out.glob(".bema-tmp-*")) and not (out / ".bema-lock").exists()
    shutil.copytree(full / "checkpoint-30", run / "checkpoint-30")
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    assert [o["step"] for o in json.loads(r.stdout)["outputs"]] == [30]
    r = run_bema("stabilize", full, "--base", base, "--out", tmp_path / "one")
    assert weight_files(out) == weight_files(tmp_path / "one")


def _incomplete(src: Path, dst: Path) -> None:
    """A checkpoint folder caught mid-write: half its weight file, no trainer_state.json."""
    dst.mkdir()
    data = (src / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("phi", [None, 20])
def test_follow_vanished_checkpoint_is_an_error_unless_phi_skips_it(tmp_path, phi):
    """checkpoint-30 is seen half-written, then deleted before it was complete: an error naming it,
    unless --phi 20 skips step 30 anyway (then step 40 is processed as usual)."""
    base, full = write_trajectory(tmp_path / "traj", [10, 20, 30, 40])
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    for s in (10, 20):
        shutil.copytree(full / f"checkpoint-{s}", run / f"checkpoint-{s}")
    extra = ["--phi", str(phi)] if phi else []
    proc = subprocess.Popen(
        follow_cmd(run, base, out, "--json", "--poll", "0.2", "--idle-timeout", "5", *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = Lines(proc)
    lines.wait(1, timeout=60)  # step 20 processed (phi 20: 10 is skipped)
    _incomplete(full / "checkpoint-30", run / "checkpoint-30")
    time.sleep(1.0)  # seen by a few polls, never complete
    shutil.rmtree(run / "checkpoint-30")
    shutil.copytree(full / "checkpoint-40", run / "checkpoint-40")
    rc = proc.wait(timeout=60)
    err = proc.stderr.read()
    if phi is None:
        assert rc == 3, err
        message = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(message) == 1 and "checkpoint-30" in message[0] and "disappeared" in message[0]
        assert "Traceback" not in err
    else:
        assert rc == 0, err
        assert [json.loads(x)["step"] for _, x in lines.items] == [20, 40]


def test_follow_flags_need_follow(tmp_path):
    base, run = write_trajectory(tmp_path, [10])
    r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "o", "--until-step", "10")
    assert r.returncode == 2 and "--follow" in r.stderr
    r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "o", "--follow", "--poll", "0")
    assert r.returncode == 2 and "--poll" in r.stderr
    assert not os.path.exists(tmp_path / "o")


def test_follow_a_checkpoint_every_run_skips_costs_no_cpu(tmp_path):
    """--phi 20: checkpoint-30 writes nothing and no state; the follower must go back to sleeping,
    not re-run a round for it at every poll."""
    base, full = write_trajectory(tmp_path / "traj", [10, 20, 30, 40])
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    shutil.copytree(full / "checkpoint-20", run / "checkpoint-20")
    proc = subprocess.Popen(
        follow_cmd(run, base, out, "--json", "--poll", "0.2", "--phi", "20", "--until-step", "40"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = Lines(proc)
    lines.wait(1, timeout=60)
    shutil.copytree(full / "checkpoint-30", run / "checkpoint-30")
    time.sleep(1.0)  # its round
    c0 = cpu_seconds(proc.pid)
    time.sleep(2.0)
    assert cpu_seconds(proc.pid) - c0 < 0.3  # sleeping between polls, not re-running rounds
    shutil.copytree(full / "checkpoint-40", run / "checkpoint-40")
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert [json.loads(x)["step"] for _, x in lines.items] == [20, 40]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("fmt", ["lora", "bin"])
def test_follow_reads_marker_less_lora_and_bin_runs(tiny_model_dir, tmp_path, fmt):
    """A PEFT adapter run and a .bin run saved without trainer_state.json: --follow processes every
    checkpoint once its content settled (it exited 0 with nothing written, or never ended, before),
    and the outputs equal a one-shot run's."""
    from formats import convert
    from lora_run import perturbed_adapters

    steps = [10, 20, 30]
    if fmt == "lora":
        base, run = tiny_model_dir, perturbed_adapters(tiny_model_dir, tmp_path / "run", steps)
    else:
        base, st_run = write_trajectory(tmp_path / "t", steps)
        run = tmp_path / "run"
        for s in steps:
            convert(st_run / f"checkpoint-{s}", run / f"checkpoint-{s}", "bin")
    for folder in run.iterdir():
        (folder / "trainer_state.json").unlink(missing_ok=True)
    out, ref = tmp_path / "out", tmp_path / "ref"
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--follow", "--poll", "0.2", "--settle", "0.5",
                 "--until-step", "30", "--json", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(json.loads(line)["step"] for line in r.stdout.splitlines()) == steps
    assert run_bema("stabilize", run, "--base", base, "--out", ref).returncode == 0
    assert weight_files(out) == weight_files(ref)
