"""PyTorch `.bin` checkpoints: `pytorch_model.bin`, or shards listed in `pytorch_model.bin.index.json`.

A `.bin` file is a pickle, and unpickling runs code. `torch.load(weights_only=True)` only
accepts tensors, plain containers and numbers: any other global (a `__reduce__` calling
os.system, a custom class) stops the load before anything of it runs, and we report
the file. `mmap=True` maps tensor storages instead of reading them, so a work unit
costs the pages of the rows it reads, as with safetensors; a reader is opened per
work unit and dropping it unmaps the file. Contiguous tensors skip even that: their byte offsets
are found once at index time and rows are one pread each (io/torchzip.py).
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import indexed_files, is_regular
from bema_cli.io.safetensors import DTYPES, TAG_OF, ModelIndex, TensorInfo
from bema_cli.io.torchzip import FileWindow, data_records, read_rows, release_freed_memory

BIN_NAME = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def bin_weight_files(folder: Path) -> list[Path]:
    """The .bin files holding a folder's weights (index first, then pytorch_model.bin); [] if none."""
    if is_regular(folder / BIN_INDEX):
        return indexed_files(folder / BIN_INDEX, ".bin")
    if is_regular(folder / BIN_NAME):
        return [folder / BIN_NAME]
    return []


def load_state(path: Path) -> dict:
    """{name: tensor} of one .bin file, storages memory-mapped; InputError for anything else in it."""
    import torch

    if not is_regular(path):
        raise InputError(f"{path}: no such file")
    mmap = zipfile.is_zipfile(path)  # the legacy (pre-1.6) format cannot be mapped: read it whole
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        refused = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln), None)
        if refused:  # the weights-only unpickler stopped at a global: nothing of the file ran
            raise InputError(
                f"{path}: refused: not plain tensors, nothing of it was run ({refused})"
            ) from None
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "Weights only" not in ln]
        raise InputError(
            f"{path}: cannot read as a PyTorch checkpoint ({(lines or ['bad pickle'])[0]})"
        ) from None
    except Exception as exc:  # truncated zip, bad magic, I/O errors: one line naming the file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{path}: cannot read as a PyTorch checkpoint ({first})") from None
    if not isinstance(state, dict):
        raise InputError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise InputError(
                f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor (expected a flat state dict)"
            )
    return state


def dtype_tag(path: Path, name: str, dtype) -> str:
    """The safetensors dtype tag of a torch dtype (how every format describes its tensors)."""
    tag = TAG_OF.get(str(dtype).removeprefix("torch."))
    if tag is None:
        raise InputError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
    return tag


class BinIndex(ModelIndex):
    offsets: dict[str, int]  # name -> byte offset of its first element, for contiguous tensors

    def open(self) -> BinReader:
        return BinReader(self)


def index_bin(folder: Path, files: list[Path]) -> BinIndex:
    """Names, shapes and dtypes of every tensor in the .bin files (pickles parsed, no tensor data read),
    and where each contiguous tensor's bytes start in its file."""
    tensors: dict[str, TensorInfo] = {}
    offsets: dict[str, int] = {}
    for path in files:
        state = load_state(path)
        for name, t in state.items():
            if name in tensors:
                raise InputError(f"{path}: tensor {name!r} is also in {tensors[name].file.name}")
            tensors[name] = TensorInfo(name, path, dtype_tag(path, name, t.dtype), tuple(t.shape))
        offsets.update(_offsets(path, state))
    index = BinIndex(folder, tensors)
    index.offsets = offsets
    return index


def _offsets(path: Path, state: dict) -> dict[str, int]:
    """Byte offsets in `path` of the tensors' first elements, from the mapped storages' addresses.

    With mmap=True every storage is a slice of one mapping of the file at its record's offset, so
    address - offset is the same for all: anchored at the lowest record, it must map the storages
    one to one onto the records, and each tensor must lie inside its record; else the slow way.
    Only addresses are compared: touching the mapping would page it in (and count in RSS).
    """
    with open(path, "rb") as f:
        records = data_records(FileWindow(f))
    sizes = {offset: size for offset, size in (records or {}).values() if size}
    storages = {t.untyped_storage().data_ptr() for t in state.values() if t.numel()}
    if not storages or len(sizes) != len(storages):
        return {}
    base = min(storages) - min(sizes)
    if {p - base for p in storages} != set(sizes):
        return {}
    offsets = {}
    for name, t in state.items():
        record = t.untyped_storage().data_ptr() - base
        start = t.data_ptr() - base
        if t.numel() and t.is_contiguous() and start + t.nbytes <= record + sizes[record]:
            offsets[name] = start
    return offsets


class BinReader:
    """Rows [start, stop) of tensors of one .bin model: one pread at the known offset of each
    contiguous tensor; others from the file mapped on first use (dropped when the reader closes)."""

    def __init__(self, index: BinIndex):
        self.index = index
        self._states: dict[Path, dict] = {}

    def __enter__(self) -> BinReader:
        return self

    def __exit__(self, *exc) -> None:
        self._states.clear()  # the last references to the mapped storages: unmaps the files
        release_freed_memory()

    def read(self, name: str, start: int, stop: int):
        import torch

        info = self.index.tensors[name]
        offset = self.index.offsets.get(name)
        if offset is not None:
            rows = info.shape[0] if info.shape else 1
            start, stop = (start, stop) if info.shape else (0, 1)
            dest = torch.empty((stop - start, *info.shape[1:]), dtype=getattr(torch, DTYPES[info.dtype][0]))
            read_rows(info.file, offset + start * (info.nbytes // rows), dest)
            return dest if info.shape else dest.reshape(())
        state = self._states.get(info.file)
        if state is None:
            state = self._states[info.file] = load_state(info.file)
        tensor = state[name]
        return tensor if not info.shape else tensor[start:stop]
