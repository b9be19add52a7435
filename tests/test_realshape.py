"""The user's loop on a Qwen2.5-0.5B shape (bench/realshape.py: published dimensions, random bf16
weights, a local tokenizer): stabilize, then a vLLM sweep, on real sizes.

What must hold at this size: the sweep's host RAM per parameter, engine included (one model in
the engine, one float32 EMA, theta0 and theta_s read again from their files rather than held,
freed blocks returned to the OS: measured 10.9 B/param; 14.9 with theta0/theta_s held in bf16;
the issue's target is 14); the memory estimates (stabilize's, the sweep's) within 10% of the
measured peak; every stage's
bytes. Wall time against the projection is a speed target, so it lives in the benchmark
(bench/bench_real.py prints each ratio and whether it is within 2x), not here: a timed assertion
fails on a loaded machine whatever the code does (CI read 3.0x once, before the state's writes were
projected).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import run_bema, vllm_available, without_zygote

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import realshape  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = [100, 200, 300]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return realshape.build(tmp_path_factory.mktemp("qwen05"), "0.5b", STEPS)


def test_stabilize_on_the_05b_shape_reports_its_stages_and_its_peak(world, tmp_path):
    from bema_cli.machine import PeakRss

    args = ["stabilize", world["run"], "--base", world["base"], "--out", tmp_path / "stab",
            "--method", "bema,ema", "--steps", "300", "--json"]  # fmt: skip
    without_zygote()  # PeakRss samples every process below this one: bema's alone
    with PeakRss(every=0.05) as peak:  # the bema process's private memory, sampled
        r = run_bema(*args, fresh=True)  # its peak memory is the process's own: a fresh interpreter
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # the projection counts every unit-sized buffer: the motion's previous checkpoint, left out of
    # it for a while, put the peak at 1.26x (measured 1.38 GB against 1.40 projected now)
    assert peak.parts()["peak_rss_engine"] == pytest.approx(doc["projection"]["peak_memory_bytes"], rel=0.1)
    assert set(doc["stages"]) >= {"discover", "read", "compute", "write", "state", "commit"}
    assert doc["stages"]["read"]["bytes"] == doc["read_bytes"]  # theta0 + 3 checkpoints, each read once
    assert doc["stages"]["write"]["bytes"] == pytest.approx(doc["written_bytes"], rel=1e-3)
    # one float32 EMA state (bema and ema at one kappa share it), written once and projected
    assert doc["stages"]["state"]["bytes"] == pytest.approx(4 * world["numel"], rel=1e-3)
    assert doc["projection"]["parts_seconds"]["state"] > 0, doc["projection"]


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")
def test_vllm_sweep_on_the_05b_shape_memory_and_projection(world, tmp_path):
    data = realshape.write_eval_data(tmp_path / "data", loss_records=4)
    args = ["sweep", world["run"], "--base", world["base"], "--method", "bema,ema", "--at", "300",
            "--tasks", "loss", "--loss-data", data / "heldout.jsonl", "--backend", "vllm", "--out", tmp_path / "sweep"]  # fmt: skip
    dry = run_bema(*args, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    projected = json.loads(dry.stdout)["projection"]
    results = tmp_path / "sweep" / "results.jsonl"
    assert not (results.exists() and results.read_text().strip())  # a dry run evaluates nothing
    # one process, as `make` runs it: bema's peak is then the engine's too (with the engine core in
    # its own process, peak_rss adds two separately sampled peaks: an upper bound, 9.6 GB here)
    r = run_bema(*args, "--json", timeout=1200, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    memory = doc["memory"]
    # the engine runs in bema's process here, so bema's own peak (VmHWM) is the sweep's with the
    # engine; processes below it (compile workers) are reported apart, in peak_rss_engine. (CI once
    # read 17.8 GB here: ru_maxrss, carried over from this test process across fork and exec.)
    own = memory["peak_rss_bema"]
    assert own / world["numel"] <= 12.5, memory  # the target is 14 (measured 10.9)
    assert abs(memory["estimate"] - own) <= 0.10 * own, memory
    assert projected["seconds"] > 0, projected  # its ratio to the wall time: bench/bench_real.py
    losses = {rec["run"]: rec["metrics"]["loss"] for rec in doc["records"] if rec["task"] == "loss"}
    assert set(losses) == {"vanilla", "bema-k0.5-e0.2", "ema-k0.5"} and len(set(losses.values())) == 3
    assert set(doc["stages"]) >= {"engine_start", "walk", "swap", "loss"}
