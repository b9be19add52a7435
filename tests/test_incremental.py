"""Incremental `bema stabilize` (OUT/.bema-state): re-runs read only new checkpoints and give outputs
bitwise identical to a one-shot run; every refusal is one line; kill -9 at any moment is safe.

Real CLI subprocesses on real safetensors trajectories (tests/trajectory.py). "Bitwise" means the
output safetensors files are byte-for-byte equal (headers included), and so the tensors too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BEMA, one_line_error, run_bema
from trajectory import tensor_section, write_trajectory

STEPS = [10, 20, 30, 40, 50, 60, 70, 80]
GRID = ["--method", "vanilla,ema,bema,dema,ouema"]


def stabilize(run_dir: Path, base: Path, out: Path, *args) -> dict:
    r = run_bema("stabilize", run_dir, "--base", base, "--out", out, *GRID, *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def refused(run_dir: Path, base: Path, out: Path, *args) -> str:
    r = run_bema("stabilize", run_dir, "--base", base, "--out", out, *GRID, *args)
    return one_line_error(r)


def copy_steps(src: Path, dst: Path, steps: list[int]) -> None:
    dst.mkdir(exist_ok=True)
    for s in steps:
        shutil.copytree(src / f"checkpoint-{s}", dst / f"checkpoint-{s}")


def weight_files(out: Path) -> dict[str, tuple]:
    """Every output safetensors file under OUT (state excluded), by relative path: its tensors' layout
    and bytes (the header's provenance names the run folder, which differs between these runs)."""
    return {
        str(p.relative_to(out)): tensor_section(p)
        for p in sorted(out.glob("*/checkpoint-*/*.safetensors"))
        if not p.relative_to(out).parts[0].startswith(".")
    }


@pytest.fixture(scope="module")
def traj(tmp_path_factory):
    return write_trajectory(tmp_path_factory.mktemp("traj"), STEPS)


@pytest.fixture(scope="module")
def one_shot(traj, tmp_path_factory):
    """The reference: one call over all 8 checkpoints, for tau 0 and tau 20."""
    base, run = traj
    outs = {}
    for tau in (0, 20):
        out = tmp_path_factory.mktemp(f"one-tau{tau}") / "out"
        stabilize(run, base, out, "--tau", str(tau))
        outs[tau] = weight_files(out)
    return outs


@pytest.mark.parametrize("tau", [0, 20])
def test_four_then_four_is_bitwise_one_shot(traj, one_shot, tmp_path, tau):
    """4 checkpoints, then 4 more after the trainer rotated 3 away: same bytes as one call over all 8;
    earlier outputs untouched; the second call reads only the new checkpoints (and theta0 for bema/ouema,
    except after a burn-in, when theta0 comes from the state); a third call is a no-op."""
    base, run = traj
    part, out = tmp_path / "run", tmp_path / "out"
    copy_steps(run, part, STEPS[:4])
    first = stabilize(part, base, out, "--tau", str(tau))
    assert sorted({o["step"] for o in first["outputs"]}) == STEPS[:4]
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*/checkpoint-*/*")}
    for s in STEPS[:3]:
        shutil.rmtree(part / f"checkpoint-{s}")  # save_total_limit-style rotation
    copy_steps(run, part, STEPS[4:])
    second = stabilize(part, base, out, "--tau", str(tau))
    assert sorted({o["step"] for o in second["outputs"]}) == STEPS[4:]
    assert len(second["outputs"]) == 5 * 4
    ckpt_bytes = sum(
        p.stat().st_size - 8 - _header_len(p)
        for s in STEPS[4:]
        for p in [part / f"checkpoint-{s}/model.safetensors"]
    )
    base_bytes = (base / "model.safetensors").stat().st_size - 8 - _header_len(base / "model.safetensors")
    assert second["read_bytes"] == ckpt_bytes + (0 if tau else base_bytes)
    assert second["state_bytes"] > 0
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before  # earlier outputs untouched
    assert weight_files(out) == one_shot[tau]
    # the continued run's weights carry what a one-shot run's carry: the coefficients over the whole
    # trajectory and a fingerprint of every input, those rotated away too (from the state's record)
    from bema_cli.io import provenance

    doc = provenance.read(out / "ema-k0.5" / f"checkpoint-{STEPS[-1]}")
    assert set(doc["inputs"]) == {"theta0", *map(str, STEPS)}
    assert abs(sum(doc["coefficients"].values()) - 1) < 1e-12
    assert (str(STEPS[0]) in doc["coefficients"]) == (tau == 0)  # a burn-in to step 20 drops step 10
    manifest = json.loads((out / "manifest.json").read_text())
    assert {r["run"]: [o["step"] for o in r["outputs"]] for r in manifest["runs"]} == {
        r: STEPS for r in ("vanilla", "ema-k0.5", "bema-k0.5-e0.2", "dema-k0.5", "ouema-k0.5-e0.2")
    }
    third = stabilize(part, base, out, "--tau", str(tau))
    assert third["outputs"] == [] and third["read_bytes"] == 0
    assert third["up_to_date"] is True and third["last_step"] == STEPS[-1] and second["up_to_date"] is False
    assert set(third) == set(second)  # a no-op's --json has a working run's keys
    r = run_bema("stabilize", part, "--base", base, "--out", out, *GRID, "--tau", str(tau))
    assert r.returncode == 0 and r.stdout == "", r.stderr  # no empty table: one line saying so
    assert r.stderr.strip() == f"up to date: last step {STEPS[-1]} (nothing new to stabilize in {out})"
    assert not list(out.glob(".bema-tmp-*"))


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def test_keep_last_and_one_new_checkpoint_at_a_time(traj, one_shot, tmp_path):
    """Checkpoints arriving one by one with --keep-last 2: only the 2 newest outputs of each run remain,
    and they are the one-shot run's bytes."""
    base, run = traj
    part, out = tmp_path / "run", tmp_path / "out"
    for s in STEPS:
        copy_steps(run, part, [s])
        doc = stabilize(part, base, out, "--keep-last", "2")
        assert {o["step"] for o in doc["outputs"]} == {s}
    files = weight_files(out)
    assert sorted(files) == sorted(k for k in one_shot[0] if "checkpoint-70" in k or "checkpoint-80" in k)
    assert all(files[k] == one_shot[0][k] for k in files)
    manifest = json.loads((out / "manifest.json").read_text())
    assert all([o["step"] for o in r["outputs"]] == [70, 80] for r in manifest["runs"])


def test_refusals_are_one_line(traj, tmp_path):
    base, run = traj
    part, out = tmp_path / "run", tmp_path / "out"
    copy_steps(run, part, STEPS[:4])
    stabilize(part, base, out)
    # a changed schedule names the difference; --restart recomputes
    line = refused(part, base, out, "--gamma", "2")
    assert "--gamma is 2.0" in line and "1.0" in line and "--restart" in line
    assert "--accum-dtype" in refused(part, base, out, "--accum-dtype", "float64")
    assert "--phi" in refused(part, base, out, "--phi", "20")
    # a consumed checkpoint that changed on disk is named
    shutil.copytree(part / "checkpoint-20", tmp_path / "keep20")
    shutil.copy(run / "checkpoint-30" / "model.safetensors", part / "checkpoint-20" / "model.safetensors")
    line = refused(part, base, out)
    assert "checkpoint-20" in line and "changed on disk" in line
    shutil.rmtree(part / "checkpoint-20")
    shutil.copytree(tmp_path / "keep20", part / "checkpoint-20")
    # a new run needs the whole trajectory: a clear error once earlier checkpoints are gone
    shutil.rmtree(part / "checkpoint-10")
    r = run_bema("stabilize", part, "--base", base, "--out", out, "--method", "ema", "--kappa", "0.7")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    assert "checkpoint-10" in r.stderr and "ema-k0.7" in r.stderr
    # a new checkpoint older than the last processed step
    copy_steps(run, part, [10])
    os.rename(part / "checkpoint-10", part / "checkpoint-35")
    line = refused(part, base, out)
    assert "checkpoint-35" in line and "older than the last processed step 40" in line
    shutil.rmtree(part / "checkpoint-35")
    copy_steps(run, part, [10])
    # an output folder the state does not know is protected
    (out / "bema-k0.5-e0.4").mkdir()
    r = run_bema("stabilize", part, "--base", base, "--out", out, "--eta", "0.4")
    assert r.returncode != 0 and "bema-k0.5-e0.4" in r.stderr and "--overwrite" in r.stderr
    # --restart recomputes a run with a changed schedule from scratch (needs the whole trajectory)
    doc = stabilize(part, base, out, "--gamma", "2", "--restart")
    assert sorted({o["step"] for o in doc["outputs"]}) == STEPS[:4]
    assert "gamma is" in refused(part, base, out)  # the state now holds gamma 2


def test_new_run_joins_an_existing_state(traj, one_shot, tmp_path):
    """A run added to the grid later starts from theta0 and reads everything; the others continue."""
    base, run = traj
    part, out = tmp_path / "run", tmp_path / "out"
    copy_steps(run, part, STEPS[:4])
    r = run_bema("stabilize", part, "--base", base, "--out", out, "--method", "ema,bema", "--json")
    assert r.returncode == 0, r.stderr
    copy_steps(run, part, STEPS[4:])
    doc = stabilize(part, base, out)  # + vanilla, dema, ouema from scratch
    steps = {}
    for o in doc["outputs"]:
        steps.setdefault(o["run"], []).append(o["step"])
    assert steps["ema-k0.5"] == STEPS[4:] and steps["dema-k0.5"] == STEPS
    assert weight_files(out) == one_shot[0]


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3, 4))])
def test_kill_9_at_random_moments_then_rerun_is_bitwise_one_shot(traj, one_shot, tmp_path, seed):
    """Incremental calls (4, then 2, then 2 more checkpoints), each killed with SIGKILL at a random
    moment (commit pauses widened so kills land inside commits too), then re-run to completion."""
    rng = random.Random(seed)
    base, run = traj
    part, out = tmp_path / "run", tmp_path / "out"
    cmd = [str(BEMA), "stabilize", str(part), "--base", str(base), "--out", str(out), *GRID]
    env = {**os.environ, "BEMA_TEST_COMMIT_PAUSE": "0.05"}
    # kill moments are drawn within the length of an uninterrupted first call, timed here: a fixed
    # range stops hitting anything once calls get faster than it
    scratch = tmp_path / "timing"
    scratch.mkdir()
    copy_steps(run, scratch / "run", STEPS[:4])
    t0 = time.monotonic()
    timed = [*cmd[:2], str(scratch / "run"), *cmd[3:6], str(scratch / "out"), *GRID]
    assert subprocess.run(timed, capture_output=True, env=env).returncode == 0
    call = time.monotonic() - t0
    killed = 0
    for batch in (STEPS[:4], STEPS[4:6], STEPS[6:]):
        copy_steps(run, part, batch)
        for _ in range(2):
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            try:
                proc.wait(timeout=rng.uniform(0.1, 0.95) * call)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed += 1
            assert time.monotonic() - t0 < 60
        r = run_bema("stabilize", part, "--base", base, "--out", out, *GRID)
        assert r.returncode == 0, r.stderr
    assert killed >= 1
    assert weight_files(out) == one_shot[0]
    assert not list(out.glob(".bema-tmp-*")) and not (out / ".bema-lock").exists()
    state = json.loads((out / ".bema-state" / "state.json").read_text())
    assert sorted(p.name for p in (out / ".bema-state").iterdir() if p.is_dir()) == sorted(
        {r["state"] for r in state["runs"] if r["state"]}
    )


def test_a_state_written_with_its_states_in_one_file_is_continued(traj, one_shot, tmp_path):
    """Until 2026-11-27 a state folder held all its states in one file (DEMA's e1 beside e2); now
    each state has files of its own (state_store.state_layout). A state folder of the old layout,
    sealed as bema sealed it, is still continued from, bitwise as one call over every step."""
    from safetensors.torch import load_file, save_file

    from bema_cli.stabilize import state_doc

    base, run = traj
    part, out = tmp_path / "run", tmp_path / "out"
    copy_steps(run, part, STEPS[:4])
    stabilize(part, base, out)
    doc_path = out / ".bema-state" / "state.json"
    doc = json.loads(doc_path.read_text())
    merged = 0
    for folder in (out / ".bema-state").iterdir():
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if len(files) > 1:  # dema's e1 and e2: into one model.safetensors, as before
            tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
            for f in files:
                f.unlink()
            save_file(tensors, str(folder / "model.safetensors"))
            doc["checksums"][folder.name] = state_doc.checksums(folder)
            merged += 1
    assert merged == 1  # dema's folder (ema/bema and ouema hold one state each)
    doc["seal"] = state_doc.seal(doc)
    doc_path.write_text(json.dumps(doc))
    copy_steps(run, part, STEPS[4:])
    stabilize(part, base, out)
    assert weight_files(out) == one_shot[0]


def test_the_states_run_is_named_not_given_by_its_local_path(traj, tmp_path):
    """OUT/.bema-state/state.json named the run by its absolute path: it names it as records name an
    input (against OUT), and a continued call with the run spelled relative keeps reading only the new
    checkpoints."""
    base, run = traj
    project = tmp_path / "project"
    part, out = project / "run", project / "out"
    project.mkdir()
    copy_steps(run, part, STEPS[:4])
    stabilize(part, base, out)
    doc = json.loads((out / ".bema-state" / "state.json").read_text())
    assert doc["checkpoint_dir"] == "run", doc["checkpoint_dir"]
    copy_steps(run, part, STEPS[4:])
    r = run_bema("stabilize", "run", "--base", base, "--out", "out", *GRID, "--json", cwd=project)
    assert r.returncode == 0, r.stderr
    assert sorted({o["step"] for o in json.loads(r.stdout)["outputs"]}) == STEPS[4:]
