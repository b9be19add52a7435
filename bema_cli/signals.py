"""SIGINT, SIGTERM and SIGHUP all end a run the same way: an exception that unwinds through the
cleanup code (temp folders removed, locks released), then exit 130, 143 or 129 (128 + signal).

SLURM and Kubernetes stop jobs with SIGTERM, a closed terminal sends SIGHUP; without a
handler Python dies on the spot and leaves its temp folders behind. `deferred()` holds a
signal back for a few milliseconds while the output commit renames folders (io/commit.py).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_deferring = 0
_pending: int | None = None
_received: int | None = None  # the signal that ended the run, once its exception is raised


class Terminated(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived. A BaseException, like KeyboardInterrupt, so `except Exception`
    misses it; unlike KeyboardInterrupt, no library (typer included) swallows it on the way up."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int) -> None:
    global _received
    _received = signum
    raise Terminated(signum)


def received() -> int | None:
    """The signal whose exception was raised, if any. Raised while C code (torch, safetensors) is
    calling back into Python, that exception can surface as another one (a ValueError from torch's
    tensor constructor, say): the CLI asks here instead of trusting the exception's type."""
    return _received


def _handler(signum: int, frame) -> None:
    global _pending
    if _deferring:
        _pending = signum
        return
    _raise(signum)


def install() -> None:
    """Route SIGINT/SIGTERM/SIGHUP to exceptions (main thread only; the CLI calls it once)."""
    for sig in HANDLED:
        signal.signal(sig, _handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends, then act on the last one that arrived."""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending is not None:
            signum, _pending = _pending, None
            _raise(signum)


@contextmanager
def kept() -> Iterator[None]:
    """Put back our SIGINT/SIGTERM/SIGHUP handlers after the block: `ray.init` replaces SIGTERM's with
    one that calls sys.exit(15), which would end a run with exit 15 and a traceback instead of 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in HANDLED}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
