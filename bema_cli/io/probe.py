"""This machine's read, compute and write speeds, measured in a fraction of a second for the
projections (`--dry-run`, and the time a run says it will take): the disk's write speed is measured
with O_DIRECT, as the outputs are written (io/writer.py), so the probe lives in io/ beside it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

PROBE_BYTES = 64 << 20  # what the probe reads and writes
PROBE_CHUNK = 4 << 20  # in pieces of this size, the only memory it holds
FALLBACK_WRITE = 100e6  # bytes/s assumed where the write probe could not run (a full disk)

_probed: dict[str, dict] = {}


def probe(sample: Path, out_dir: Path) -> dict:
    """`measure_speeds`, once per process and output filesystem: a --follow round or a second
    sweep in one `bema ship` reuses the first one's (64 MB written and fsync'ed each time otherwise)."""
    while not out_dir.is_dir() and out_dir != out_dir.parent:  # the filesystem the outputs will go to
        out_dir = out_dir.parent
    key = str(out_dir.resolve())
    if key not in _probed:
        _probed[key] = measure_speeds(sample, out_dir)
    return _probed[key]


def _direct_write_seconds(path: str, data: bytearray) -> float | None:
    """Seconds to write PROBE_BYTES over `path` with O_DIRECT, as the outputs are written
    (io/writer.py): the disk's own speed. An fsync measured that badly: on ext4 it waits for every
    file's dirty data in the journal's transaction (after a 15 GB checkpoint save: 0.3 GB/s
    projected for a disk that wrote 1.4). None where O_DIRECT is off or refused."""
    import mmap

    from bema_cli.io.direct import direct_io

    if not direct_io():
        return None
    aligned = mmap.mmap(-1, len(data))  # page-aligned, as O_DIRECT needs
    aligned[:] = data
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return None
    try:  # past the bytes just written through the page cache: their write-back is not timed
        t = time.perf_counter()
        for i in range(PROBE_BYTES // len(data)):
            os.pwrite(fd, aligned, PROBE_BYTES + i * len(data))
        return time.perf_counter() - t
    except OSError:
        return None
    finally:
        os.close(fd)
        aligned.close()


def _scratch(out_dir: Path) -> int:
    """A file to time writes with in `out_dir` that no listing shows and no kill leaves behind: a
    nameless one (O_TMPFILE), else one whose name is unlinked at once."""
    try:
        return os.open(out_dir, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):
        fd, name = tempfile.mkstemp(prefix=".bema-probe-", dir=out_dir)
        os.unlink(name)
        return fd


def measure_speeds(sample: Path, out_dir: Path) -> dict:
    """This machine's speeds, now (~0.3 s): read (bytes/s, the page cache as it stands), compute
    (element passes/s on one thread fewer than the cores, as units run), page-cache and disk write
    (bytes/s; the disk's with O_DIRECT, as the outputs are written, else through an fsync). The
    sweep adds `engine_speeds`."""
    import torch

    buf = bytearray(PROBE_CHUNK)  # a few MB held at a time: the probe stays inside --max-memory
    view, done = memoryview(buf), 0
    with open(sample, "rb", buffering=0) as f:
        t = time.perf_counter()
        while done < PROBE_BYTES and (n := f.readinto(view)):
            done += n
        read = max(done, 1) / max(time.perf_counter() - t, 1e-6)
    a, b = torch.zeros(PROBE_CHUNK // 4), torch.ones(PROBE_CHUNK // 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        a.lerp_(b, 0.5)
        t = time.perf_counter()
        for _ in range(32):
            a.lerp_(b, 0.5)
        compute = 32 * a.numel() / max(time.perf_counter() - t, 1e-6)
    finally:
        torch.set_num_threads(threads)
    buf[:] = os.urandom(PROBE_CHUNK)
    written, cached, disk = 0, 0.0, 0.0
    try:  # a full disk or a file-size limit is the run's to report, naming its file: not the probe's
        fd = _scratch(out_dir)
        path = f"/proc/self/fd/{fd}"  # the same nameless file, opened again with O_DIRECT
        try:
            t = time.perf_counter()
            for _ in range(PROBE_BYTES // PROBE_CHUNK):
                written += os.write(fd, buf)
            cached = time.perf_counter() - t
            disk = _direct_write_seconds(path, buf)
            if disk is None:  # no O_DIRECT here: the page cache's bytes through an fsync
                os.fsync(fd)
                disk = time.perf_counter() - t
        finally:
            os.close(fd)
    except OSError:
        pass
    if not (written and cached and disk):  # no measurement: a slow disk's speed, so never optimistic
        written, cached, disk = PROBE_BYTES, PROBE_BYTES / FALLBACK_WRITE, PROBE_BYTES / FALLBACK_WRITE
    return {
        "read": read,
        "compute": compute,
        "write_cache": written / max(cached, 1e-6),
        "write_disk": written / max(disk, 1e-6),
    }
