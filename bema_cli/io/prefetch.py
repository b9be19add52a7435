"""Cold inputs into the page cache ahead of the pass: posix_fadvise(WILLNEED), in the pass's own order.

A trainer's checkpoints are long written, so their pages are cold. A stabilize first spends
seconds importing torch (and starting CUDA) while the disk sits idle, and then reads each block
only when the pass needs it. This thread asks the kernel for the byte ranges the pass will read,
in the order it will read them, at most `ahead` bytes beyond what this process has read so far
(`safetensors.bytes_read`): the kernel's own read-ahead fills the page cache beside the import
and beside the writes, and the pass's reads then come from memory. Page cache, not this process's
memory: the kernel drops it under pressure, and --max-memory does not count it.

Only hints: a range that is gone or refused is skipped, and nothing here can fail a run.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from bema_cli.io import safetensors

HINT = 32 << 20  # bytes per fadvise call: the thread re-checks its budget (and `close`) between them
POLL_S = 0.01


def prefetch_bytes() -> int:
    """How far ahead of the reads the hints run: a quarter of the available memory, at most 2 GiB
    (about what a disk reads while torch imports); 0 (off) with BEMA_PREFETCH=0."""
    from bema_cli.machine import available_memory

    if os.environ.get("BEMA_PREFETCH", "1") == "0":
        return 0
    return min(2 << 30, available_memory() // 4)


def merged(ranges: list[tuple[Path, int, int]]) -> list[tuple[Path, int, int]]:
    """(file, start, end) ranges with each one that continues the one before it in the same file
    joined to it (a unit's consecutive tensors are one range)."""
    out: list[tuple[Path, int, int]] = []
    for path, start, end in ranges:
        if end <= start:
            continue
        if out and out[-1][0] == path and out[-1][2] == start:
            out[-1] = (path, out[-1][1], end)
        else:
            out.append((path, start, end))
    return out


class Prefetch:
    """A daemon thread hinting `ranges` ((file, start, end), in read order) to the kernel, at most
    `ahead` bytes past this process's reads; a context manager (`close` on exit)."""

    def __init__(self, ranges: list[tuple[Path, int, int]], ahead: int):
        self.ranges, self.ahead = merged(ranges), ahead
        self.hinted = 0  # bytes asked for so far
        self._start = safetensors.bytes_read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bema-prefetch", daemon=True)

    def __enter__(self) -> Prefetch:
        if self.ranges and self.ahead > 0 and hasattr(os, "posix_fadvise"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        for path, start, end in self.ranges:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there meanwhile: no wait
            except OSError:
                continue
            try:
                for at in range(start, end, HINT):
                    while self.hinted - (safetensors.bytes_read() - self._start) >= self.ahead:
                        if self._stop.wait(POLL_S):
                            return
                    if self._stop.is_set():
                        return
                    n = min(HINT, end - at)
                    os.posix_fadvise(fd, at, n, os.POSIX_FADV_WILLNEED)
                    self.hinted += n
            except OSError:
                pass
            finally:
                os.close(fd)
