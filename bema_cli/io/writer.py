"""The streaming sharded safetensors writer that every output goes through.

The safetensors package writes whole state dicts only, so `ShardedWriter` writes the
format directly: 8-byte little-endian header length, a JSON header padded with spaces
to a multiple of 8, then the tensor bytes at the offsets the header promises.

Files are allocated at full size up front (fallocate(2)): writing into allocated extents
ran ~2x faster through the page cache than into a sparse file here (docs/performance.md),
and a full disk is reported before any work rather than mid-run.

Inside `held()` a file written front to back bypasses the page cache (io/direct.py).
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bema_cli.errors import OutputError
from bema_cli.io.direct import DirectFile, pwrite_all
from bema_cli.io.safetensors import TensorInfo

MAX_SHARD_SIZE = 5 * 10**9  # bytes per shard at most: the HF Hub's 5GB (--max-shard-size's default)


@dataclass
class Shard:
    filename: str
    tensors: list[TensorInfo] = field(default_factory=list)  # in file order
    offsets: dict[str, int] = field(default_factory=dict)  # name -> start within the data section

    @property
    def data_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: list[TensorInfo], max_shard_size: int, group=None) -> list[Shard]:
    """Split tensors (in the given order) into HF-style shards of at most max_shard_size bytes each.

    A tensor larger than the limit gets a shard of its own. Within a shard tensors are
    ordered by element size, largest first, so every tensor starts at an aligned offset.
    `group(tensor)`, when given, starts a new shard wherever its value changes: tensors a caller
    writes side by side (a state's e1 and e2 rows) then lie in files of their own, each written
    front to back (past the page cache, and summed as written).
    """
    groups: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        last = groups[-1][-1] if groups[-1] else None
        if last and (size + t.nbytes > max_shard_size or (group and group(t) != group(last))):
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
    Inside `held()` the files stay open between writes (a streaming caller writes many
    small blocks); outside it each write opens its file, so a writer can be pickled to
    another process (a Ray worker) and used there.
    """

    def __init__(self, folder: Path, shards: list[Shard], metadata: dict[str, str], digest: bool = False):
        """`digest`: sum each file (fingerprint.file_digest's xxh3_128) as its bytes are written front to
        back, so the caller need not read it back (`digests`)."""
        self.folder = folder
        self.shards = shards
        self.metadata = metadata
        # header sizes are known before any file exists, so a writer built from the same layout in
        # another process (a Ray worker) writes into files that `open()` pre-created here
        self._data_start = [len(encode_header(s, metadata)) for s in shards]
        self._where: dict[str, int] | None = None  # built on first write: not shipped to workers
        self._fds: dict[int, int] | None = None  # shard -> open fd, inside held()
        self._direct: dict[int, DirectFile | None] = {}  # shard -> its O_DIRECT writer, inside held()
        self.direct_bytes = 0  # bytes this process wrote bypassing the page cache
        self._digest = digest
        self._sums: dict[int, tuple[object, int]] = {}  # shard -> (running digest, offset it reached)

    def __getstate__(self) -> dict:  # another process's writes are not summed here: `digests` skips them
        return {**self.__dict__, "_fds": None, "_direct": {}, "_sums": {}, "_digest": False}

    def open(self) -> ShardedWriter:
        """Create the folder and its files at full size, each with its header; tensor bytes come later."""
        with _naming(self.folder):
            self.folder.mkdir(parents=True, exist_ok=True)
        for i, shard in enumerate(self.shards):
            header = encode_header(shard, self.metadata)
            with _naming(self.folder / shard.filename), open(self.folder / shard.filename, "wb") as f:
                f.write(header)
                f.flush()
                allocate(f.fileno(), len(header) + shard.data_size)
            if self._digest:
                import xxhash

                self._sums[i] = (xxhash.xxh3_128(header), len(header))
        return self

    def digests(self) -> dict[str, str]:
        """{file name: digest} of the files written whole, front to back, by this process since `open`
        (the others are left for the caller to read back)."""
        done = {}
        for i, (running, reached) in self._sums.items():
            if reached == self._data_start[i] + self.shards[i].data_size:
                done[self.shards[i].filename] = running.hexdigest()
        return done

    def _sum(self, i: int, pos: int, view: memoryview) -> None:
        """Feed the running digest of shard `i`; a write out of order ends it (`digests` skips the file)."""
        running, reached = self._sums.get(i, (None, -1))
        if pos != reached:
            self._sums.pop(i, None)
            return
        running.update(view)
        self._sums[i] = (running, reached + len(view))

    @contextmanager
    def held(self) -> Iterator[ShardedWriter]:
        """Keep the shard files open for the writes made inside (closed on exit)."""
        self.hold()
        try:
            yield self
        except BaseException:
            self.release(flush=False)
            raise
        self.release()

    def hold(self) -> None:
        """Keep the shard files open for the writes that follow, until `release` (`held` is both:
        the engine's write-behind thread calls them, around each step's blocks)."""
        self._fds, self._direct = {}, {}

    def release(self, flush: bool = True) -> None:
        """Close what `hold` kept open; `flush` writes the staged tails first (not after an error:
        the run fails)."""
        fds, self._fds = self._fds or {}, None
        directs, self._direct = self._direct, {}
        try:
            for i, direct in directs.items() if flush else ():
                if direct is not None:
                    with _naming(self.folder / self.shards[i].filename):
                        self.direct_bytes += direct.flush()
        finally:
            for direct in directs.values():
                if direct is not None:
                    direct.close()
            for fd in fds.values():
                os.close(fd)

    def write(self, name: str, byte_offset: int, data) -> int:
        """Write `data` (a bytes-like buffer) at `byte_offset` within tensor `name`; returns bytes written."""
        if self._where is None:
            self._where = {t.name: i for i, s in enumerate(self.shards) for t in s.tensors}
        i = self._where[name]
        shard = self.shards[i]
        pos = self._data_start[i] + shard.offsets[name] + byte_offset
        view = memoryview(data).cast("B")
        if self._sums:
            self._sum(i, pos, view)
        with _naming(self.folder / shard.filename):
            fd = self._fds.get(i) if self._fds is not None else None
            if fd is None:
                fd = os.open(self.folder / shard.filename, os.O_WRONLY)
                if self._fds is not None:
                    self._fds[i] = fd
            try:
                if self._fds is not None:
                    if i not in self._direct:
                        self._direct[i] = DirectFile.open(self.folder / shard.filename, fd, pos)
                    direct = self._direct[i]
                    if direct is not None:
                        self.direct_bytes += direct.write(pos, view)
                        return len(view)
                pwrite_all(fd, view, pos)
            finally:
                if self._fds is None:
                    os.close(fd)
        return len(view)

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
        return sum(start + s.data_size for start, s in zip(self._data_start, self.shards, strict=True))


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """A full disk, a quota, a file-size limit or a permission error names the file being written."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None


_fallocate = None  # libc's fallocate(2), looked up on first use (not at import: `bema --help` stays instant)


def _libc_fallocate():
    import ctypes

    global _fallocate
    if _fallocate is None:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols, libc's among them
        _fallocate = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None) or False
        if _fallocate:
            _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return _fallocate


def allocate(fd: int, size: int) -> None:
    """Make the file `size` bytes long with its blocks allocated (fallocate(2), mode 0: reads as zeros).

    Not posix_fallocate: where the filesystem cannot (NFS, some FUSE), glibc's fallback writes
    every block, and we would rather fall back to a sparse file (ftruncate) there. ENOSPC,
    EFBIG and the like are real errors and raise.
    """
    fallocate = _libc_fallocate() if size > 0 and os.name == "posix" else False
    if fallocate:
        import ctypes

        if fallocate(fd, 0, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)


def tensor_bytes(tensor):
    """A CPU tensor's raw bytes as a writable buffer (bf16 included, which numpy lacks): via a uint8 view."""
    import torch

    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy()
