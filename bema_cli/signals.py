"""SIGINT, SIGTERM and SIGHUP all end a run the same way: an exception that unwinds through the
cleanup code (temp folders removed, locks released), then exit 130, 143 or 129 (128 + signal).

SLURM and Kubernetes stop jobs with SIGTERM, a closed terminal sends SIGHUP; without a
handler Python dies on the spot and leaves its temp folders behind. `deferred()` holds a
signal back for a few milliseconds while the output commit renames folders (io/commit.py). The
handler runs in the main thread, and only there can its exception end the run: a block held by
another thread is waited for (its renames finish), then the main thread raises. (Raised at the end
of that thread's block, it ended that thread alone and the run went on to exit 0.)
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
OTHERS_WAIT_S = 30.0  # the longest the main thread waits for other threads' deferred blocks
_deferring: dict[int, int] = {}  # thread ident -> depth of its deferred() blocks
_quiet = threading.Condition(
    threading.RLock()
)  # reentrant: the handler may run inside deferred()'s bookkeeping
_pending: int | None = None  # a signal the main thread's own block holds
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
    if _deferring.get(threading.get_ident()):  # the main thread's own block: at its end
        _pending = signum
        return
    with _quiet:  # another thread's block (a commit's renames): let it finish, then end the run here
        _quiet.wait_for(lambda: not _deferring, timeout=OTHERS_WAIT_S)
    _raise(signum)


def install() -> None:
    """Route SIGINT/SIGTERM/SIGHUP to exceptions (main thread only; the CLI calls it once)."""
    for sig in HANDLED:
        signal.signal(sig, _handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends, then act on the last one that arrived (in the
    main thread: a block in another thread delays the main thread's exception until it ends)."""
    global _pending
    me = threading.get_ident()
    with _quiet:
        _deferring[me] = _deferring.get(me, 0) + 1
    try:
        yield
    finally:
        with _quiet:
            _deferring[me] -= 1
            if not _deferring[me]:
                del _deferring[me]
            _quiet.notify_all()
        if me not in _deferring and _pending is not None:
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
