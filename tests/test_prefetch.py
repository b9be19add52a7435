"""io/prefetch.py: the kernel is asked for the inputs in the pass's own order, a bounded distance
ahead of the pass's reads, and the pages do arrive in the page cache."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import pytest
import torch
from trajectory import write_trajectory

from bema_cli.io import prefetch, safetensors
from bema_cli.io.prefetch import Prefetch, merged

SHAPES = {"a.weight": (64, 256), "b.bias": (300,), "c.weight": (40, 128), "d.weight": (96, 64)}


def test_the_hints_are_the_passs_own_reads_in_its_order(tmp_path, monkeypatch):
    """Every byte range the pass reads (recorded at the pread, across several units and steps),
    joined where consecutive, is exactly `read_ranges`, in the same order."""
    from bema_cli.schedule import Schedule
    from bema_cli.stabilize import stabilize
    from bema_cli.stabilize.plan import Options, Output
    from bema_cli.stabilize.prepare import prepare
    from bema_cli.stabilize.unit import read_ranges

    base, run = write_trajectory(tmp_path / "t", [10, 20, 30], shapes=SHAPES, with_int=False)
    opts = Options(str(run), [Schedule(method="bema").resolved()], str(tmp_path / "out"), base=str(base),
                   max_memory=200_000, readers=1, write=Output(no_state=True))  # fmt: skip
    plan = prepare(opts)
    assert len(plan.units) >= 3  # the order across units is what is checked
    read = []
    real = safetensors.ChunkReader._pread

    def recorded(self, info, at, buffer):
        read.append(
            (
                Path(os.path.realpath(info.file)),
                info.offset + at,
                info.offset + at + memoryview(buffer).nbytes,
            )
        )
        return real(self, info, at, buffer)

    monkeypatch.setattr(safetensors.ChunkReader, "_pread", recorded)
    stabilize(opts)
    hinted = [(Path(os.path.realpath(f)), a, b) for f, a, b in read_ranges(plan)]
    assert merged(read) == merged(hinted)
    numel = sum(torch.Size(shape).numel() for shape in SHAPES.values())
    assert sum(b - a for _, a, b in hinted) == 4 * numel * 4  # the base and 3 steps, float32


def _file(path: Path, nbytes: int) -> Path:
    path.write_bytes(os.urandom(nbytes))
    return path


def test_the_hints_stay_a_bounded_distance_ahead_of_the_reads(tmp_path, monkeypatch):
    """With `ahead` one hint, the thread asks for one hint's bytes and waits; each read lets it ask for
    as many more; `close` ends it while it waits."""
    monkeypatch.setattr(prefetch, "HINT", 1 << 16)
    path = _file(tmp_path / "x.bin", 8 << 16)
    with Prefetch([(path, 0, 8 << 16)], ahead=1 << 16) as pf:
        _until(lambda: pf.hinted == 1 << 16)
        time.sleep(0.2)
        assert pf.hinted == 1 << 16  # waits for the pass
        safetensors._read[0] += 3 << 16  # the pass read three hints' worth
        _until(lambda: pf.hinted == 4 << 16)
        time.sleep(0.2)
        assert pf.hinted == 4 << 16
    assert not pf._thread.is_alive()


def _until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _resident(path: Path) -> float:
    """The share of the file's pages in the page cache (mincore(2) over a private mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        first = ctypes.c_char.from_buffer(m)  # the mapping's address; no page is touched
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size), vec)
        del first  # before the mapping closes
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec) / pages


def test_the_hinted_pages_arrive_in_the_page_cache(tmp_path):
    path = _file(tmp_path / "cold.bin", 16 << 20)
    os.sync()
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _resident(path) > 0.5:
        pytest.skip("this filesystem keeps the pages (DONTNEED dropped nothing): nothing to observe")
    with Prefetch([(path, 0, 8 << 20)], ahead=1 << 30):
        _until(lambda: _resident(path) >= 0.45, timeout=10)
    assert _resident(path) < 0.75  # only the hinted half was asked for


def test_merged_joins_only_what_continues_in_the_same_file():
    a, b = Path("a"), Path("b")
    got = merged([(a, 0, 10), (a, 10, 20), (b, 20, 30), (a, 20, 25), (a, 30, 30), (a, 40, 50)])
    assert got == [(a, 0, 20), (b, 20, 30), (a, 20, 25), (a, 40, 50)]


def test_a_range_that_is_gone_is_skipped(tmp_path):
    path = _file(tmp_path / "there.bin", 1 << 16)
    with Prefetch([(tmp_path / "gone.bin", 0, 100), (path, 0, 1 << 16)], ahead=1 << 30) as pf:
        _until(lambda: pf.hinted == 1 << 16)
