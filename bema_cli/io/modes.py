"""Temp files that become the user's files keep the user's permissions.

`tempfile.mkstemp` creates its file 0600 (private: right for a temp file), and a rename keeps the
mode, so a results file or a plot written through it stayed unreadable to the user's group, where
a plain `open(..., "w")` gives 0666 less the umask. `mkstemp` here is the same call with that mode.
"""

from __future__ import annotations

import os
import tempfile
import threading

_lock = threading.Lock()


def umask() -> int:
    """The process's umask (read by setting it, so under a lock: threads write files too)."""
    with _lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def mkstemp(dir: str | os.PathLike, prefix: str, suffix: str = "") -> tuple[int, str]:
    """tempfile.mkstemp, with the mode a plain open() would have given the final file."""
    fd, path = tempfile.mkstemp(dir=dir, prefix=prefix, suffix=suffix)
    os.fchmod(fd, 0o666 & ~umask())
    return fd, path
