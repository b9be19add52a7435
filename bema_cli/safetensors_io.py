"""Safetensors I/O: an index-driven lazy reader and a small streaming sharded writer.

Reading goes through `safetensors.safe_open` (memory-mapped) and `get_slice`, so a
chunk of rows costs only its own bytes. Resident memory counts the mapped pages a
read touches, so a `ChunkReader` is opened per work unit and closed right after:
holding handles of every checkpoint for a whole run would grow RSS to the model size.

The safetensors package writes whole state dicts only, so `ShardedWriter` writes the
format directly: 8-byte little-endian header length, a JSON header padded with spaces
to a multiple of 8, then the tensor bytes at the offsets the header promises.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from bema_cli.errors import InputError

# safetensors dtype tag -> (torch dtype name, bytes per element)
DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
FLOATING = ("F64", "F32", "F16", "BF16")  # stabilized; everything else is copied from theta_s
TAG_OF = {torch_name: tag for tag, (torch_name, _) in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice along dim 0 (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_header(path: Path) -> dict:
    """The JSON header of one safetensors file, validated against the file size (no tensor bytes read)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise InputError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER or 8 + n > size:
                raise InputError(
                    f"{path}: corrupt or truncated safetensors file (header of {n} bytes, file of {size})"
                )
            header = json.loads(f.read(n))
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"{path}: corrupt safetensors file (header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = entry["data_offsets"]
            if entry["dtype"] not in DTYPES:
                raise InputError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
            expect = DTYPES[entry["dtype"]][1]
            for d in entry["shape"]:
                expect *= int(d)
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: corrupt safetensors file (bad entry for tensor {name!r})") from None
        if stop - begin != expect or begin < 0:
            raise InputError(f"{path}: corrupt safetensors file (tensor {name!r} has inconsistent offsets)")
        end = max(end, stop)
    if 8 + n + end != size:
        raise InputError(
            f"{path}: corrupt or truncated safetensors file (expected {8 + n + end} bytes, found {size})"
        )
    return header


@dataclass
class ModelIndex:
    """Where every tensor of one model lives (built from headers only)."""

    folder: Path
    tensors: dict[str, TensorInfo]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def index_model(folder: Path, files: list[Path]) -> ModelIndex:
    """Index the tensors of a model stored in `files` (single file or shards); duplicate names are errors."""
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        for name, entry in read_header(path).items():
            if name == "__metadata__":
                continue
            if name in tensors:
                raise InputError(f"{path}: tensor {name!r} is also in {tensors[name].file.name}")
            tensors[name] = TensorInfo(name, path, entry["dtype"], tuple(int(d) for d in entry["shape"]))
    return ModelIndex(folder, tensors)


class ChunkReader:
    """Reads row ranges of tensors of one model; opens each file on first use, closes all on exit."""

    def __init__(self, index: ModelIndex):
        self.index = index
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()  # dropping the handles unmaps the files

    def read(self, name: str, start: int, stop: int):
        """Rows [start, stop) of tensor `name` along dim 0 (the whole tensor for a scalar), as a torch tensor."""
        from safetensors import SafetensorError, safe_open

        info = self.index.tensors[name]
        try:
            handle = self._handles.get(info.file)
            if handle is None:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            if not info.shape or (start == 0 and stop == info.shape[0]):
                return handle.get_tensor(name)
            return handle.get_slice(name)[start:stop]
        except SafetensorError as exc:
            raise InputError(f"{info.file}: cannot read tensor {name!r} ({exc})") from None


# -- writing ------------------------------------------------------------------


@dataclass
class Shard:
    filename: str
    tensors: list[TensorInfo] = field(default_factory=list)  # in file order
    offsets: dict[str, int] = field(default_factory=dict)  # name -> start within the data section

    @property
    def data_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: list[TensorInfo], max_shard_size: int) -> list[Shard]:
    """Split tensors (in the given order) into HF-style shards of at most max_shard_size bytes each.

    A tensor larger than the limit gets a shard of its own. Within a shard tensors are
    ordered by element size, largest first, so every tensor starts at an aligned offset.
    """
    groups: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    shards = []
    for i, group in enumerate(groups, start=1):
        name = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        shard = Shard(name, sorted(group, key=lambda t: (-t.itemsize, t.name)))
        offset = 0
        for t in shard.tensors:
            shard.offsets[t.name] = offset
            offset += t.nbytes
        shards.append(shard)
    return shards


def encode_header(shard: Shard, metadata: dict[str, str]) -> bytes:
    """8-byte LE length + JSON header (with `__metadata__`) padded with spaces to a multiple of 8."""
    header: dict = {"__metadata__": {"format": "pt", **{k: str(v) for k, v in metadata.items()}}}
    for t in shard.tensors:
        begin = shard.offsets[t.name]
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [begin, begin + t.nbytes]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class ShardedWriter:
    """Writes one model folder whose layout is fixed up front; tensor bytes may arrive in any order.

    Files are created at full size with their header on `open()`; `write` puts bytes at
    their final offsets with os.pwrite; `close()` writes the index json when sharded.
    """

    def __init__(self, folder: Path, shards: list[Shard], metadata: dict[str, str]):
        self.folder = folder
        self.shards = shards
        self.metadata = metadata
        self._data_start: list[int] = []
        self._where = {t.name: i for i, s in enumerate(shards) for t in s.tensors}

    def open(self) -> ShardedWriter:
        self.folder.mkdir(parents=True, exist_ok=True)
        for shard in self.shards:
            header = encode_header(shard, self.metadata)
            with open(self.folder / shard.filename, "wb") as f:
                f.write(header)
                f.truncate(len(header) + shard.data_size)
            self._data_start.append(len(header))
        return self

    def write(self, name: str, byte_offset: int, data) -> int:
        """Write `data` (a bytes-like buffer) at `byte_offset` within tensor `name`; returns bytes written."""
        i = self._where[name]
        shard = self.shards[i]
        pos = self._data_start[i] + shard.offsets[name] + byte_offset
        view = memoryview(data).cast("B")
        fd = os.open(self.folder / shard.filename, os.O_WRONLY)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], pos + done)
        finally:
            os.close(fd)
        return done

    def close(self) -> None:
        if len(self.shards) > 1:
            index = {
                "metadata": {"total_size": sum(s.data_size for s in self.shards)},
                "weight_map": {t.name: s.filename for s in self.shards for t in s.tensors},
            }
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    @property
    def nbytes(self) -> int:
        """Total bytes of the folder's safetensors files (headers included)."""
        return sum(len(encode_header(s, self.metadata)) + s.data_size for s in self.shards)


def tensor_bytes(tensor):
    """A CPU tensor's raw bytes as a writable buffer (bf16 included, which numpy lacks): via a uint8 view."""
    import torch

    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy()
