"""What this machine has and what bema's processes hold: memory available now, and the peak RSS of
bema together with the engine processes it starts (vLLM's engine core and workers run apart)."""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping), else physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (/proc/<pid>/stat's 4th field, after the parenthesised name)."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
                out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def descendants(root: int) -> set[int]:
    """Every process below `root` (its children, theirs, ...), from /proc."""
    parents = _parents()
    tree, frontier = set(), [root]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier and p not in tree and p != root]
        tree.update(kids)
        frontier = kids
    return tree


class PeakRss:
    """A thread sampling, every `every` seconds while a command runs, the summed RSS of the processes
    below this one (vLLM's engine core and workers). `parts()`: this process's own peak (ru_maxrss,
    exact), the engine processes' sampled peak, and their sum: an upper bound of the peak the
    machine saw (the two peaks need not coincide), the number `--max-memory` must cover."""

    def __init__(self, every: float = 0.25):
        self.every, self.most = every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bema-peak-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            try:  # RSS summed: pages two processes share (libraries) count in each, an upper bound
                self.most = max(self.most, sum(_rss(p) for p in descendants(os.getpid())))
            except OSError:  # a process ended while it was read: the next sample counts it out
                pass
            if self._stop.wait(self.every):
                return

    def parts(self) -> dict:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"peak_rss": own + self.most, "peak_rss_bema": own, "peak_rss_engine": self.most}
