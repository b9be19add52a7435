"""Nothing lost, ever: the output commit protocol, OUT's lock, interrupted runs and hostile inputs.

Commit protocol (bema_cli/io/commit.py) first, in-process: a simulated crash after every single
rename of a commit, with and without the atomic exchange, must leave every entry old-and-whole
or new-and-whole and a manifest that lists only what is on disk; the next writer finishes the
commit. Then the real CLI in subprocesses: --overwrite onto an input, a second writer, stale
temp folders of dead writers, kill -9 inside the overwrite swap (the swap is slowed with the
test-only BEMA_TEST_COMMIT_PAUSE hook so the kill lands in it). The long random kill trials are
marked slow.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BEMA, run_bema
from trajectory import write_trajectory

from bema_cli.errors import OutputError
from bema_cli.io import commit
from bema_cli.io.commit import OutputTransaction

STEPS = [10, 20, 30]
RUN = "bema-k0.5-e0.2"


def tree_hash(path: Path) -> str:
    """One hash of a folder's names and bytes (symlinks as their target text)."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def listed(out: Path) -> list[str]:
    """Every output path OUT/manifest.json lists."""
    doc = json.loads((out / "manifest.json").read_text())
    return [o["path"] for r in doc["runs"] for o in r["outputs"]]


# --- the commit protocol, in-process -----------------------------------------------------------


class Crash(BaseException):
    """Stands for a kill -9: raised at a rename, and the transaction is then abandoned without cleanup."""


def _manifest(*paths: str) -> dict:
    return {"runs": [{"run": p.split("/")[0], "outputs": [{"path": p}]} for p in paths]}


def _old_out(out: Path) -> None:
    (out / "runA").mkdir(parents=True)
    (out / "runA" / "f").write_text("old A")
    (out / "runB" / "checkpoint-1").mkdir(parents=True)
    (out / "runB" / "checkpoint-1" / "f").write_text("old B1")
    (out / "manifest.json").write_text(json.dumps(_manifest("runA/f", "runB/checkpoint-1/f")))


def _stage(txn: OutputTransaction) -> None:
    """A new runA (replaces the old), a checkpoint added to runB (follow mode's case), a new runC."""
    for rel, text in (("runA/f", "new A"), ("runB/checkpoint-2/f", "new B2"), ("runC/f", "new C")):
        (txn.tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (txn.tmp / rel).write_text(text)


FINAL = _manifest("runA/f", "runB/checkpoint-1/f", "runB/checkpoint-2/f", "runC/f")
INTERIM = _manifest("runB/checkpoint-1/f")  # runA is being replaced: not listed during the swap
ENTRIES = ["runA", "runB/checkpoint-2", "runC"]


def _check_whole(out: Path, finished: bool, tmp: Path | None = None) -> None:
    if not finished and not (out / "runA").exists():  # two renames, cut between them: both copies whole
        assert (tmp / commit.ASIDE / "runA" / "f").read_text() == "old A"
        assert (tmp / "runA" / "f").read_text() == "new A"
    else:
        assert (out / "runA" / "f").read_text() in (("new A",) if finished else ("old A", "new A"))
    assert (out / "runB" / "checkpoint-1" / "f").read_text() == "old B1"
    for rel, text in (("runB/checkpoint-2/f", "new B2"), ("runC/f", "new C")):
        if finished or (out / rel).exists():
            assert (out / rel).read_text() == text
    missing = [p for p in listed(out) if not (out / p).exists()]
    assert missing == [], f"manifest.json lists {missing}, which are not on disk"


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_crash_after_every_rename_leaves_old_or_new(tmp_path, monkeypatch, exchange):
    """Kill the commit after its 1st, 2nd, ... rename: each state is consistent; recovery finishes it."""
    if not exchange:
        monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    n = 0
    while True:
        n += 1
        out = tmp_path / f"out{n}"
        _old_out(out)
        calls = {"k": 0}

        def pause(n=n, calls=calls):
            calls["k"] += 1
            if calls["k"] == n:
                raise Crash

        monkeypatch.setattr(commit, "_pause", pause)
        txn = OutputTransaction(out).__enter__()
        _stage(txn)
        try:
            txn.commit(ENTRIES, manifest=FINAL, interim_manifest=INTERIM)
            crashed = False
        except Crash:
            crashed = True
            os.close(txn._lock_fd)  # the process is gone: the kernel drops its lock, nothing else happens
        monkeypatch.setattr(commit, "_pause", lambda: None)
        if not crashed:
            txn.__exit__(None, None, None)
            _check_whole(out, finished=True)
            assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "runA", "runB", "runC"]
            break
        _check_whole(out, finished=False, tmp=txn.tmp)
        assert exchange or n != 1 or not (out / "runA").exists(), "the window of the two-rename fallback"
        with OutputTransaction(out) as again:
            assert again.recovered == [txn.tmp.name]
            _check_whole(out, finished=True)
        assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "runA", "runB", "runC"]
        assert json.loads((out / "manifest.json").read_text()) == FINAL
    assert n == (5 if exchange else 6)  # renames: runA (1 or 2), runB/checkpoint-2, runC, manifest


def test_exception_before_commit_point_changes_nothing(tmp_path):
    out = tmp_path / "out"
    _old_out(out)
    before = tree_hash(out)
    with pytest.raises(RuntimeError), OutputTransaction(out) as txn:
        _stage(txn)
        raise RuntimeError("the walk failed")
    assert tree_hash(out) == before


def test_interrupt_inside_commit_finishes_it(tmp_path, monkeypatch):
    """An exception (Ctrl-C) after the commit point: the transaction's exit rolls forward."""
    out = tmp_path / "out"
    _old_out(out)
    calls = {"k": 0}

    def pause():
        calls["k"] += 1
        if calls["k"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(commit, "_pause", pause)
    with pytest.raises(KeyboardInterrupt), OutputTransaction(out) as txn:
        _stage(txn)
        txn.commit(ENTRIES, manifest=FINAL, interim_manifest=INTERIM)
    _check_whole(out, finished=True)
    assert not list(out.glob(".bema-*"))


def test_second_writer_refused_naming_pid(tmp_path):
    out = tmp_path / "out"
    with OutputTransaction(out):
        assert (out / ".bema-lock").read_text().strip() == str(os.getpid())
        with pytest.raises(OutputError, match=f"another bema process {os.getpid()} is writing"):
            OutputTransaction(out).__enter__()
    assert not out.exists(), "a transaction that created OUT and committed nothing removes it"
    with OutputTransaction(out):  # free again
        pass


def test_lock_of_dead_writer_is_taken_and_its_temp_removed(tmp_path):
    """A writer killed with -9 leaves its lock file and temp folder: the next one cleans up and proceeds."""
    out = tmp_path / "out"
    code = (
        "import os, sys, time; from pathlib import Path; from bema_cli.io.commit import OutputTransaction\n"
        "t = OutputTransaction(Path(sys.argv[1])).__enter__(); (t.tmp / 'x').write_bytes(b'0' * 1000)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([BEMA.with_name("python"), "-c", code, out], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"ready"
    with pytest.raises(OutputError, match=f"bema process {proc.pid} is writing"):
        OutputTransaction(out).__enter__()
    proc.kill()
    proc.wait()
    assert len(list(out.glob(".bema-tmp-*"))) == 1 and (out / ".bema-lock").exists()
    with OutputTransaction(out) as txn:
        assert len(txn.recovered) == 1
        assert [p.name for p in out.glob(".bema-tmp-*")] == [txn.tmp.name]
    assert list(out.iterdir()) == []


# --- the CLI: inputs are sacred, the overwrite swap, a second writer, stale temp folders -------


@pytest.fixture(scope="module")
def traj(tmp_path_factory):
    root = tmp_path_factory.mktemp("traj")
    base, run = write_trajectory(root, STEPS, shapes={"w": (400, 64), "b": (64,)}, with_int=False)
    return base, run


def _hashes(*folders: Path) -> dict:
    return {str(f): tree_hash(f) for f in folders}


def test_overwrite_onto_its_own_input_is_refused(traj, tmp_path):
    """`bema stabilize OUT/bema-k0.5-e0.2 --base first --out OUT --overwrite` once replaced its own inputs."""
    base, run = traj
    out = tmp_path / "out"
    assert run_bema("stabilize", run, "--base", base, "--out", out).returncode == 0
    before = _hashes(out)
    for args in (
        [out / RUN, "--base", "first", "--out", out, "--overwrite"],  # OUT contains the input
        [run, "--base", base, "--out", run / "checkpoint-10" / "x"],  # OUT inside an input
        [run, "--base", base, "--out", run],  # OUT is the input
        [run, "--base", base, "--out", base.parent],  # OUT contains the base
    ):
        r = run_bema("stabilize", *args)
        assert r.returncode == 4, r.stderr
        assert r.stderr.count("\n") == 1 and "apart from the inputs" in r.stderr, r.stderr
    assert _hashes(out) == before
    assert not (run / "checkpoint-10" / "x").exists()


def test_overwrite_onto_input_through_symlink_is_refused(traj, tmp_path):
    base, run = traj
    link = tmp_path / "link"
    link.symlink_to(run)
    before = _hashes(run)
    r = run_bema("stabilize", run, "--base", base, "--out", link / "checkpoint-20", "--overwrite")
    assert r.returncode == 4 and "apart from the inputs" in r.stderr, r.stderr
    assert _hashes(run) == before


def test_overwrite_replaces_only_bema_outputs(traj, tmp_path):
    """A foreign folder or a symlink named like the run is refused before any work, even with --overwrite."""
    base, run = traj
    out = tmp_path / "out"
    (out / RUN).mkdir(parents=True)
    (out / RUN / "notes.txt").write_text("mine")
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--overwrite")
    assert r.returncode == 4 and "not a bema output" in r.stderr, r.stderr
    assert (out / RUN / "notes.txt").read_text() == "mine"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / RUN / "notes.txt").rename(elsewhere / "notes.txt")
    (out / RUN).rmdir()
    (out / RUN).symlink_to(elsewhere)
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--overwrite")
    assert r.returncode == 4 and "symbolic link" in r.stderr and str(out / RUN) in r.stderr, r.stderr
    assert (elsewhere / "notes.txt").read_text() == "mine"
    assert not list(out.glob(".bema-*"))


def test_stale_temp_folders_of_dead_writers_are_removed(traj, tmp_path):
    base, run = traj
    out = tmp_path / "out"
    (out / ".bema-tmp-deadbeef" / RUN / "checkpoint-10").mkdir(parents=True)
    (out / ".bema-tmp-deadbeef" / RUN / "checkpoint-10" / "model.safetensors").write_bytes(b"\0" * 4096)
    (out / ".bema-lock").write_text("999999\n")
    r = run_bema("stabilize", run, "--base", base, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "cleaned up after 1 interrupted bema run" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["bema-k0.5-e0.2", "manifest.json"]


def _start(*args, env=None):
    full = {**os.environ, **(env or {})}
    cmd = [str(BEMA), "stabilize", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)


def _wait_for(cond, proc, timeout=120.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def test_second_writer_is_refused_up_front(traj, tmp_path):
    """Two writers on one OUT: the second stops at once naming the first's pid; the first completes."""
    base, run = traj
    out = tmp_path / "out"
    first = _start(run, "--base", base, "--out", out, env={commit.PAUSE_ENV: "6"})  # holds OUT 12 s
    assert _wait_for(lambda: list(out.glob(".bema-tmp-*/.bema-commit.json")), first)
    t0 = time.time()
    second = run_bema("stabilize", run, "--base", base, "--out", out, "--method", "ema")
    assert second.returncode == 4, second.stderr
    assert f"another bema process {first.pid} is writing" in second.stderr and second.stderr.count("\n") == 1
    assert time.time() - t0 < 30
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert sorted(p.name for p in out.iterdir()) == [RUN, "manifest.json"]


def _whole_run(out: Path, expected: dict[str, str]) -> str:
    """OUT/RUN is exactly one of the expected trees; returns which. The manifest lists only what exists."""
    h = tree_hash(out / RUN)
    assert h in expected.values(), f"{out / RUN} is neither the old nor the new run"
    assert [p for p in listed(out) if not (out / p).exists()] == []
    return next(k for k, v in expected.items() if v == h)


@pytest.fixture(scope="module")
def old_and_new(traj, tmp_path_factory):
    """Reference trees: the old run (all steps) and the new run (--steps 30) that overwrites it."""
    base, run = traj
    ref = tmp_path_factory.mktemp("ref")
    assert run_bema("stabilize", run, "--base", base, "--out", ref / "old").returncode == 0
    assert run_bema("stabilize", run, "--base", base, "--out", ref / "new", "--steps", "30").returncode == 0
    return ref, {"old": tree_hash(ref / "old" / RUN), "new": tree_hash(ref / "new" / RUN)}


def _kill_in_swap(traj, old_and_new, out: Path, sig: int, delay: float) -> tuple[int, str]:
    """Overwrite the old run with the new one, send `sig` `delay` s after the swap begins (the journal
    appears); returns (exit code, stderr)."""
    import shutil

    base, run = traj
    ref, _ = old_and_new
    shutil.copytree(ref / "old", out, symlinks=True)
    proc = _start(
        run, "--base", base, "--out", out, "--steps", "30", "--overwrite", env={commit.PAUSE_ENV: "0.4"}
    )
    assert _wait_for(lambda: list(out.glob(".bema-tmp-*/.bema-commit.json")), proc), proc.communicate()
    time.sleep(delay)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


def test_kill9_inside_overwrite_swap(traj, old_and_new, tmp_path):
    """kill -9 once the swap has begun: the run is old or new and whole, the manifest true; the next
    writer finishes the swap (the new run) and leaves no temp folder."""
    base, run = traj
    _, expected = old_and_new
    out = tmp_path / "out"
    code, _ = _kill_in_swap(traj, old_and_new, out, signal.SIGKILL, 0.2)
    assert code == -signal.SIGKILL
    _whole_run(out, expected)
    assert list(out.glob(".bema-tmp-*")), "killed inside the swap: its journal should be left to finish"
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--method", "ema")
    assert r.returncode == 0, r.stderr
    assert _whole_run(out, expected) == "new"
    assert sorted(p.name for p in out.iterdir()) == [RUN, "ema-k0.5", "manifest.json"]


def test_sigterm_inside_overwrite_swap(traj, old_and_new, tmp_path):
    """SIGTERM during the swap waits for its last rename (milliseconds), then exits 143: new run, no temp."""
    _, expected = old_and_new
    out = tmp_path / "out"
    code, stderr = _kill_in_swap(traj, old_and_new, out, signal.SIGTERM, 0.2)
    assert code == 143, stderr
    assert stderr.strip().splitlines() == ["error: interrupted by SIGTERM; nothing half-written was kept"]
    assert _whole_run(out, expected) == "new"
    assert sorted(p.name for p in out.iterdir()) == [RUN, "manifest.json"]


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(12))
def test_random_kill_trials(traj, old_and_new, tmp_path, trial):
    """kill -9 / SIGTERM / SIGINT / SIGHUP at a random instant of an --overwrite run (walk or swap)."""
    base, run = traj
    ref, expected = old_and_new
    rng = random.Random(trial)
    sig = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP][trial % 4]
    out = tmp_path / "out"
    import shutil

    shutil.copytree(ref / "old", out, symlinks=True)
    env = {commit.PAUSE_ENV: "0.2"} if trial % 2 else {}
    proc = _start(
        run, "--base", base, "--out", out, "--steps", "30", "--overwrite", "--max-memory", "20KB", env=env
    )
    assert _wait_for(lambda: (out / ".bema-lock").exists(), proc), proc.communicate()
    time.sleep(rng.uniform(0, 1.5))
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    # -sig: it arrived after the run had finished, while Python shut down (which restores the default
    # handlers); everything was committed and cleaned up by then
    assert proc.returncode in (0, -signal.SIGKILL, 128 + sig, -sig), stderr
    if sig != signal.SIGKILL:
        assert not list(out.glob(".bema-*")), "a handled signal cleans up"
    _whole_run(out, expected)
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--method", "ema")
    assert r.returncode == 0, r.stderr
    _whole_run(out, expected)
    assert sorted(p.name for p in out.iterdir()) == [RUN, "ema-k0.5", "manifest.json"]
