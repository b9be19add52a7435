"""Hostile and unsupported inputs of the new formats, through the real CLI in a subprocess.

Each case asserts exit code 3 (2 for flags), one line naming the file and the problem, no
traceback, nothing left in OUT, and for the malicious pickles that their payload never ran.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import one_line_error, run_bema
from formats import convert, save_bin, save_dcp
from lora_run import perturbed_adapters
from safetensors.torch import load_file, save_file
from trajectory import write_trajectory

STEPS = [10, 20, 30]


class Payload:
    """Unpickling this runs `touch <marker>`: what a hostile checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _traj(root: Path, fmt: str | None = None) -> tuple[Path, Path]:
    base, run = write_trajectory(root, STEPS, with_int=False)
    if fmt:
        for s in STEPS:
            src = run / f"checkpoint-{s}"
            convert(src, root / "tmp", fmt)
            shutil.rmtree(src)
            (root / "tmp").rename(src)
    return base, run


def malicious_bin(root):
    base, run = _traj(root, "bin")
    marker = root / "pwned"
    torch.save(
        {"layer.0.weight": torch.zeros(12, 8), "evil": Payload(marker)},
        run / "checkpoint-20" / "pytorch_model.bin",
    )
    return (
        [run, "--base", base],
        3,
        "refused: not plain tensors, nothing of it was run",
        "checkpoint-20/pytorch_model.bin",
    )


def malicious_dcp_metadata(root):
    base, run = _traj(root, "dcp")
    meta = run / "checkpoint-30" / "pytorch_model_fsdp_0" / ".metadata"
    meta.write_bytes(pickle.dumps(Payload(root / "pwned")))
    return [run, "--base", base], 3, "refused: not DCP metadata", str(meta)


def bin_not_a_state_dict(root):
    base, run = _traj(root, "bin")
    f = run / "checkpoint-10" / "pytorch_model.bin"
    torch.save({"model": torch.load(f, weights_only=True), "epoch": 3}, f)
    return [run, "--base", base], 3, "entry 'model' is a dict, not a tensor", str(f)


def bin_truncated(root):
    base, run = _traj(root)
    save_bin(torch.load(_bin_of(root, base), weights_only=True), root / "b2", shards=2)
    f = root / "b2" / "pytorch_model-00002-of-00002.bin"
    f.write_bytes(f.read_bytes()[:-100])
    return [run, "--base", root / "b2"], 3, "cannot read as a PyTorch checkpoint", str(f)


def _bin_of(root: Path, model: Path) -> Path:
    convert(model, root / "as-bin", "bin")
    return root / "as-bin" / "pytorch_model.bin"


def dcp_truncated(root):
    base, run = _traj(root, "dcp")
    f = run / "checkpoint-20" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-50])
    return [run, "--base", base], 3, "truncated DCP data file", str(f)


def dcp_no_metadata(root):
    base, run = _traj(root, "dcp")
    folder = run / "checkpoint-30" / "pytorch_model_fsdp_0"
    (folder / ".metadata").unlink()
    return [run, "--base", base], 3, "DCP checkpoint without .metadata", str(folder)


def dcp_corrupt_chunk(root):
    base, run = _traj(root, "dcp")
    f = run / "checkpoint-10" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    f.write_bytes(b"\0" * f.stat().st_size)  # right size, garbage inside
    return [run, "--base", base], 3, "cannot read tensor", "checkpoint-10/pytorch_model_fsdp_0"


def mixed_naming(root):
    base, run = _traj(root)
    (run / "checkpoint-30").rename(run / "step_30")
    return [run, "--base", base], 3, "mixes checkpoint naming schemes", "step_30"


def no_weights(root):
    base, run = _traj(root)
    (run / "checkpoint-20" / "model.safetensors").unlink()
    return [run, "--base", base], 3, "no model weights", "checkpoint-20"


# -- LoRA ----------------------------------------------------------------------------------


def _lora(root: Path, lora_template: Path) -> tuple[Path, Path]:
    shutil.copytree(lora_template, root, dirs_exist_ok=True)
    return root / "base", root / "run"


def _edit_config(folder: Path, **changes) -> Path:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k)
        else:
            config[k] = v
    path.write_text(json.dumps(config))
    return path


def _edit_adapter(folder: Path, fn) -> Path:
    path = folder / "adapter_model.safetensors"
    state = load_file(path)
    fn(state)
    save_file(state, path)
    return path


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def lora_no_r(root, t):
    base, run = _lora(root, t)
    path = _edit_config(run / "checkpoint-20", r=None)
    return [run, "--base", base], 3, "no valid LoRA rank r", str(path)


def lora_shape(root, t):
    base, run = _lora(root, t)
    path = _edit_adapter(run / "checkpoint-10", lambda s: s.update({Q_A: torch.zeros(4, 65)}))
    return (
        [run, "--base", base],
        3,
        "do not fit base tensor 'model.layers.0.self_attn.q_proj.weight'",
        str(path),
    )


def lora_dora(root, t):
    base, run = _lora(root, t)
    path = _edit_config(run / "checkpoint-30", use_dora=True)
    return [run, "--base", base], 3, "DoRA", str(path)


def lora_pissa(root, t):
    base, run = _lora(root, t)
    path = _edit_config(run / "checkpoint-10", init_lora_weights="pissa")
    return [run, "--base", base], 3, "init_lora_weights='pissa'", str(path)


def lora_targets_differ(root, t):
    base, run = _lora(root, t)
    _edit_adapter(
        run / "checkpoint-30", lambda s: [s.pop(k) for k in list(s) if "layers.1.self_attn.v_proj" in k]
    )
    return [run, "--base", base], 3, "target modules differ", "checkpoint-30"


def lora_base_mismatch(root, t):
    base, run = _lora(root, t)
    state = load_file(base / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32)
    save_file(state, base / "model.safetensors")
    return [run, "--base", base], 3, "do not fit base tensor", "checkpoint-10"


def lora_mixed_with_full(root, t):
    base, run = _lora(root, t)
    shutil.rmtree(run / "checkpoint-20")
    shutil.copytree(base, run / "checkpoint-20")
    return [run, "--base", base], 3, "full weights among LoRA adapter checkpoints", "checkpoint-20"


def lora_base_first(root, t):
    base, run = _lora(root, t)
    return [run, "--base", "first"], 2, "a LoRA run starts from the base model", "--base first"


def lora_rank_without_adapter(root, t):
    base, run = _lora(root, t)
    return [run, "--base", base, "--lora-rank", "8"], 2, "--lora-rank", "--lora-output adapter"


CASES = [
    malicious_bin, malicious_dcp_metadata, bin_not_a_state_dict, bin_truncated, dcp_truncated, dcp_no_metadata,
    dcp_corrupt_chunk, mixed_naming, no_weights,
]  # fmt: skip
LORA_CASES = [
    lora_no_r, lora_shape, lora_dora, lora_pissa, lora_targets_differ, lora_base_mismatch, lora_mixed_with_full,
    lora_base_first, lora_rank_without_adapter,
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir):
    """Build every case, run all the CLIs (2 at a time), return {name: (case, CompletedProcess, root)}."""
    template = tmp_path_factory.mktemp("lora-template")
    shutil.copytree(tiny_model_dir, template / "base")
    perturbed_adapters(template / "base", template / "run", STEPS)
    prepared = {}
    for case in CASES + LORA_CASES:
        root = tmp_path_factory.mktemp(case.__name__)
        args, code, message, names = case(root, template) if case in LORA_CASES else case(root)
        prepared[case.__name__] = ([*args, "--out", root / "out"], code, message, names, root)
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(run_bema, "stabilize", *v[0]) for k, v in prepared.items()}
        return {k: (prepared[k], f.result()) for k, f in futures.items()}


@pytest.mark.parametrize("name", [c.__name__ for c in CASES + LORA_CASES])
def test_error(results, name):
    (args, code, message, names, root), proc = results[name]
    line = one_line_error(proc, code)
    assert message in line and names in line, line
    assert proc.stdout == ""
    assert not (root / "out").exists() or not any((root / "out").iterdir())
    assert not (root / "pwned").exists(), "the hostile pickle ran"


def test_payload_is_real(tmp_path):
    """The malicious files above would create the marker if unpickled unsafely (so the checks mean something)."""
    marker = tmp_path / "pwned"
    torch.save({"evil": Payload(marker)}, tmp_path / "evil.bin")
    torch.load(tmp_path / "evil.bin", weights_only=False)
    assert marker.exists()
    marker.unlink()
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()
    save_dcp({"w": torch.zeros(2)}, tmp_path)  # and DCP files are what the cases edit
    assert (tmp_path / "pytorch_model_fsdp_0" / ".metadata").is_file()
