"""Read-ahead: the raw bytes of the next blocks of a unit, read by `--readers` threads while the
caller computes the current block.

`os.preadv` releases the GIL, so N threads keep N reads in flight beside the compute thread.
Each block's elements land in a buffer of their own; the caller casts them into its block buffer
in block order, with the same `copy_` the synchronous path does, so the outputs are bitwise the
same for any N. At most `readers + 1` blocks are read ahead (a few MB).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from bema_cli.io.safetensors import torch_dtype


def default_readers() -> int:
    """Threads reading ahead: 2 on a 2-core machine (measured 10% faster than synchronous reads on
    the 0.5B and 1.5B shapes, docs/performance.md), half the cores up to 4 on larger ones; 1 (no
    read-ahead) on a single core."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 1 if cores < 2 else min(4, max(2, cores // 2))


def ahead_blocks(readers: int) -> int:
    """Blocks read ahead and held at once (none with one reader): what --max-memory must reserve."""
    return readers + 1 if readers > 1 else 0


class ReadAhead:
    """Blocks' raw bytes in order: `blocks` is [(lo, hi, [(piece, a, b), ...])] (unit._blocks)."""

    def __init__(self, reader, blocks: list, first_element, readers: int):
        self.reader, self.blocks, self.first_element = reader, blocks, first_element
        self.pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="bema-read")
        self.ahead = ahead_blocks(readers)
        self.futures: dict[int, object] = {}
        self.next = 0

    def _fetch(self, i: int) -> list:
        """Block i's parts as (a, b, elements [a, b) of the unit in the file's dtype), each one pread."""
        import torch

        _, _, parts = self.blocks[i]
        out = []
        for p, a, b in parts:
            data = torch.empty(b - a, dtype=torch_dtype(self.reader.index.tensors[p.info.name]))
            self.reader.read_elements_into(p.info.name, self.first_element(p, a), b - a, data)
            out.append((a, b, data))
        return out

    def _submit_until(self, i: int) -> None:
        while self.next < min(len(self.blocks), i + self.ahead):
            self.futures[self.next] = self.pool.submit(self._fetch, self.next)
            self.next += 1

    def __iter__(self) -> Iterator[list]:
        for i in range(len(self.blocks)):
            self._submit_until(i)
            yield self.futures.pop(i).result()  # a read error is raised here, in the caller's thread

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)
