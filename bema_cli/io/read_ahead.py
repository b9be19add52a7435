"""Read-ahead: the raw bytes of the next blocks of a unit, read by `--readers` threads while the
caller computes the current block.

`os.preadv` releases the GIL, so N threads keep N reads in flight beside the compute thread.
Each block's parts land, in the file's dtype, in one buffer of a ring allocated once (pinned on a
GPU: io/transfer.py); the caller casts them into its block buffer in block order, with the same
`copy_` the synchronous path does, so the outputs are bitwise the same for any N. At most `ahead`
blocks are read ahead (a few MB on the CPU); a ring buffer is refilled only once the caller has
released it (`release`, with the event of its copy to the device, if any).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from bema_cli.io.safetensors import torch_dtype
from bema_cli.io.transfer import aligned, wait


def default_readers() -> int:
    """Threads reading ahead: 2 on a 2-core machine (measured 10% faster than synchronous reads on
    the 0.5B and 1.5B shapes, docs/performance.md), half the cores up to 4 on larger ones; 1 (no
    read-ahead) on a single core."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 1 if cores < 2 else min(4, max(2, cores // 2))


def ahead_blocks(readers: int) -> int:
    """Blocks read ahead and held at once (none with one reader on the CPU): what --max-memory must
    reserve. The ring holds one more, the block being copied in."""
    return readers + 1 if readers > 1 else 0


class ReadAhead:
    """Blocks' raw bytes in order: `blocks` is [(lo, hi, [(piece, a, b), ...])] (unit._blocks);
    `transfers` (io/transfer.Transfers) allocates the ring where the device copies from fastest."""

    def __init__(self, reader, blocks: list, first_element, readers: int, transfers=None, ahead=None):
        import torch

        self.reader, self.blocks, self.first_element = reader, blocks, first_element
        self.pool = ThreadPoolExecutor(max_workers=max(1, readers), thread_name_prefix="bema-read")
        self.ahead = max(1, ahead or ahead_blocks(readers))
        self.futures: dict[int, object] = {}
        self.next = 0
        nbytes = max((self._nbytes(parts) for _, _, parts in blocks), default=0)
        empty = transfers.host_empty if transfers is not None else (lambda n, d: torch.empty(n, dtype=d))
        self.ring = [empty(nbytes, torch.uint8) for _ in range(self.ahead + 1)]
        self.released: list = [None] * len(self.ring)  # per ring buffer: the event of its last copy

    def _nbytes(self, parts) -> int:
        return sum(aligned((b - a) * self.reader.index.tensors[p.info.name].itemsize) for p, a, b in parts)

    def _fetch(self, i: int) -> list:
        """Block i's parts as (a, b, elements [a, b) of the unit in the file's dtype), each one pread
        into ring buffer i % len(ring), once that buffer's last copy has happened."""
        slot = i % len(self.ring)
        wait(self.released[slot])
        buffer, pos, out = self.ring[slot], 0, []
        for p, a, b in self.blocks[i][2]:
            info = self.reader.index.tensors[p.info.name]
            n = (b - a) * info.itemsize
            data = buffer[pos : pos + n].view(torch_dtype(info))
            self.reader.read_elements_into(p.info.name, self.first_element(p, a), b - a, data)
            out.append((a, b, data))
            pos += aligned(n)
        return out

    def _submit_until(self, i: int) -> None:
        while self.next < min(len(self.blocks), i + self.ahead):
            self.futures[self.next] = self.pool.submit(self._fetch, self.next)
            self.next += 1

    def __iter__(self) -> Iterator[list]:
        for i in range(len(self.blocks)):
            self._submit_until(i)
            yield self.futures.pop(i).result()  # a read error is raised here, in the caller's thread

    def release(self, i: int, event=None) -> None:
        """Block i's buffer may be refilled once `event` (its copy to the device) has happened."""
        self.released[i % len(self.ring)] = event

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)
