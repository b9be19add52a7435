"""The write-behind thread (io/write_behind.py): errors surface in the caller, a failing batch drops
its queue, and a signal landing anywhere in the caller's side leaves the writer sound."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import pytest
import torch

from bema_cli.io.write_behind import WriteBehind


def test_write_behind_raises_a_write_error_in_the_caller_and_drops_the_rest(tmp_path):
    from bema_cli.errors import OutputError
    from bema_cli.io.write_behind import WriteBehind

    written = []

    def fail(data):
        raise OutputError(f"{tmp_path / 'x'}: cannot write (No space left on device)")

    with pytest.raises(OutputError, match="No space left"), WriteBehind(16, depth=2) as wb:
        for i in range(20):  # the error surfaces at a later buffer/put or at close, never lost
            data = wb.buffer(torch.float32, 16).fill_(i)
            wb.put(data, [fail] if i == 3 else [lambda d: written.append(float(d[0]))])
    assert 3.0 not in written and written == sorted(written)
    assert len(wb._all[torch.float32]) == 2  # the pool never grew past its depth

    seen = []
    with pytest.raises(KeyboardInterrupt), WriteBehind(16, depth=2) as wb:  # the caller fails: queue dropped
        wb.put(wb.buffer(torch.float32, 16), [lambda d: seen.append(1) or time.sleep(0.2)])
        wb.put(wb.buffer(torch.float32, 16), [lambda d: seen.append(2)])
        raise KeyboardInterrupt
    assert 2 not in seen and not wb._thread.is_alive()

    # batches share one pool and thread: a failed batch drops its queue, the next one writes normally
    with WriteBehind(16, depth=2) as wb:
        with pytest.raises(OutputError), wb.batch():
            wb.put(wb.buffer(torch.float32, 16), [fail])
            for _ in range(3):  # the error surfaces here or at the end of the batch
                wb.put(wb.buffer(torch.float32, 16), [lambda d: seen.append(3)])
        got = []
        with wb.batch():
            for i in range(5):
                wb.put(wb.buffer(torch.float32, 16).fill_(i), [lambda d: got.append(float(d[0]))])
        assert got == [0.0, 1.0, 2.0, 3.0, 4.0] and 3 not in seen
        assert wb._thread.is_alive()
    assert not wb._thread.is_alive()


def test_a_call_runs_after_the_blocks_queued_before_it_or_its_drop_path_after_a_failure():
    """The engine's file closes go through `call`: in order with the blocks (a file closes after its
    writes), and where the batch fails the close still runs, unflushed (`on_drop`), never skipped."""
    from bema_cli.io.write_behind import WriteBehind

    order = []
    with WriteBehind(16, depth=2) as wb:
        with wb.batch():
            for i in range(4):
                wb.put(wb.buffer(torch.float32, 16), [lambda d, i=i: time.sleep(0.02) or order.append(i)])
                wb.call(lambda i=i: order.append(f"close {i}"), on_drop=lambda: order.append("dropped"))
        assert order == [0, "close 0", 1, "close 1", 2, "close 2", 3, "close 3"]
        order.clear()
        with pytest.raises(KeyboardInterrupt), wb.batch():
            wb.put(wb.buffer(torch.float32, 16), [lambda d: time.sleep(0.2) or order.append("slow")])
            wb.put(wb.buffer(torch.float32, 16), [lambda d: order.append("queued")])
            wb.call(lambda: order.append("close"), on_drop=lambda: order.append("closed unflushed"))
            raise KeyboardInterrupt
        assert order[-1] == "closed unflushed" and "queued" not in order and "close" not in order


@pytest.mark.timeout(120)  # a lost buffer or wake-up shows as a hang: fail it here
def test_an_interrupt_on_any_line_of_the_callers_side_leaves_the_writer_sound():
    """A signal's exception (SIGTERM, Ctrl-C) lands between any two lines the main thread runs.
    Wherever it lands in `buffer`, `put`, `call` or a batch's end (write_behind.py, and queue.py
    under it), the writer thread raises nothing, the caller sees only the interrupt, and the next
    batch writes all its blocks. `Queue.put` split between queuing a job and counting it made the
    writer's `task_done` raise "called too many times" (CI, a SIGTERM test)."""
    watched = ("write_behind.py", "queue.py")
    thread_errors = []
    hook, threading.excepthook = threading.excepthook, lambda args: thread_errors.append(args.exc_value)
    landed_on = 0
    try:
        for k in range(1, 10_000):
            lines = 0

            def tracer(frame, event, arg, k=k):
                nonlocal lines
                if not frame.f_code.co_filename.endswith(watched):
                    return None
                if event == "line":
                    lines += 1
                    if lines == k:
                        raise KeyboardInterrupt
                return tracer

            with WriteBehind(16, depth=3) as wb:
                with contextlib.suppress(KeyboardInterrupt):
                    sys.settrace(tracer)
                    try:
                        with wb.batch():
                            for _ in range(2):
                                wb.put(wb.buffer(torch.float32, 16), [lambda d: None])
                                wb.call(lambda: None, on_drop=lambda: None)
                    finally:
                        sys.settrace(None)
                got = []
                with wb.batch():
                    for i in range(4):
                        wb.put(
                            wb.buffer(torch.float32, 16).fill_(i),
                            [lambda d, got=got: got.append(float(d[0]))],
                        )
                assert got == [0.0, 1.0, 2.0, 3.0], f"interrupted at watched line {k}"
            assert not wb._thread.is_alive() and thread_errors == [], f"interrupted at watched line {k}"
            if lines < k:  # every line was tried
                break
            landed_on += 1
    finally:
        threading.excepthook = hook
    assert landed_on > 20  # the sweep reached into put, call and the drain, not just the first lines
