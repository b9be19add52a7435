"""Follow a training run's output folder: which checkpoints are complete, waiting for new ones.

A trainer writes a checkpoint folder file by file, so its mere existence says nothing, and a
weight file can be created at full size and filled afterwards, so neither does its size.
Complete means (the rule `bema stabilize --follow` reads by; docs/design.md, "Follow mode"):

1. `trainer_state.json` is present and was modified no earlier than every weight file (the HF
   Trainer writes it after the weights, optimizer and scheduler of the step): complete at once.
2. Otherwise (no marker: a PEFT adapter run, a .bin or DCP run saved by a script; or a marker
   older than the weights: written first, or copied before them): every weight file of any
   format is there, every safetensors file's size equals what its own header declares, and the
   files' content (an xxh3 digest) and their sizes and modification times stayed the same across
   a settle interval (`--settle`, default max(5 s, 2 x --poll)) after two equal polls. A file
   created at full size and filled later changes its content within that interval, unless its
   writer pauses longer than it: only the marker rules that out.

The engine then re-checks the files it holds open after reading them (`check_unchanged`): a file
whose size or mtime moved while it was read is refused, so a writer that resumed after a pause
is caught before anything is committed.

Waiting sleeps between polls (no busy loop): an idle follower costs no CPU.
Checkpoints deleted by `save_total_limit` rotation are held open by `hold_files` once their
step is being read (Linux reopens a deleted file through /proc/self/fd).
"""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import is_regular, layout_of, step_of

TRAINER_STATE = "trainer_state.json"


def declared_size(path: Path) -> int | None:
    """File size a safetensors header promises (8 + header + data), or None if the header is not readable yet."""
    import json

    try:
        if not is_regular(path):
            return None
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return None
            (n,) = struct.unpack("<Q", prefix)
            if n > 100 * 1024 * 1024:
                return None
            header = json.loads(f.read(n))
        end = max(
            (e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"),
            default=0,
        )
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return 8 + n + int(end)


def _weight_files(folder: Path) -> list[Path] | None:
    """The weight files a folder will hold, or None while that is not known yet (no index, no file)."""
    from bema_cli.io.checkpoints import model_weight_files

    try:
        return model_weight_files(folder)
    except InputError:  # an index listing a shard not written yet, or no weights yet
        return None


Stats = dict[str, tuple[int, int]]  # weight file name -> (size, mtime_ns)

# Weight files of any format (safetensors, .bin, DCP shards and metadata, adapters): what
# trainer_state.json must not be older than.
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.distcp", ".metadata", "*/*.distcp", "*/.metadata")


def sizes_complete(folder: Path) -> Stats | None:
    """{file name: (size, mtime_ns)} of every weight file (any format) when each safetensors file's size
    equals its header's promise; else None (no weights yet, or not written yet)."""
    from bema_cli.io.fingerprint import weight_files

    try:
        files = weight_files(folder)
    except Exception:  # a DCP or .bin folder half written: not readable yet
        return None
    if not files:
        return None
    stats = {}
    for path in files:
        try:
            st = path.stat()
        except OSError:
            return None
        if path.suffix == ".safetensors" and declared_size(path) != st.st_size:
            return None
        stats[path.name] = (st.st_size, st.st_mtime_ns)
    return stats


def content_digest(folder: Path, stats: Stats) -> str | None:
    """One xxh3 digest over the weight files named in `stats` (None when one cannot be read)."""
    from bema_cli.io.fingerprint import file_digest

    try:
        return "/".join(file_digest(folder / name) for name in sorted(stats))
    except OSError:
        return None


def signalled(folder: Path) -> bool:
    """Whether trainer_state.json is there and no weight file was modified after it (HF Trainer order)."""
    state = folder / TRAINER_STATE
    if not is_regular(state):
        return False
    try:
        written = state.stat().st_mtime_ns
        weights = [p.stat().st_mtime_ns for g in WEIGHT_GLOBS for p in folder.glob(g) if is_regular(p)]
    except OSError:  # a file removed or replaced under us: look again at the next poll
        return False
    return max(weights, default=0) <= written  # no weights yet: the round says what is missing


SETTLE_FLOOR = 5.0  # seconds: a marker-less checkpoint's content must hold this long at least


@dataclass
class Watcher:
    """Polls a run folder; `complete()` returns the steps whose checkpoint folder is complete.

    A folder with a trainer_state.json no older than its weights counts at once; others once two
    consecutive polls saw the same complete sizes and modification times and, `settle` seconds
    later, the same content digest too; after that it stays complete, without being read again,
    while its sizes and modification times stay as they settled (an idle follower hashed every
    checkpoint of the run at every poll). `seen` keeps every step ever listed, so a checkpoint that
    vanished before it was read can be told apart from one that never existed.
    """

    run_dir: Path
    settle: float = SETTLE_FLOOR
    clock: Callable[[], float] = time.monotonic
    _sizes: dict[int, Stats] = field(default_factory=dict)
    _settling: dict[int, tuple[Stats, str, float]] = field(default_factory=dict)  # stats, digest, since
    _settled_at: dict[int, Stats] = field(default_factory=dict)  # the stats a step settled at
    seen: dict[int, Path] = field(default_factory=dict)

    def scan(self) -> dict[int, Path]:
        """step -> folder of every checkpoint folder present now (complete or not)."""
        found = {}
        try:
            entries = list(os.scandir(self.run_dir))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise InputError(f"{self.run_dir}: cannot list ({exc.strerror or exc})") from None
        for entry in entries:
            if not layout_of(entry.name) or not entry.is_dir():  # every layout `find_checkpoints` reads
                continue
            try:
                step = step_of(Path(entry.path))
            except InputError:
                continue  # a trainer_state.json being written: not complete anyway
            if step is not None:
                found[step] = Path(entry.path)
        self.seen.update(found)
        return found

    def complete(self) -> dict[int, Path]:
        """step -> folder of the checkpoints that are complete now (one poll)."""
        done = {}
        present = self.scan()
        for step, folder in present.items():
            sizes = sizes_complete(folder)
            if signalled(folder) and (sizes is not None or _weight_files(folder) is None):
                done[step] = folder  # (safetensors: the sizes must match the headers too)
                continue
            if sizes is not None and self._settled_at.get(step) == sizes:
                done[step] = folder  # settled at an earlier poll, untouched since
            elif sizes is not None and self._sizes.get(step) == sizes and self._settled(step, folder, sizes):
                done[step] = folder
                self._settled_at[step] = sizes
            if sizes is None:
                self._sizes.pop(step, None)
                self._settled_at.pop(step, None)
            else:
                self._sizes[step] = sizes
        for step in list(self._sizes):
            if step not in present:
                del self._sizes[step]
                self._settling.pop(step, None)
                self._settled_at.pop(step, None)
        return done

    def _settled(self, step: int, folder: Path, sizes: Stats) -> bool:
        """The content held still for `settle` seconds (first call for these stats: the clock starts)."""
        now = self.clock()
        started = self._settling.get(step)
        if started is None or started[0] != sizes:
            digest = content_digest(folder, sizes)
            if digest is not None:
                self._settling[step] = (sizes, digest, now)
            return False
        if now - started[2] < self.settle:
            return False
        same = content_digest(folder, sizes) == started[1] and sizes_complete(folder) == sizes
        if not same:
            self._settling.pop(step, None)
        return same


@dataclass(frozen=True)
class Pace:
    """How a follower waits (--poll, --until-step, --idle-timeout, --settle): `stabilize --follow` and
    `sweep --follow` alike."""

    poll: float = 2.0  # seconds between looks at the run folder
    until_step: int | None = None  # stop once this step is processed
    idle_timeout: float | None = None  # stop after this many seconds without a new checkpoint
    settle: float | None = None  # seconds a marker-less checkpoint must hold still (None: max(5, 2 x poll))

    def watcher(self, folder: str | Path) -> Watcher:
        settle = max(SETTLE_FLOOR, 2 * self.poll) if self.settle is None else self.settle
        return Watcher(Path(folder).expanduser(), settle=settle)


def wait_for(poll: Callable[[], bool], interval: float, timeout: float | None, sleep=time.sleep) -> bool:
    """Call `poll` every `interval` seconds until it returns True (-> True) or `timeout` passes (-> False).

    Sleeps between polls, so waiting costs no CPU; a signal handler that raises interrupts the sleep.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if poll():
            return True
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sleep(min(interval, left))
        else:
            sleep(interval)


def hold_files(paths: list[Path]) -> tuple[dict[Path, Path], list[int]]:
    """Open every file now; map each path to a path that reaches the same file even once deleted.

    On Linux that is /proc/self/fd/<fd> (reopening it reaches the inode, deleted or not), so a
    checkpoint rotated away by the trainer mid-read is still read whole. Elsewhere the original
    paths are returned (no protection). Close the fds with `release`. Raises FileNotFoundError
    for a file already gone.
    """
    fds: list[int] = []
    mapping: dict[Path, Path] = {}
    proc = Path("/proc/self/fd")
    usable = sys.platform.startswith("linux") and proc.is_dir()
    try:
        for path in paths:
            if not is_regular(path):  # a FIFO would block this open forever
                raise FileNotFoundError(2, "No such file or directory", str(path))
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            mapping[path] = proc / str(fd) if usable else path
    except BaseException:
        release(fds)
        raise
    return mapping, fds


def held_stats(fds: list[int]) -> list[tuple[int, int]]:
    """(size, mtime_ns) of each held file, taken through its handle (the file read, even if renamed)."""
    return [(st.st_size, st.st_mtime_ns) for st in map(os.fstat, fds)]


def check_unchanged(paths: list[Path], fds: list[int], before: list[tuple[int, int]]) -> None:
    """Refuse, naming the file, a held file whose size or mtime moved since `before` (taken before it
    was read): it was being written while read, so what was read is not one consistent checkpoint."""
    for path, now, then in zip(paths, held_stats(fds), before, strict=True):
        if now != then:
            raise InputError(
                f"{path}: changed while it was being read (still being written?); nothing was committed"
            )


def release(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
