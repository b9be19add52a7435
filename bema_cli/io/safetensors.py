"""Safetensors reading: header validation, a model index built from headers, a lazy chunk reader.

A chunk of rows along dim 0 is one contiguous byte range of the file (the header gives
its offset), so `ChunkReader.read_elements_into` reads it with one pread straight into the
caller's buffer: a copy out of the page cache at memory speed, nothing mapped (no page
fault per 4 KiB, no resident pages left behind, no SIGBUS when a file shrinks under us:
a short read is an error naming the file). `read` returns a fresh tensor the same way.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import is_regular

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
    offset: int = field(default=-1, compare=False)  # file byte offset of the data (safetensors), else -1

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
    def row_numel(self) -> int:
        """Elements of one slice along dim 0 (the whole tensor for a scalar)."""
        return self.numel // self.shape[0] if self.shape and self.shape[0] else self.numel

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice along dim 0 (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_header(path: Path) -> dict:
    """The JSON header of one safetensors file, validated against the file size (no tensor bytes read)."""
    return _header(path)[0]


def _header(path: Path) -> tuple[dict, int]:
    """read_header, and the file offset where the data section starts."""
    try:
        if not is_regular(path):
            raise FileNotFoundError(2, "No such file or directory", str(path))
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
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offsets = _entry_fields(path, name, entry)
        expect = DTYPES[dtype][1]
        for d in shape:
            expect *= d
        if offsets[1] - offsets[0] != expect:
            raise InputError(
                f"{path}: corrupt safetensors file (tensor {name!r}: data_offsets {offsets} hold "
                f"{offsets[1] - offsets[0]} bytes, dtype {dtype} and shape {shape} need {expect})"
            )
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):  # tensors tile the data section: no gap, no overlap
        if begin != end:
            raise InputError(
                f"{path}: corrupt safetensors file (tensor {name!r} starts at byte {begin}, expected {end})"
            )
        end = stop
    if 8 + n + end != size:
        raise InputError(
            f"{path}: corrupt or truncated safetensors file (expected {8 + n + end} bytes, found {size})"
        )
    return header, 8 + n


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry_fields(path: Path, name: str, entry) -> tuple[str, list[int], list[int]]:
    """dtype, shape and data_offsets of one header entry; InputError naming the file and the tensor."""
    if not isinstance(entry, dict):
        raise InputError(f"{path}: corrupt safetensors file (entry of tensor {name!r} is not an object)")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise InputError(f"{path}: corrupt safetensors file (tensor {name!r} has no dtype)")
    if dtype not in DTYPES:
        raise InputError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise InputError(
            f"{path}: corrupt safetensors file (tensor {name!r} has shape {shape!r}; dimensions are integers >= 0)"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise InputError(
            f"{path}: corrupt safetensors file (tensor {name!r} has data_offsets {offsets!r}; "
            "expected two integers >= 0)"
        )
    return dtype, shape, offsets


@dataclass
class ModelIndex:
    """Where every tensor of one model lives (built from headers only)."""

    folder: Path
    tensors: dict[str, TensorInfo]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def open(self) -> ChunkReader:
        """A reader of this model's tensors (the interface every format implements: see io/reader.py)."""
        return ChunkReader(self)

    def read_itemsize(self, info: TensorInfo) -> int:
        """Bytes per element a read of `info` holds at once (formats that compute rows hold more)."""
        return info.itemsize


def index_model(folder: Path, files: list[Path]) -> ModelIndex:
    """Index the tensors of a model stored in `files` (single file or shards); duplicate names are errors."""
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        header, data_start = _header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name in tensors:
                raise InputError(f"{path}: tensor {name!r} is also in {tensors[name].file.name}")
            shape = tuple(int(d) for d in entry["shape"])
            tensors[name] = TensorInfo(
                name, path, entry["dtype"], shape, data_start + entry["data_offsets"][0]
            )
    return ModelIndex(folder, tensors)


class ChunkReader:
    """Reads row ranges of tensors of one model; opens each file on first use, closes all on exit."""

    def __init__(self, index: ModelIndex):
        self.index = index
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def read(self, name: str, start: int, stop: int):
        """Rows [start, stop) of tensor `name` along dim 0 (the whole tensor for a scalar), as a torch tensor."""
        import torch

        info = self.index.tensors[name]
        if not 0 <= start <= stop <= (info.shape[0] if info.shape else 1):
            raise ValueError(f"rows [{start}, {stop}) of {name!r} {list(info.shape)}")
        out = torch.empty((stop - start, *info.shape[1:]) if info.shape else (), dtype=torch_dtype(info))
        self._pread(info, start * info.row_bytes, out.reshape(-1).view(torch.uint8).numpy())
        return out

    def read_elements_into(self, name: str, first: int, count: int, out, scratch=None) -> None:
        """Elements [first, first + count) of `name` (flattened) into `out` (flat, contiguous, any dtype:
        cast as `copy_` does). Same dtype on the CPU: read straight into out's memory. Otherwise the
        bytes land in `scratch` (a uint8 tensor of at least their size, reused by the caller; fresh if
        None) and are cast from there."""
        import torch

        info = self.index.tensors[name]
        dtype = torch_dtype(info)
        if out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous():
            self._pread(info, first * info.itemsize, out.view(torch.uint8).numpy())
            return
        n = count * info.itemsize
        raw = (
            scratch[:n] if scratch is not None and scratch.numel() >= n else torch.empty(n, dtype=torch.uint8)
        )
        self._pread(info, first * info.itemsize, raw.numpy())
        out.copy_(raw.view(dtype))

    def _pread(self, info: TensorInfo, at: int, buffer) -> None:
        """Fill `buffer` (bytes-like) from byte `at` of the tensor's data, in as many preads as it takes."""
        view = memoryview(buffer).cast("B")
        if info.offset < 0 or at < 0 or at + len(view) > info.nbytes:
            raise ValueError(f"bytes [{at}, {at + len(view)}) of {info.name!r} ({info.nbytes} bytes)")
        pos = info.offset + at
        try:
            fd = self._fds.get(info.file)
            if fd is None:  # read-ahead threads share this reader: the first open wins, a second closes
                opened = os.open(info.file, os.O_RDONLY)
                fd = self._fds.setdefault(info.file, opened)
                if fd != opened:
                    os.close(opened)
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], pos + done)
                if n == 0:
                    raise InputError(
                        f"{info.file}: cannot read tensor {info.name!r} (the file ends at byte {pos + done}: "
                        "truncated or rewritten since it was indexed)"
                    )
                done += n
            _read[0] += done
        except OSError as exc:  # rotated away or unreadable since indexing: a read, not a write
            raise InputError(f"{info.file}: cannot read ({exc.strerror or exc})") from None


_read = [0]  # bytes this process has read from safetensors files: the pace of io/prefetch.py


def bytes_read() -> int:
    return _read[0]


def torch_dtype(info: TensorInfo):
    import torch

    return getattr(torch, DTYPES[info.dtype][0])
