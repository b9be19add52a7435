"""Where a run's time goes: seconds and bytes per stage, in every --json document (`stages`) and
in one summary line on stderr.

One collector per process, reset by each command. A stage is timed in the thread doing the
work; the write-behind thread's `write` overlaps `compute`, so stages can sum to more than the
wall time (`wait` is the time the compute thread stood still for a free write buffer).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_seconds: dict[str, float] = {}
_bytes: dict[str, int] = {}
_count: dict[str, int] = {}  # how many times each stage ran (ship's swaps: stages.swap.count)


def reset() -> None:
    with _lock:
        _seconds.clear()
        _bytes.clear()
        _count.clear()


def add(name: str, seconds: float, nbytes: int = 0) -> None:
    with _lock:
        _seconds[name] = _seconds.get(name, 0.0) + seconds
        _bytes[name] = _bytes.get(name, 0) + nbytes
        _count[name] = _count.get(name, 0) + 1


@contextmanager
def stage(name: str, nbytes: int = 0) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - t, nbytes)


def report() -> dict:
    """{stage: {"seconds", "bytes", "gb_per_s", "count"}} in the order the stages first ran."""
    with _lock:
        return {
            name: {
                "seconds": round(s, 4),
                "bytes": _bytes[name],
                "gb_per_s": round(_bytes[name] / s / 1e9, 3) if _bytes[name] and s > 0 else None,
                "count": _count[name],
            }
            for name, s in _seconds.items()
        }


def line(stages: dict) -> str:
    """The human summary's one line: 'stages: read 4.1 s (1.21 GB/s), compute 2.0 s, ...'."""
    parts = []
    for name, s in stages.items():
        rate = f" ({s['gb_per_s']:.2f} GB/s)" if s["gb_per_s"] else ""
        parts.append(f"{name} {s['seconds']:.1f} s{rate}")
    return "stages: " + ", ".join(parts) if parts else ""
