"""Re-save a safetensors trajectory in the other formats bema reads (real torch.save / DCP writers)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from trajectory import load_model


def save_bin(state: dict, folder: Path, shards: int = 1) -> None:
    """pytorch_model.bin, or `shards` HF-style .bin shards with pytorch_model.bin.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: state[k] for k in names[i::shards]}, folder / fname)
        weight_map.update({k: fname for k in names[i::shards]})
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def save_dcp(state: dict, folder: Path, accelerate: bool = True) -> Path:
    """A DCP checkpoint as the HF Trainer + accelerate FSDP writes it: folder/pytorch_model_fsdp_0/,
    the state dict nested under "model" (so keys read `model.<name>`)."""
    import torch.distributed.checkpoint as dcp

    target = folder / "pytorch_model_fsdp_0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(
            {"model": dict(state)} if accelerate else dict(state), checkpoint_id=str(target), no_dist=True
        )
    return target


def convert(src: Path, dst: Path, fmt: str) -> Path:
    """Copy model folder src to dst with its weights re-saved as fmt (safetensors, bin, bin2, dcp)."""
    state = load_model(src)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    elif fmt.startswith("bin"):
        save_bin(state, dst, shards=int(fmt[3:] or 1))
    elif fmt == "dcp":
        save_dcp(state, dst)
    else:
        raise ValueError(fmt)
    return dst
