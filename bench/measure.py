"""Timing, peak RSS and page-cache control for the benchmark; no bema knowledge here.

Peak RSS is what `/usr/bin/time -v` reports as "Maximum resident set size": the
kernel's ru_maxrss, which counts file pages a process has mapped and touched
(safetensors memory-maps its inputs), not only its heap.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

READ_CHUNK = 8 * 2**20  # bytes per read()/write() call of the I/O floor


@dataclass
class Run:
    seconds: float  # wall clock, process start to exit (interpreter start-up included)
    max_rss: int  # bytes
    stdout: str
    stderr: str


def run_measured(cmd: list[str], env: dict | None = None) -> Run:
    """Run cmd under /usr/bin/time -v; wall time and peak RSS. Raises with the tool's stderr tail on failure."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *map(str, cmd)], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-30:])
        raise RuntimeError(f"command failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    rss = re.findall(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return Run(seconds, int(rss[-1]) * 1024, proc.stdout, proc.stderr)


def read_files(paths: list[Path]) -> float:
    """Read every byte of every file once into a user buffer (what `cat > /dev/null` does); seconds."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - t0


def write_files(sizes: dict[Path, int]) -> float:
    """Plain sequential write of sizes[path] bytes to each path (no fsync, like the tools); seconds."""
    block = os.urandom(READ_CHUNK)
    t0 = time.perf_counter()
    for path, size in sizes.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb", buffering=0) as f:
            left = size
            while left > 0:
                left -= f.write(block[: min(left, READ_CHUNK)])
    return time.perf_counter() - t0


def write_files_direct(sizes: dict[Path, int]) -> float:
    """Sequential O_DIRECT writes of sizes[path] bytes to each path (8 MB aligned chunks, as bema's
    writer), so every byte reaches the disk before the call returns; seconds. Falls back to plain
    writes plus an fsync where O_DIRECT is refused."""
    import mmap

    block = mmap.mmap(-1, READ_CHUNK)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(READ_CHUNK))
    t0 = time.perf_counter()
    for path, size in sizes.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            direct = True
        except OSError:
            fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), False
        try:
            for _ in range(size // READ_CHUNK):
                os.write(fd, block)
            if not direct:
                os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def set_cache(paths: list[Path], state: str) -> None:
    """Put the inputs in a known page-cache state before a measurement: 'warm' (all read once) or 'cold'.

    Flushes dirty pages first so earlier runs' write-back does not land in the next timing.
    'cold' drops just these files' pages (posix_fadvise DONTNEED, no root, other users' cache untouched);
    a hypervisor may still cache the virtual disk underneath.
    """
    os.sync()
    if state == "warm":
        read_files(paths)
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def machine() -> dict:
    """What a benchmark's header says about where it ran."""
    import platform

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "mem_gib": round(mem / 2**30, 1),
    }


def common_args(ap, size_mb: float, checkpoints: int) -> None:
    """The flags every trajectory benchmark takes (its own defaults for the sizes)."""
    from pathlib import Path

    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes, 1 repeat: a smoke run (numbers mean nothing)"
    )
    ap.add_argument("--size-mb", type=float, default=size_mb, help="one checkpoint's bytes, in MB")
    ap.add_argument("--checkpoints", type=int, default=checkpoints)
    ap.add_argument("--max-memory", default="512MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch parent (default: $TMPDIR or /tmp)")
    ap.add_argument("--json", action="store_true", help="raw numbers on stdout (table on stderr)")


def report(table: str, doc: dict, as_json: bool) -> None:
    """The table on stdout; with --json the raw numbers as one JSON document on stdout, the table on stderr."""
    print(table, file=sys.stderr if as_json else sys.stdout, flush=True)
    if as_json:
        print(json.dumps(doc, indent=2))


def tensor_bytes(path: Path) -> bytes:
    """A safetensors file's tensors and their layout, without the header's __metadata__: what two runs
    over inputs at other paths (or in other formats) share bitwise (the metadata carries each
    output's provenance, its inputs' paths included)."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return json.dumps(header, sort_keys=True).encode() + raw[8 + n :]
