"""Write-behind: output blocks go to their files from a second thread while the next block is computed.

The engine computes an output block in a few milliseconds into a buffer taken from a small
pool, hands it over with `put`, and goes on; this thread copies it into the page cache
(`pwrite`, which releases the GIL) and returns the buffer to the pool. On a 2-core machine
that overlaps the largest cost of a run, the page-cache copy of every output byte, with the
arithmetic (docs/performance.md). The pool bounds what is in flight: `buffer` blocks until
the writer has freed one, so memory stays at `depth` blocks per dtype.

A write error is kept and raised in the caller's thread at the next `buffer`/`put` or at
`close`; after an error, or when the caller leaves early (an exception, a signal), queued
blocks are dropped rather than written: the run is failing and its temp folder goes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

DEPTH = 4  # buffers per dtype in flight: one being filled, up to three queued or being written


class WriteBehind:
    """A pool of block buffers and one writer thread; a context manager (`close` on exit)."""

    def __init__(self, block: int, depth: int = DEPTH, background: bool = True):
        """`background` False: `put` writes at once in the caller's thread (two buffers per dtype: one
        filled, one being cast from it)."""
        self.block, self.depth = block, depth if background else 2
        self._free: dict = {}  # torch dtype -> queue of free buffers (each `block` elements)
        self._all: dict = {}  # torch dtype -> every buffer of the pool
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stop = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="bema-write-behind", daemon=True)
            self._thread.start()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._stop = True  # drop what is queued: the caller is failing anyway
        self.close(raise_error=exc_type is None)

    def buffer(self, dtype, n: int):
        """A free buffer of `n` <= block elements of `dtype` (waits for the writer to free one)."""
        import torch

        self._raise()
        free = self._free.get(dtype)
        if free is None:
            free = self._free[dtype] = queue.SimpleQueue()
            self._all[dtype] = [torch.empty(self.block, dtype=dtype) for _ in range(self.depth)]
            for b in self._all[dtype]:
                free.put(b)
        while True:
            try:
                return free.get(timeout=0.5)[:n]
            except queue.Empty:
                self._raise()  # a writer that failed keeps returning buffers, so this only guards a bug
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("the write-behind thread ended") from None

    def owns(self, data, dtype) -> bool:
        """Whether `data` is a buffer of this pool with `dtype` (then `put` takes it without a copy)."""
        return data.dtype == dtype and any(data._base is b for b in self._all.get(dtype, ()))

    def release(self, data) -> None:
        """Give back a buffer taken with `buffer` and not `put`."""
        self._free[data.dtype].put(data._base)

    def put(self, data, writes: list[Callable[[object], None]]) -> None:
        """Queue `data` (a buffer from `buffer`); the writer calls each of `writes` with it, then frees it."""
        self._raise()
        if self._thread is None:
            self._write((data, writes))
            self._raise()
        else:
            self._jobs.put((data, writes))

    def close(self, raise_error: bool = True) -> None:
        """Wait until every queued block is written (or dropped, after an error); re-raise a write error."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        if raise_error:
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._stop = True
            raise error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._write(job)

    def _write(self, job) -> None:
        data, writes = job
        try:
            if not self._stop and self._error is None:
                for write in writes:
                    write(data)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc
        finally:
            self._free[data.dtype].put(data._base)
