"""Write-behind: output blocks go to their files from a second thread while the next block is computed.

The engine computes an output block in a few milliseconds into a buffer taken from a small
pool, hands it over with `put`, and goes on; this thread copies it into the page cache
(`pwrite`, which releases the GIL) and returns the buffer to the pool. On a 2-core machine
that overlaps the largest cost of a run, the page-cache copy of every output byte, with the
arithmetic (docs/performance.md). The pool bounds what is in flight: `buffer` blocks until
the writer has freed one, so memory stays at `depth` blocks per dtype. Pool and thread live as
long as the caller's workspace: allocating the pool per step made glibc keep the freed blocks
(its mmap threshold rises after the first free), +19 MiB of peak RSS in a 32 MiB-budget run.

A write error is kept and raised in the caller's thread at the next `buffer`/`put` or at the
end of a `batch`; when the caller leaves a batch early (an exception, a signal), the blocks
still queued are dropped rather than written: the run is failing and its temp folder goes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bema_cli import stages
from bema_cli.io.transfer import wait

DEPTH = 4  # buffers per dtype in flight: one being filled, up to three queued or being written
# Every wait between the two threads is bounded and re-checks its condition: a signal's exception
# raised in the main thread inside a queue operation (Ctrl-C lands anywhere) can lose a wake-up,
# which an unbounded wait turned into a hang at exit (seen once in a SIGINT test). The job queue is
# a SimpleQueue, whose `put` is one C call a signal cannot split: `Queue.put` interrupted between
# queuing a job and counting it made the writer's `task_done` raise (seen once in CI, SIGTERM).
POLL_S = 0.5


class WriteBehind:
    """A pool of block buffers and one writer thread; a context manager (`close` on exit)."""

    def __init__(self, block: int, depth: int = DEPTH, background: bool = True, empty=None):
        """`background` False: `put` writes at once in the caller's thread (two buffers per dtype: one
        filled, one being cast from it). `empty(n, dtype)` allocates the pool (io/transfer.py's
        `host_empty`: pinned when a GPU copies into it)."""
        self.block, self.depth = block, depth if background else 2
        self._empty = empty
        self._free: dict = {}  # torch dtype -> queue of free buffers (each `block` elements)
        self._all: dict = {}  # torch dtype -> every buffer of the pool
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # jobs, drain barriers (Events), None: end
        self._error: BaseException | None = None
        # Jobs are numbered as queued; those numbered up to `_drop_through` are dropped (their batch
        # failed). A number, not an on/off flag reset after the drop: a second signal landing in the
        # middle of a drop cannot leave the next batch's blocks dropped too.
        self._queued = 0
        self._drop_through = 0
        self._thread = None
        # seconds the caller stood still: for a free buffer (the stage `wait`), or writing (no thread)
        self.waited = 0.0
        if background:
            self._thread = threading.Thread(target=self._run, name="bema-write-behind", daemon=True)
            self._thread.start()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_error=exc_type is None)

    @contextmanager
    def batch(self) -> Iterator[WriteBehind]:
        """Everything put inside is written when the block exits normally (errors raised here);
        dropped when it exits with an exception. The pool and the thread stay for the next batch."""
        try:
            yield self
        except BaseException:
            self._drain(drop=True)
            raise
        self._drain(drop=False)

    def buffer(self, dtype, n: int):
        """A free buffer of `n` <= block elements of `dtype` (waits for the writer to free one)."""
        import torch

        self._raise()
        free = self._free.get(dtype)
        if free is None:  # the pool is registered whole, once built: an interrupt cannot leave it empty
            empty = self._empty or (lambda n, d: torch.empty(n, dtype=d))
            pool, free = [empty(self.block, dtype) for _ in range(self.depth)], queue.SimpleQueue()
            for b in pool:
                free.put(b)
            self._all[dtype], self._free[dtype] = pool, free
        try:
            return free.get_nowait()[:n]
        except queue.Empty:
            pass
        t = time.perf_counter()
        while True:
            try:
                got = free.get(timeout=0.5)[:n]
                waited = time.perf_counter() - t
                self.waited += waited
                stages.add("wait", waited)
                return got
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

    def call(self, fn: Callable[[], None], on_drop: Callable[[], None] | None = None) -> None:
        """Run `fn()` in the writer's thread after everything queued before it (a file's close after
        its blocks); where the queue is dropped (the caller failed), `on_drop()` instead. Never
        raises here: an earlier write error surfaces at the next `buffer`, `put` or batch end."""
        self._queue((None, [lambda _: fn()], "write", None, on_drop))

    def put(self, data, writes: list[Callable[[object], None]], stage: str = "write", ready=None) -> None:
        """Queue `data` (a buffer from `buffer`); the writer calls each of `writes` with it, then frees
        it. Its time and bytes count under `stage` (`write`: the outputs; `state`: a state folder's).
        `ready`: the event of the device copy still filling `data` (io/transfer.py), waited for first."""
        self._raise()
        self._queue((data, writes, stage, ready, None))
        if self._thread is None:
            self._raise()

    def close(self, raise_error: bool = True) -> None:
        """Write (or, after an error, drop) what is queued and end the thread; re-raise a write error."""
        self._drain(drop=not raise_error)
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            while self._thread.is_alive():
                self._thread.join(timeout=POLL_S)

    def _drain(self, drop: bool) -> None:
        """Wait until the queue is empty (its blocks written, or dropped with `drop`); re-raise a write
        error unless dropping."""
        if drop:
            self._drop_through = self._queued
        if self._thread is not None and self._thread.is_alive():
            reached = threading.Event()  # set by the writer once every job queued before it is done
            self._jobs.put(reached)
            while not reached.wait(timeout=POLL_S) and self._thread.is_alive():
                pass
        error, self._error = self._error, None
        if error is not None and not drop:
            raise error

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._drop_through = self._queued  # what is still queued belongs to the failed batch
            raise error

    def _queue(self, job) -> None:
        self._queued += 1
        if self._thread is None:
            self._write((self._queued, *job))
        else:
            self._jobs.put((self._queued, *job))

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
            else:
                self._write(job)

    def _write(self, job) -> None:
        number, data, writes, stage, ready, on_drop = job
        try:
            wait(ready)  # even when dropping: the buffer goes back to the pool only once it is filled
            drop = number <= self._drop_through or self._error is not None
            if drop and on_drop is not None:
                on_drop()
            elif not drop:
                t, nbytes = time.perf_counter(), 0
                for write in writes:
                    nbytes += write(data) or 0
                seconds = time.perf_counter() - t
                stages.add(stage, seconds, nbytes)
                if self._thread is None:  # written in the caller's thread: not its compute time
                    self.waited += seconds
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc
        finally:
            if data is not None:
                self._free[data.dtype].put(data._base)
