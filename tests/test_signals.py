"""A signal that arrives while another thread holds `signals.deferred()` ends the run: raised in the
thread that deferred it, it ended that thread alone and the run went on to exit 0 (a SIGTERM 2.8 s
into a ship was ignored so)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SNIPPET = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from bema_cli import signals
    signals.install()
    def worker():
        with signals.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
    t = threading.Thread(target=worker)
    t.start()
    try:
        t.join()
        time.sleep(5)
        sys.exit(0)
    except signals.Terminated as exc:
        sys.exit(128 + exc.signum)
    """
)


def test_a_signal_deferred_in_another_thread_ends_the_run():
    r = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, timeout=60)
    assert r.returncode == 143, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
