"""Follow a training run's output folder: which checkpoints are complete, waiting for new ones.

A trainer writes a checkpoint folder file by file, so its mere existence says nothing.
Complete means (the rule `bema stabilize --follow` reads by):

1. `trainer_state.json` is present: the HF Trainer writes it after the weights, optimizer,
   scheduler and RNG files of the step; or, for layouts without it,
2. every weight file's size equals what its own safetensors header declares, and no size
   changed between two polls (a file being copied is not mistaken for a finished one).

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
from bema_cli.io.checkpoints import step_of

TRAINER_STATE = "trainer_state.json"


def declared_size(path: Path) -> int | None:
    """File size a safetensors header promises (8 + header + data), or None if the header is not readable yet."""
    import json

    try:
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


def sizes_complete(folder: Path) -> dict[str, int] | None:
    """{file name: size} when every weight file's size equals its header's promise; else None."""
    files = _weight_files(folder)
    if not files:
        return None
    sizes = {}
    for path in files:
        try:
            size = path.stat().st_size
        except OSError:
            return None
        if declared_size(path) != size:
            return None
        sizes[path.name] = size
    return sizes


@dataclass
class Watcher:
    """Polls a run folder; `complete()` returns the steps whose checkpoint folder is complete.

    Folders without trainer_state.json count only once two consecutive polls saw the same
    complete sizes. `seen` keeps every step ever listed, so a checkpoint that vanished before it
    was read can be told apart from one that never existed.
    """

    run_dir: Path
    _sizes: dict[int, dict[str, int]] = field(default_factory=dict)
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
            if not entry.name.startswith("checkpoint-") or not entry.is_dir():
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
            if (folder / TRAINER_STATE).is_file():
                done[step] = folder
                continue
            sizes = sizes_complete(folder)
            if sizes is not None and self._sizes.get(step) == sizes:
                done[step] = folder
            if sizes is None:
                self._sizes.pop(step, None)
            else:
                self._sizes[step] = sizes
        for step in list(self._sizes):
            if step not in present:
                del self._sizes[step]
        return done


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
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            mapping[path] = proc / str(fd) if usable else path
    except BaseException:
        release(fds)
        raise
    return mapping, fds


def release(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
