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

import copy
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import INDEX_NAME, check_weight_map, is_adapter, is_regular, model_weight_files
from bema_cli.io.dcp import find_dcp_dir, index_dcp
from bema_cli.io.safetensors import ModelIndex, TensorInfo, index_model
from bema_cli.io.torchbin import BIN_INDEX, bin_weight_files, index_bin

__all__ = [
    "CheckpointRecord",
    "ModelIndex",
    "TensorInfo",
    "TensorReader",
    "checkpoint_format",
    "describe",
    "has_weights",
    "open_checkpoint",
    "read_into",
    "safetensors_files",
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


@dataclass
class CheckpointRecord:
    """One checkpoint folder as discovery validated it: its format, weight files and tensors. Every
    reader below discovery (the engine, fingerprints, eval's resume keys and weight swaps) takes
    this record instead of listing the folder, reading its weight map and parsing its headers again."""

    folder: Path
    format: str  # safetensors, bin, dcp or lora
    files: tuple[Path, ...]  # the weight files (DCP: every file of its folder; LoRA: the adapter's)
    signature: tuple  # the folder's and files' stats when validated: a change re-validates
    like: frozenset = frozenset()  # DCP: the base's names its prefixes were resolved against
    parsed: ModelIndex | None = None  # the headers, parsed on first use (a listing alone reads none)

    @property
    def index(self) -> ModelIndex | None:
        """Where each tensor lives (None for a LoRA adapter: it needs its base); the headers are
        parsed, and the weight map checked against them, on the first call only."""
        if self.parsed is None and self.format in ("safetensors", "bin"):
            index_of, weight_map = (
                (index_model, INDEX_NAME) if self.format == "safetensors" else (index_bin, BIN_INDEX)
            )
            self.parsed = _checked(index_of(self.folder, list(self.files)), self.folder / weight_map)
        return self.parsed


_records: dict[str, CheckpointRecord] = {}
_records_lock = threading.Lock()
KEPT_RECORDS = 512  # the most recently validated folders kept (~60 KB each at a 0.5B model's 290 tensors)


def describe(folder: Path, like: set[str] | None = None) -> CheckpointRecord:
    """The validated record of a checkpoint folder, once per process: a later call costs a stat of the
    folder and of each weight file, and validates again only when one changed (a rewritten file, a
    shard added or removed); `like` (the base's names) resolves DCP prefixes."""
    folder = Path(folder)  # callers hand str paths too (the vLLM swap)
    key, names = str(folder.absolute()), frozenset(like or ())
    known = _records.get(key)
    if (
        known is not None
        and (known.format != "dcp" or known.like == names)
        and _signature(known.folder, known.files) == known.signature
    ):
        return known
    record = _validate(folder, like)
    with _records_lock:
        _records.pop(key, None)
        _records[key] = record
        while len(_records) > KEPT_RECORDS:  # a --follow run over thousands of checkpoints stays bounded
            del _records[next(iter(_records))]
    return record


def _validate(folder: Path, like: set[str] | None) -> CheckpointRecord:
    fmt, index = checkpoint_format(folder), None
    if fmt == "lora":
        files = sorted(p for p in folder.glob("adapter_model.*") if is_regular(p))
    elif fmt == "safetensors":
        files = model_weight_files(folder)
    elif fmt == "bin":
        files = bin_weight_files(folder)
    elif fmt == "dcp":  # its files are known from its metadata only
        index = index_dcp(folder, find_dcp_dir(folder), like)
        files = set()
        for f in {t.file for t in index.tensors.values()}:
            files |= {p for p in f.iterdir() if p.is_file()} if f.is_dir() else {f}
        files = sorted(files)
    else:
        raise InputError(
            f"{folder}: no model weights (model.safetensors, pytorch_model.bin, a DCP folder or a LoRA adapter)"
        )
    return CheckpointRecord(
        folder, fmt, tuple(files), _signature(folder, files), frozenset(like or ()), index
    )


def _signature(folder: Path, files) -> tuple | None:
    """Stats that change when the folder gains or loses a file, or a weight file or weight map is
    rewritten; None (never equal to a record's) when a weight file cannot be read."""
    try:
        stats = [os.stat(folder), *(os.stat(f) for f in files)]
    except OSError:
        return None
    maps = [os.stat(m) if m.exists() else None for m in (folder / INDEX_NAME, folder / BIN_INDEX)]
    return tuple(st and (st.st_ino, st.st_size, st.st_mtime_ns) for st in [*stats, *maps])


def open_checkpoint(folder: Path, like: set[str] | None = None) -> ModelIndex:
    """The index of a full-weight checkpoint in any format; `like` (the base's names) resolves DCP prefixes."""
    record = describe(folder, like)
    if record.format == "lora":
        raise InputError(f"{folder}: a LoRA adapter, not a full model (pass --base the model it adapts)")
    return copy.copy(record.index)  # its own object: the engine re-points a held index's files (hold)


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors weight files of a model folder (what vLLM's weight swap and eval's resume keys
    read), from its record; an error naming the folder when it holds other weights or none."""
    folder = Path(folder)
    try:
        record = describe(folder)
    except InputError:
        record = None
    if record is None or record.format != "safetensors":
        model_weight_files(folder)  # raises the safetensors-only error that says what is missing
        raise InputError(
            f"{folder}: holds {record.format if record else 'no usable'} weights; only safetensors model folders can be used here"
        )
    return list(record.files)


def _checked(index: ModelIndex, index_json: Path) -> ModelIndex:
    """A sharded checkpoint's index must not name a tensor its shard lacks (HF loaders trust it)."""
    check_weight_map(index_json, {name: t.file for name, t in index.tensors.items()})
    return index


def has_weights(folder: Path) -> None:
    """Fail early, naming the folder, when it holds no model weights in any format (a base model
    check); a safetensors base is validated here, once, for the run (a DCP base waits for the names
    its checkpoints use)."""
    fmt = checkpoint_format(folder)
    if fmt == "safetensors":
        describe(folder)
    elif fmt in (None, "lora"):
        open_checkpoint(folder)  # raises the error that says what is missing
