"""A signal that arrives while another thread holds `signals.deferred()` ends the run, after that
thread's block: raised in the thread that deferred it, it ended that thread alone and the run went on
to exit 0 (a SIGTERM 2.8 s into a ship was ignored so)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SNIPPET = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from bema_cli import signals
    signals.install()
    done = []
    def worker():
        with signals.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)
            done.append("block")  # the block runs to its end: a commit's renames are never cut
        time.sleep(0.3)
        done.append("thread")
    t = threading.Thread(target=worker, daemon=True)
    try:
        t.start()
        t.join()
        time.sleep(5)
        print("ran on")
        sys.exit(0)
    except signals.Terminated as exc:
        print(",".join(done))
        sys.exit(128 + exc.signum)
    """
)


def test_a_signal_deferred_in_another_thread_ends_the_run_after_its_block():
    r = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, timeout=60)
    assert r.returncode == 143, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "block", r.stdout  # after the block, not after the thread's later work
    assert "Traceback" not in r.stderr, r.stderr


def test_a_signal_in_the_main_threads_own_block_waits_for_its_end():
    snippet = textwrap.dedent(
        """
        import os, signal, sys
        from bema_cli import signals
        signals.install()
        steps = []
        try:
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                steps.append("rest of the block")
            steps.append("after")
        except signals.Terminated as exc:
            print(",".join(steps))
            sys.exit(128 + exc.signum)
        """
    )
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60)
    assert r.returncode == 143 and r.stdout.strip() == "rest of the block", (r.returncode, r.stdout, r.stderr)
