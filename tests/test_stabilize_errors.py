"""Every error case of `bema stabilize`, through the real CLI in a subprocess.

Each case asserts the exit code, a one-line message naming the file/tensor/flag, no
traceback, and that nothing was left in OUT. The subprocesses of all cases start from one
module fixture a few at a time (each pays ~2 s of `import torch`).
"""

from __future__ import annotations

import json
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import one_line_error, run_bema
from safetensors.torch import load_file, save_file
from trajectory import write_trajectory

STEPS = [10, 20, 30]


def _traj(root: Path, **kw) -> tuple[Path, Path]:
    return write_trajectory(root, STEPS, with_int=False, **kw)


def _edit(path: Path, fn) -> None:
    """Rewrite one safetensors file with fn(state) applied."""
    state = load_file(path)
    fn(state)
    save_file(state, path)


def missing(root):
    return [root / "nope"], 3, "no such directory", "nope"


def empty(root):
    (root / "run").mkdir()
    return [root / "run"], 3, "is empty", "run"


def no_checkpoints(root):
    (root / "run" / "logs").mkdir(parents=True)
    return [root / "run"], 3, "no checkpoint-<step> folders", "run"


def corrupt(root):
    base, run = _traj(root)
    f = run / "checkpoint-20" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:8] + b"!not json" + f.read_bytes()[17:])
    return [run, "--base", base], 3, "corrupt safetensors file", str(f)


def truncated(root):
    base, run = _traj(root, shards=2)
    f = run / "checkpoint-30" / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    return [run, "--base", base], 3, "truncated", str(f)


def huge_header(root):
    base, run = _traj(root)
    f = base / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 40) + f.read_bytes()[8:])
    return [run, "--base", base], 3, "corrupt or truncated", str(f)


def key_missing(root):
    base, run = _traj(root)
    _edit(run / "checkpoint-20" / "model.safetensors", lambda s: s.pop("layer.0.bias"))
    return [run, "--base", base], 3, "tensor 'layer.0.bias'", "checkpoint-20"


def key_extra(root):
    base, run = _traj(root)
    _edit(run / "checkpoint-30" / "model.safetensors", lambda s: s.update(extra=torch.ones(2)))
    return [run, "--base", base], 3, "tensor 'extra' is not in the base model", "checkpoint-30"


def shape_mismatch(root):
    base, run = _traj(root)
    _edit(
        run / "checkpoint-20" / "model.safetensors", lambda s: s.update({"layer.0.weight": torch.ones(12, 9)})
    )
    return [run, "--base", base], 3, "tensor 'layer.0.weight' has shape [12, 9]", "checkpoint-20"


def dtype_mismatch(root):
    base, run = _traj(root)
    _edit(run / "checkpoint-10" / "model.safetensors", lambda s: s.update({"scale": s["scale"].half()}))
    return [run, "--base", base], 3, "tensor 'scale' has dtype F16", "checkpoint-10"


def base_mismatch(root):
    base, run = _traj(root)
    _edit(base / "model.safetensors", lambda s: s.update({"layer.0.bias": torch.ones(13)}))
    return [run, "--base", base], 3, "tensor 'layer.0.bias' has shape [12]", "base"


def duplicate_steps(root):
    base, run = _traj(root)
    shutil.copytree(run / "checkpoint-20", run / "checkpoint-final")  # trainer_state.json says 20
    return [run, "--base", base], 3, "duplicate step 20", "checkpoint-final"


def nonfinite(root):
    base, run = _traj(root)
    _edit(
        run / "checkpoint-30" / "model.safetensors",
        lambda s: s["layer.1.weight"].view(-1).__setitem__(3, float("nan")),
    )
    return [run, "--base", base], 3, "tensor 'layer.1.weight' contains NaN or Inf", "checkpoint-30"


def bin_not_torch(root):
    base, run = _traj(root)
    (base / "model.safetensors").rename(base / "pytorch_model.bin")  # a .bin that is no torch.save file
    return [run, "--base", base], 3, "cannot read as a PyTorch checkpoint", "base/pytorch_model.bin"


def no_base(root):
    _, run = _traj(root)
    cfg = run / "checkpoint-10" / "config.json"
    cfg.write_text(json.dumps({"_name_or_path": str(root / "gone")}))
    return [run], 3, "pass --base", "gone"


def hub_offline(root):
    _, run = _traj(root)
    return [run, "--base", "some-org/some-model"], 3, "HF_HUB_OFFLINE", "some-org/some-model"


def bad_kappa(root):
    base, run = _traj(root)
    return [run, "--base", base, "--kappa", "-1"], 2, "must be a finite number >= 0", "--kappa"


def bad_w(root):
    base, run = _traj(root)
    return [run, "--base", base, "--rho", "-15"], 2, "rho + gamma*s must be > 0", "step 10"


def ouema_eta0(root):
    base, run = _traj(root)
    return [run, "--base", base, "--method", "ouema", "--eta", "0"], 2, "undefined", "--eta 0"


def bad_size(root):
    base, run = _traj(root)
    return [run, "--base", base, "--max-memory", "2XB"], 2, "is not a size", "--max-memory"


def bad_steps(root):
    base, run = _traj(root)
    return [run, "--base", base, "--steps", "15"], 2, "not a checkpoint step", "--steps"


def out_exists(root):
    base, run = _traj(root)
    (root / "out" / "bema-k0.5-e0.2").mkdir(parents=True)
    return [run, "--base", base], 4, "already exists (use --overwrite", "bema-k0.5-e0.2"


def unwritable(root):
    base, run = _traj(root)
    (root / "blocker").write_text("a file, not a folder")
    return (
        [run, "--base", base, "--out", root / "blocker" / "out"],
        4,
        "cannot write the output directory",
        "blocker",
    )


CASES = [
    missing, empty, no_checkpoints, corrupt, truncated, huge_header, key_missing, key_extra, shape_mismatch,
    dtype_mismatch, base_mismatch, duplicate_steps, nonfinite, bin_not_torch, no_base, hub_offline, bad_kappa, bad_w,
    ouema_eta0, bad_size, bad_steps, out_exists, unwritable,
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Build every case, run all the CLIs (3 at a time), return {name: (case, CompletedProcess, root)}."""
    prepared = {}
    for case in CASES:
        root = tmp_path_factory.mktemp(case.__name__)
        args, code, message, names = case(root)
        if "--out" not in args:
            args = [*args, "--out", root / "out"]
        prepared[case.__name__] = (args, code, message, names, root)
    env = {"HF_HOME": str(tmp_path_factory.mktemp("hf_home")), "HF_HUB_OFFLINE": "1"}
    with ThreadPoolExecutor(3) as pool:
        futures = {k: pool.submit(run_bema, "stabilize", *v[0], env=env) for k, v in prepared.items()}
        return {k: (prepared[k], f.result()) for k, f in futures.items()}


@pytest.mark.parametrize("name", [c.__name__ for c in CASES])
def test_error(results, name):
    (args, code, message, names, root), proc = results[name]
    line = one_line_error(proc, code)
    assert message in line and names in line, line
    assert proc.stdout == ""
    out = root / "out"
    leftovers = [p.name for p in out.iterdir()] if out.is_dir() else []
    assert leftovers == (["bema-k0.5-e0.2"] if name == "out_exists" else []), leftovers


def test_nonfinite_allowed_and_overwrite(tmp_path):
    """--allow-nonfinite proceeds (NaN propagates); --overwrite replaces a run folder bema wrote."""
    base, run = _traj(tmp_path)
    _edit(run / "checkpoint-30" / "model.safetensors", lambda s: s["scale"].fill_(float("inf")))
    out = tmp_path / "out"
    first = run_bema("stabilize", run, "--base", base, "--out", out, "--steps", "10")
    assert first.returncode == 0, first.stderr
    (out / "bema-k0.5-e0.2" / "stale").mkdir()  # inside a run folder bema wrote: replaced with it
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--allow-nonfinite", "--overwrite", "--json")
    assert r.returncode == 0, r.stderr
    assert "allow-nonfinite" in r.stderr
    assert not (out / "bema-k0.5-e0.2" / "stale").exists()
    assert torch.isinf(
        load_file(out / "bema-k0.5-e0.2" / "checkpoint-30" / "model.safetensors")["scale"]
    ).all()
    assert [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".bema-state"] == []


def test_debug_shows_traceback(tmp_path):
    r = run_bema("--debug", "stabilize", tmp_path / "nope", "--out", tmp_path / "out")
    assert r.returncode == 3 and "Traceback" in r.stderr and "no such directory" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA message")
def test_device_cuda_without_gpu(tmp_path):
    base, run = _traj(tmp_path)
    r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "out", "--device", "cuda")
    assert r.returncode == 2 and "--device cuda" in r.stderr
    assert not (tmp_path / "out").exists()
