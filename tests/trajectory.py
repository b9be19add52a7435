"""Write small random checkpoint trajectories (real safetensors files) for the stabilize tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHAPES = {"layer.0.weight": (12, 8), "layer.0.bias": (12,), "layer.1.weight": (5, 3, 4), "scale": ()}


def _save(state: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    """save_file, split into `shards` HF-style shards with an index when shards > 1."""
    folder.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(state)
    groups = [names[i::shards] for i in range(shards)]
    weight_map, total = {}, 0
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in group}, folder / fname, metadata={"format": "pt"})
        for k in group:
            weight_map[k] = fname
            total += state[k].numel() * state[k].element_size()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )


def write_trajectory(
    root: Path,
    steps: list[int],
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
    seed: int = 0,
    shapes: dict | None = None,
    with_int: bool = True,
    noise: float = 0.1,
) -> tuple[Path, Path]:
    """base/ (theta0) and run/checkpoint-<s>/ for each step: a random walk plus noise.

    Also writes an int64 buffer ('positions', differing per step) that must be copied from theta_s,
    and the optimizer/scheduler/rng files a Trainer leaves (which must be ignored).
    Returns (base_dir, run_dir).
    """
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or SHAPES
    base = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    base_dir, run_dir = root / "base", root / "run"
    state = {k: v.clone() for k, v in base.items()}

    def cast(st, step):
        out = {k: v.to(dtype) for k, v in st.items()}
        if with_int:
            out["positions"] = torch.arange(6, dtype=torch.int64) + step
        return out

    _save(cast(base, 0), base_dir, shards)
    for step in steps:
        state = {k: v + noise * torch.randn(v.shape, generator=g) for k, v in state.items()}
        folder = run_dir / f"checkpoint-{step}"
        _save(cast(state, step), folder, shards)
        (folder / "config.json").write_text(
            json.dumps({"model_type": "toy", "dtype": str(dtype).split(".")[-1]})
        )
        (folder / "optimizer.pt").write_bytes(b"not a tensor file")
        (folder / "scheduler.pt").write_bytes(b"x")
        (folder / "rng_state.pth").write_bytes(b"x")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return base_dir, run_dir


def load_model(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model folder (single file or sharded), via safetensors.torch.load_file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for f in files:
        state.update(load_file(folder / f))
    return state


def motion_reference(base: Path, folders: dict[int, Path]) -> dict[int, float]:
    """float64, by hand: ||theta_s - theta_prev|| / ||theta_s|| over the float tensors, per step
    (theta_prev of the first step: the base). What stabilize and sweep measure (motion.py)."""
    import math

    prev = {k: v.double() for k, v in load_model(base).items() if v.is_floating_point()}
    out = {}
    for step in sorted(folders):
        now = {k: v.double() for k, v in load_model(folders[step]).items() if v.is_floating_point()}
        d2 = sum(float(((now[k] - prev[k]) ** 2).sum()) for k in now)
        n2 = sum(float((now[k] ** 2).sum()) for k in now)
        out[step] = math.sqrt(d2 / n2)
        prev = now
    return out


def finetune_trajectory(
    base_dir: Path, root: Path, steps: list[int], seed: int = 0, scale: float = 0.02
) -> Path:
    """checkpoint-<s> copies of a real HF model folder with fine-tune-like random drifts of every weight."""
    g = torch.Generator().manual_seed(seed)
    base = load_model(base_dir)
    state = {k: v.clone() for k, v in base.items()}
    run_dir = root / "run"
    for step in steps:
        state = {k: v + scale * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in state.items()}
        folder = run_dir / f"checkpoint-{step}"
        shutil.copytree(base_dir, folder)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return run_dir


def tensor_section(path: Path) -> tuple[dict, bytes]:
    """A safetensors file as (its header without __metadata__, its data bytes): what a bitwise
    comparison of two runs' weights compares when their inputs sit at other paths (the metadata
    carries each output's provenance, paths included: io/provenance.py)."""
    import json

    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n :]
