"""`bema` processes forked from one that has already imported torch, transformers and bema_cli.

Each `bema` subprocess of the suite paid ~2 s (more under load) importing torch and transformers
before it did anything; a few hundred of them were most of `make test`'s time. The zygote imports
them once per test process; each call forks it, and the child is a real process of its own (its
pid, cwd, file descriptors, signal handlers, exit code, atexit) running `bema_cli.cli.main` as the
console script does, with stdout and stderr in files. Its module state is the state just after
import: nothing ran in the zygote. What the fork cannot give is used from a real subprocess
(`conftest.run_bema` decides): another environment (read at import by huggingface_hub and vLLM),
or a call while another is running.

The protocol on the zygote's stdin/stdout: one JSON request a line ({"args", "cwd", "stdout",
"stderr"}), answered by {"pid"} when forked and {"code"} when the child has exited.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

CHILD = r"""
import atexit, json, os, signal, sys, threading, traceback
import torch, transformers, safetensors.torch, numpy  # the imports every `bema` process pays
import transformers.modeling_utils, huggingface_hub
import bema_cli.cli
if threading.active_count() != 1:  # a thread would not survive the fork: say so, serve nothing
    sys.stdout.write(json.dumps({"threads": threading.active_count()}) + "\n")
    sys.stdout.flush()
    sys.exit(0)
sys.stdout.write(json.dumps({"ready": True}) + "\n")
sys.stdout.flush()
ctl = sys.stdout.buffer
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
            os.chdir(req["cwd"])
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.argv = [req["argv0"], *req["args"]]
            try:
                bema_cli.cli.main()
                code = 0
            except SystemExit as exc:
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
        finally:
            os._exit(code)
    ctl.write((json.dumps({"pid": pid}) + "\n").encode())
    ctl.flush()
    _, status = os.waitpid(pid, 0)
    ctl.write((json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    ctl.flush()
"""


def _environ() -> dict:
    """The environment a call runs under, less what pytest itself sets per test (PYTEST_CURRENT_TEST:
    no bema code reads it)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


class Zygote:
    def __init__(self, bema: Path):
        self.bema, self.lock, self.proc = str(bema), threading.Lock(), None
        self.environ: dict | None = None
        self.broken, self.pending = False, b""

    def _start(self) -> bool:
        self.environ = _environ()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )  # fmt: skip
        self.pending = b""
        try:
            ok = json.loads(self._line(300)).get("ready") is True
        except (subprocess.TimeoutExpired, RuntimeError, ValueError):
            ok = False
        if not ok:
            self.close()
            self.broken = True
        return ok

    def usable(self) -> bool:
        """Only a call in the environment the zygote imported under (huggingface_hub, vLLM and rich
        read theirs at import): another environment (a test's own, or one an in-process vLLM set at
        import: LD_PRELOAD and more, which a subprocess would inherit too) starts a new zygote under it."""
        if self.broken or os.environ.get("BEMA_TEST_SUBPROCESS") == "1":
            return False
        if self.proc is not None and (self.proc.poll() is not None or _environ() != self.environ):
            self.close()
            self.proc = None
        return True

    def run(self, args: list[str], cwd: str, timeout: float, tmp: Path) -> subprocess.CompletedProcess | None:
        if not self.lock.acquire(blocking=False):
            return None
        try:
            if self.proc is None and not self._start():
                return None
            out, err = tmp / "stdout", tmp / "stderr"
            req = {"args": args, "cwd": cwd, "stdout": str(out), "stderr": str(err), "argv0": self.bema}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self._line(timeout))["pid"]
            try:
                code = json.loads(self._line(timeout))["code"]
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                self._line(30)
                raise subprocess.TimeoutExpired([self.bema, *args], timeout) from None
            read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
            return subprocess.CompletedProcess([self.bema, *args], code, read(out), read(err))
        finally:
            self.lock.release()

    def _line(self, timeout: float) -> str:
        """One line from the zygote, read from its descriptor (a buffered reader could hold the
        second line where select no longer sees it)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired("zygote", timeout)
            chunk = os.read(fd, 65536)
            if not chunk:
                self.broken = True
                raise RuntimeError("the bema zygote died")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
