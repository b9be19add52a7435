"""`bema stabilize --executor ray` on a real local Ray cluster: bitwise the local executor's outputs.

The cluster is started once in this test process (2 CPUs); the CLI subprocesses join it through
RAY_ADDRESS, except one run that starts its own Ray in-process (no address). Without Ray
importable, `--executor ray` is a one-line error (a subprocess where `import ray` fails).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_bema
from formats import convert
from safetensors.torch import load_file, save_file
from trajectory import tensor_section, write_trajectory

STEPS = [10, 20, 30, 40, 50]
# a grid over several methods, 2 input shards, 3 output shards, tensors cut into row chunks
GRID = ["--method", "bema,ema,dema,ouema", "--kappa", "0.5,0.3", "--eta", "0.2,inf"]
LAYOUT = ["--max-memory", "300B", "--max-shard-size", "150B"]


VOLATILE = ("manifest.json", "state.json")  # they record when they were written


def digest(out: Path) -> dict[str, str]:
    """sha256 of every safetensors and json file under out (outputs, bema.json, index files and the
    persistent state's tensors), by relative path."""
    files = sorted(
        p for p in out.rglob("*") if p.suffix in (".safetensors", ".json") and p.name not in VOLATILE
    )

    def content(p: Path) -> bytes:  # a safetensors file's tensors (its provenance names its inputs' paths)
        if p.suffix != ".safetensors":
            return p.read_bytes()
        header, data = tensor_section(p)
        return json.dumps(header, sort_keys=True).encode() + data

    return {str(p.relative_to(out)): hashlib.sha256(content(p)).hexdigest() for p in files}


@pytest.fixture(scope="module")
def ray_address():
    ray = pytest.importorskip("ray")
    ctx = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


def stabilize(*args, env=None) -> dict:
    r = run_bema("stabilize", *map(str, args), "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow  # ~15 s for each Ray start on this machine
def test_ray_two_workers_bitwise_equal_to_local(tmp_path, ray_address):
    base, run = write_trajectory(tmp_path, STEPS, dtype=torch.bfloat16, shards=2)
    common = [run, "--base", base, *GRID, *LAYOUT]
    local = stabilize(*common, "--out", tmp_path / "local")
    remote = stabilize(
        *common,
        "--out",
        tmp_path / "ray",
        "--executor",
        "ray",
        "--workers",
        "2",
        env={"RAY_ADDRESS": ray_address},
    )
    assert remote["executor"] == {"executor": "ray", "workers": 2}
    # 10 configs (bema at eta inf is the ema, written once), 5 steps
    assert len(remote["outputs"]) == len(local["outputs"]) == 5 * 10
    a, b = digest(tmp_path / "local"), digest(tmp_path / "ray")
    assert len(a) > 50 * 3 and a == b  # every shard, index and bema.json of every output
    folder = Path(remote["outputs"][0]["path"])
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    plan = stabilize(*common, "--out", tmp_path / "plan", "--dry-run")["plan"]
    assert plan["work_units"] >= 8  # several units in flight on 2 workers, some of them row chunks
    assert not list((tmp_path / "ray").glob(".bema-tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bin2", "dcp"])
def test_ray_reads_every_format_like_local(tmp_path, ray_address, fmt):
    """Plans of other readers (.bin shards, DCP) travel to Ray workers and read the same bytes."""
    base, run = write_trajectory(tmp_path, STEPS[:3], shards=2)
    for step in STEPS[:3]:
        convert(run / f"checkpoint-{step}", tmp_path / fmt / f"checkpoint-{step}", fmt)
    stabilize(run, "--base", base, *GRID[:2], "--max-memory", "600B", "--out", tmp_path / "local")
    stabilize(
        tmp_path / fmt, "--base", base, *GRID[:2], "--max-memory", "600B", "--out", tmp_path / "ray",
        "--executor", "ray", "--workers", "2", env={"RAY_ADDRESS": ray_address},
    )  # fmt: skip
    a, b = digest(tmp_path / "local"), digest(tmp_path / "ray")
    safetensors = [k for k in a if k.endswith(".safetensors")]
    assert all(a[k] == b[k] for k in safetensors)
    assert len([k for k in safetensors if not k.startswith(".bema-state")]) == 4 * 3


@pytest.mark.slow
def test_ray_started_in_process_one_worker(tmp_path):
    base, run = write_trajectory(tmp_path, STEPS, shards=1)
    common = [run, "--base", base, "--method", "bema,ema", "--max-memory", "500B"]
    stabilize(*common, "--out", tmp_path / "local")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run(
        [str(Path(sys.executable).with_name("bema")), "stabilize", *map(str, common)]
        + ["--out", str(tmp_path / "ray"), "--executor", "ray", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["executor"]["workers"] == 1
    assert digest(tmp_path / "local") == digest(tmp_path / "ray")


@pytest.mark.slow
def test_ray_task_error_is_one_line_and_leaves_nothing(tmp_path, ray_address):
    base, run = write_trajectory(tmp_path, STEPS)
    bad = run / "checkpoint-30" / "model.safetensors"
    state = load_file(bad)
    state["layer.0.weight"][3, 2] = float("nan")
    save_file(state, bad, metadata={"format": "pt"})
    out = tmp_path / "out"
    r = run_bema(
        "stabilize", run, "--base", base, "--out", out, "--max-memory", "300B",
        "--executor", "ray", "--workers", "2", env={"RAY_ADDRESS": ray_address},
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: {bad}: tensor 'layer.0.weight' contains NaN or Inf (use --allow-nonfinite to proceed)"
    ]
    assert "Traceback" not in r.stderr
    assert not out.exists()  # the temp folder went, and OUT did not exist before


# `import ray` fails in this interpreter, as on a machine without the extra
WITHOUT_RAY = (
    "import sys; sys.modules['ray'] = None; from bema_cli.cli import main; sys.argv[0] = 'bema'; main()"
)


@pytest.mark.parametrize("command", ["stabilize", "eval"])
def test_executor_ray_without_ray_is_one_line(tmp_path, command):
    base, run = write_trajectory(tmp_path, [10, 20])
    args = [str(run), "--base", str(base), "--out", str(tmp_path / "out")]
    r = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, command, *args, "--executor", "ray", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        "error: --executor ray: Ray is not installed (install it with: pip install ray, or from a bema checkout: pip install '.[ray]')"
    )
    assert not (tmp_path / "out").exists()


def test_workers_without_ray_executor_is_a_usage_error(tmp_path):
    base, run = write_trajectory(tmp_path, [10, 20])
    r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "out", "--workers", "2")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --workers: more than one worker needs --executor ray"
