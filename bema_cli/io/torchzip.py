"""Rows straight out of torch.save files, without unpickling per read.

torch.save writes a zip whose tensor records (`<archive>/data/<key>`) are stored uncompressed
(little-endian on every platform bema runs on), so the rows [a, b) of a contiguous tensor are
one pread at a known byte offset. `.bin` files and every chunk of a DCP checkpoint are such
zips. Offsets are found once (zip directory + the local file header), then each read costs
only its own bytes and never holds a mapping open.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile
from pathlib import Path

from bema_cli.errors import InputError

LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


class FileWindow(io.RawIOBase):
    """A read-only, seekable window [offset, offset + length) of an open file (e.g. one DCP chunk)."""

    def __init__(self, f, offset: int = 0, length: int | None = None):
        self.f, self.offset, self.pos = f, offset, 0
        self.length = os.fstat(f.fileno()).st_size - offset if length is None else length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


def data_records(window: FileWindow) -> dict[str, tuple[int, int]] | None:
    """{record name: (byte offset of its data within the window, size)} of a torch.save zip's tensor
    records; None when the zip is not plain (compressed records, big-endian byte order)."""
    try:
        zf = zipfile.ZipFile(window)
        infos = zf.infolist()
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if order and zf.read(order[0]).strip() != b"little":
            return None
        records = {}
        for info in infos:
            if "/data/" not in info.filename or info.filename.endswith("/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            window.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", window.read(4))
            records[info.filename] = (
                info.header_offset + LOCAL_HEADER + name_len + extra_len,
                info.file_size,
            )
        return records
    except (zipfile.BadZipFile, struct.error, OSError, ValueError):
        return None


class _TensorLayout(pickle.Unpickler):
    """Reads a torch.save pickle of one tensor as (storage offset, size, stride), building nothing else:
    the tensor-rebuild global becomes a tuple; any global but it, storage types and OrderedDict is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (int(offset), tuple(size), tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return name
        if (module, name) == ("collections", "OrderedDict"):  # the (empty) backward hooks
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid


def tensor_layout(window: FileWindow) -> tuple[int, tuple, tuple] | None:
    """(storage offset in elements, size, stride) of the one tensor a torch.save zip holds; None if
    it holds something else. No tensor bytes are read and nothing but tuples is built."""
    try:
        zf = zipfile.ZipFile(window)
        (pkl,) = [i for i in zf.infolist() if i.filename.endswith("/data.pkl")]
        layout = _TensorLayout(io.BytesIO(zf.read(pkl))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, TypeError, EOFError, OSError):
        return None
    ok = isinstance(layout, tuple) and len(layout) == 3 and isinstance(layout[0], int)
    return layout if ok else None


def contiguous_strides(size: tuple) -> tuple:
    strides, n = [], 1
    for d in reversed(size):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def read_rows(path: Path, offset: int, dest) -> None:
    """Fill the contiguous tensor `dest` with its bytes at `offset` of `path` (one pread loop)."""
    import torch

    view = dest.reshape(-1).view(torch.uint8).numpy()
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise InputError(f"{path}: truncated file (ends before byte {offset + len(view)})")
                done += got
        finally:
            os.close(fd)
    except OSError as exc:  # rotated away (deleted) since indexing, an I/O error: a read, not a write
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None


def release_freed_memory() -> None:
    """Hand freed row buffers back to the OS (glibc's malloc_trim) when a reader closes.

    Row reads allocate a fresh buffer each; glibc raises its mmap threshold after the first
    large free and then serves these from the heap, which it does not shrink: measured +25-40 MiB
    of peak RSS over a 6-checkpoint run at --max-memory 64MiB. A no-op where there is no glibc.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None  # resolved on first use
