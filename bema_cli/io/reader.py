"""The one interface the engine reads checkpoints through, whatever their format.

A checkpoint is a `ModelIndex`: `tensors` maps each name to its `TensorInfo` (file,
safetensors dtype tag, shape), known before any tensor data is read. `index.open()`
returns a reader, a context manager whose `read(name, start, stop)` gives rows
[start, stop) of one tensor along dim 0 (the whole tensor for a scalar) as a CPU
torch tensor; `read_into` (below) puts them in a caller's buffer, straight from the file
where the reader `streams` (safetensors: `read_elements_into`, any element range). Readers are opened per work unit and closed right
after, so mapped pages (.bin) and open files do not pile up over a run.

| format                              | module         | rows come from                          |
|-------------------------------------|----------------|-----------------------------------------|
| model.safetensors (+ index)         | safetensors.py | one pread per row range (no mmap)       |
| pytorch_model.bin (+ index)         | torchbin.py    | torch.load(weights_only, mmap)          |
| DCP folder (FSDP SHARDED_STATE_DICT) | dcp.py         | the saved chunks overlapping the rows   |
| PEFT LoRA adapter                   | lora.py        | W_base[a:b] + scale * B[a:b] @ A         |
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import INDEX_NAME, check_weight_map, is_adapter, is_regular, model_weight_files
from bema_cli.io.dcp import find_dcp_dir, index_dcp
from bema_cli.io.safetensors import ModelIndex, TensorInfo, index_model
from bema_cli.io.torchbin import BIN_INDEX, bin_weight_files, index_bin

__all__ = [
    "ModelIndex",
    "TensorInfo",
    "TensorReader",
    "checkpoint_format",
    "has_weights",
    "open_checkpoint",
    "read_into",
    "streams",
]


class TensorReader(Protocol):
    index: ModelIndex

    def __enter__(self) -> TensorReader: ...

    def __exit__(self, *exc) -> None: ...

    def read(self, name: str, start: int, stop: int): ...


def read_into(reader: TensorReader, name: str, start: int, stop: int, out, scratch=None) -> None:
    """Rows [start, stop) of `name` into the flat buffer `out` (cast to its dtype).

    Readers that can (safetensors) read the bytes straight into `out`, or into `scratch` (a reused
    uint8 buffer) when a cast is needed; the others return a tensor that is copied in.
    """
    if streams(reader):
        row = reader.index.tensors[name].row_numel
        reader.read_elements_into(name, start * row, (stop - start) * row, out, scratch)
    else:
        out.copy_(reader.read(name, start, stop).reshape(-1))


def streams(reader: TensorReader) -> bool:
    """Whether `reader` reads any element range straight into a buffer (`read_elements_into`:
    safetensors); the others read whole rows and return tensors."""
    return hasattr(reader, "read_elements_into")


def checkpoint_format(folder: Path) -> str | None:
    """safetensors, lora, bin or dcp: what a checkpoint folder holds (in that order); None if nothing."""
    if is_adapter(folder):
        return "lora"
    if any(folder.glob("*.safetensors")) or is_regular(folder / INDEX_NAME):
        return "safetensors"
    if bin_weight_files(folder):
        return "bin"
    if find_dcp_dir(folder) is not None:
        return "dcp"
    return None


def open_checkpoint(folder: Path, like: set[str] | None = None) -> ModelIndex:
    """The index of a full-weight checkpoint in any format; `like` (the base's names) resolves DCP prefixes."""
    fmt = checkpoint_format(folder)
    if fmt == "safetensors":
        return _checked(index_model(folder, model_weight_files(folder)), folder / INDEX_NAME)
    if fmt == "bin":
        return _checked(index_bin(folder, bin_weight_files(folder)), folder / BIN_INDEX)
    if fmt == "dcp":
        return index_dcp(folder, find_dcp_dir(folder), like)
    if fmt == "lora":
        raise InputError(f"{folder}: a LoRA adapter, not a full model (pass --base the model it adapts)")
    raise InputError(
        f"{folder}: no model weights (model.safetensors, pytorch_model.bin, a DCP folder or a LoRA adapter)"
    )


def _checked(index: ModelIndex, index_json: Path) -> ModelIndex:
    """A sharded checkpoint's index must not name a tensor its shard lacks (HF loaders trust it)."""
    check_weight_map(index_json, {name: t.file for name, t in index.tensors.items()})
    return index


def has_weights(folder: Path) -> None:
    """Fail early, naming the folder, when it holds no model weights in any format (a base model check)."""
    if checkpoint_format(folder) in (None, "lora"):
        open_checkpoint(folder)  # raises the error that says what is missing
