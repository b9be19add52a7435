"""`bema eval --executor ray --workers 2`: the REAL vLLM (CPU) engine in 2 Ray actors.

Over the base, 3 raw checkpoints and their 3 stabilized outputs, the records (run, step,
task, metrics) equal the local executor's (one engine, weights swapped in place); a re-run
evaluates nothing; killing an engine actor mid-run (`ray.kill`) still completes with the same
records. The Ray cluster (2 CPUs) is started in this test process; the CLI joins it through
RAY_ADDRESS, so the test can find the CLI's engine actors by name and kill one.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from conftest import BEMA, run_bema, train_tiny, vllm_available
from test_eval import read_jsonl, write_data

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # a Ray cluster and 5 vLLM engine starts
    pytest.mark.skipif(not vllm_available(), reason="vllm is not importable"),
]
STEPS = (10, 20, 30)
# sampled (2 per prompt, seeded) as well as greedy-free: equal records need equal batches and seeds
PROTOCOL = "--tasks gsm8k,boolq --n-samples 2 --max-new-tokens 12 --limit 3 --dtype float32".split()


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    ray = pytest.importorskip("ray")
    root = tmp_path_factory.mktemp("ray-eval")
    data_dir = write_data(root / "data")
    run = root / "run"
    for step in STEPS:  # a short fine-tuning trajectory: more steps, further from the base
        shutil.copytree(
            train_tiny(tiny_model_dir, root / f"t{step}", steps=step)["float32"], run / f"checkpoint-{step}"
        )
    r = run_bema("stabilize", run, "--base", tiny_model_dir, "--out", root / "stab")
    assert r.returncode == 0, r.stderr
    args = [run, root / "stab", "--base", tiny_model_dir, "--data-dir", data_dir,
            "--loss-data", data_dir / "heldout.jsonl", "--backend", "vllm", *PROTOCOL]  # fmt: skip
    local = run_bema("eval", *args, "--out", root / "local")
    assert local.returncode == 0, local.stderr
    ctx = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20)
    yield {"root": root, "args": args, "address": ctx.address_info["gcs_address"]}
    ray.shutdown()


def records(out) -> dict:
    rows = read_jsonl(out / "results.jsonl")
    keyed = {(r["model_path"], r["run"], r["step"], r["task"]): r["metrics"] for r in rows}
    assert len(keyed) == len(rows)  # every (checkpoint, run, task) once
    return keyed


def test_two_engine_actors_match_local_and_resume(setup):
    root, env = setup["root"], {"RAY_ADDRESS": setup["address"]}
    r = run_bema(
        "eval", *setup["args"], "--out", root / "ray", "--executor", "ray", "--workers", "2", env=env
    )
    assert r.returncode == 0, r.stderr
    assert "evaluating 7 checkpoint(s) on 2 Ray engine actor(s)" in r.stderr
    local = records(root / "local")
    # base (for the vanilla and the bema run) + 3 raw + 3 stabilized, 3 tasks each
    assert len(local) == (2 + 3 + 3) * 3
    assert records(root / "ray") == local
    before = (root / "ray" / "results.jsonl").read_bytes()
    again = run_bema(
        "eval", *setup["args"], "--out", root / "ray", "--executor", "ray", "--workers", "2", env=env
    )
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("(all tasks in results.jsonl)") == 7
    assert "Ray engine actor" not in again.stderr  # nothing left: no actor started
    assert (root / "ray" / "results.jsonl").read_bytes() == before


def test_a_killed_engine_actor_is_replaced_and_its_checkpoint_requeued(setup):
    import ray

    root = setup["root"]
    out = root / "killed"
    cmd = [
        str(BEMA),
        "eval",
        *map(str, setup["args"]),
        "--out",
        str(out),
        "--executor",
        "ray",
        "--workers",
        "2",
    ]
    proc = subprocess.Popen(
        cmd, env={**__import__("os").environ, "RAY_ADDRESS": setup["address"]},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    killed = None
    deadline = time.monotonic() + 400
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        done = len(read_jsonl(out / "results.jsonl")) if (out / "results.jsonl").is_file() else 0
        if done:  # both engines are up and the first checkpoint is in: kill one engine mid-run
            actors = [
                a
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("bema-engine-")
            ]
            if actors:
                killed = actors[0]["name"]
                ray.kill(ray.get_actor(killed, namespace=actors[0]["namespace"]))
        time.sleep(0.5)
    _, stderr = proc.communicate(timeout=600)
    assert killed is not None, stderr
    assert proc.returncode == 0, stderr
    assert "engine actor lost" in stderr and "requeued" in stderr
    assert records(out) == records(root / "local")
