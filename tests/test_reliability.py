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
import shutil
import signal
import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import BEMA, one_line_error, run_bema
from trajectory import write_trajectory

from bema_cli.errors import OutputError
from bema_cli.io import commit
from bema_cli.io.commit import OutputTransaction
from bema_cli.stabilize.state import (
    STATE_DIR,  # the persistent state folder (stabilize/state.py) lives in OUT too
)

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
    """A new runA (replaces the old), a checkpoint added to runB (follow mode's case), a new runC, and
    runD's first checkpoint as a nested entry (its run folder does not exist yet)."""
    for rel, text in (
        ("runA/f", "new A"),
        ("runB/checkpoint-2/f", "new B2"),
        ("runC/f", "new C"),
        ("runD/checkpoint-5/f", "new D5"),
    ):
        (txn.tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (txn.tmp / rel).write_text(text)


FINAL = _manifest("runA/f", "runB/checkpoint-1/f", "runB/checkpoint-2/f", "runC/f", "runD/checkpoint-5/f")
INTERIM = _manifest("runB/checkpoint-1/f")  # runA is being replaced: not listed during the swap
ENTRIES = ["runA", "runB/checkpoint-2", "runC", "runD/checkpoint-5"]


def _check_whole(out: Path, finished: bool, tmp: Path | None = None) -> None:
    if not finished and not (out / "runA").exists():  # two renames, cut between them: both copies whole
        assert (tmp / commit.ASIDE / "runA" / "f").read_text() == "old A"
        assert (tmp / "runA" / "f").read_text() == "new A"
    else:
        assert (out / "runA" / "f").read_text() in (("new A",) if finished else ("old A", "new A"))
    assert (out / "runB" / "checkpoint-1" / "f").read_text() == "old B1"
    for rel, text in (
        ("runB/checkpoint-2/f", "new B2"),
        ("runC/f", "new C"),
        ("runD/checkpoint-5/f", "new D5"),
    ):
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
            assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "runA", "runB", "runC", "runD"]
            break
        _check_whole(out, finished=False, tmp=txn.tmp)
        assert exchange or n != 1 or not (out / "runA").exists(), "the window of the two-rename fallback"
        with OutputTransaction(out) as again:
            assert again.recovered == [txn.tmp.name]
            _check_whole(out, finished=True)
        assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "runA", "runB", "runC", "runD"]
        assert json.loads((out / "manifest.json").read_text()) == FINAL
    assert n == (6 if exchange else 7)  # renames: runA (1 or 2), runB/checkpoint-2, runC, runD/..., manifest


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
    assert not list(p for p in out.glob(".bema-*") if p.name != STATE_DIR)


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
    assert not list(p for p in out.glob(".bema-*") if p.name != STATE_DIR)


def test_stale_temp_folders_of_dead_writers_are_removed(traj, tmp_path):
    base, run = traj
    out = tmp_path / "out"
    (out / ".bema-tmp-deadbeef" / RUN / "checkpoint-10").mkdir(parents=True)
    (out / ".bema-tmp-deadbeef" / RUN / "checkpoint-10" / "model.safetensors").write_bytes(b"\0" * 4096)
    (out / ".bema-lock").write_text("999999\n")
    r = run_bema("stabilize", run, "--base", base, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "cleaned up after 1 interrupted bema run" in r.stderr
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == ["bema-k0.5-e0.2", "manifest.json"]


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


@pytest.mark.slow  # 26 s: a second writer racing a real one
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
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == [RUN, "manifest.json"]


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
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == [RUN, "ema-k0.5", "manifest.json"]


def test_sigterm_inside_overwrite_swap(traj, old_and_new, tmp_path):
    """SIGTERM during the swap waits for its last rename (milliseconds), then exits 143: new run, no temp."""
    _, expected = old_and_new
    out = tmp_path / "out"
    code, stderr = _kill_in_swap(traj, old_and_new, out, signal.SIGTERM, 0.2)
    assert code == 143, stderr
    assert stderr.strip().splitlines() == ["error: interrupted by SIGTERM; nothing half-written was kept"]
    assert _whole_run(out, expected) == "new"
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == [RUN, "manifest.json"]


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(int(os.environ.get("BEMA_KILL_TRIALS", "12"))))
def test_random_kill_trials(traj, old_and_new, tmp_path, trial):
    """kill -9 / SIGTERM / SIGINT / SIGHUP at a random instant of an --overwrite run (walk or swap).
    BEMA_KILL_TRIALS=N runs N trials instead of 12."""
    base, run = traj
    ref, expected = old_and_new
    rng = random.Random(trial)
    sig = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP][trial % 4]
    out = tmp_path / "out"
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
        left = [p for p in out.glob(".bema-*") if p.name != STATE_DIR]
        assert not left, ("a handled signal cleans up", proc.returncode, stderr, left)
    _whole_run(out, expected)
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--method", "ema")
    assert r.returncode == 0, r.stderr
    _whole_run(out, expected)
    assert sorted(p.name for p in out.iterdir() if p.name != STATE_DIR) == [RUN, "ema-k0.5", "manifest.json"]


# --- hostile inputs: exit code, one stderr line, inputs unchanged, nothing partial in OUT -------


def _edit_header(path: Path, fn) -> None:
    """Rewrite a safetensors file's JSON header with fn(header) applied; tensor bytes unchanged."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _small(root: Path, **kw) -> tuple[Path, Path]:
    return write_trajectory(root, STEPS, with_int=False, **kw)


def _fake_output(out: Path, run: Path) -> None:
    """OUT/bema-k0.5-e0.2/checkpoint-<s> as a bema output (bema.json + manifest) without running bema."""
    runs = {"run": RUN, "outputs": []}
    for s in STEPS:
        dst = out / RUN / f"checkpoint-{s}"
        shutil.copytree(run / f"checkpoint-{s}", dst)
        (dst / "bema.json").write_text(json.dumps({"run": RUN, "step": s}))
        runs["outputs"].append({"step": s, "path": f"{RUN}/checkpoint-{s}"})
    (out / "manifest.json").write_text(json.dumps({"runs": [runs]}))


def overwrite_own_input(root):
    base, run = _small(root)
    _fake_output(root / "out", run)
    return (
        [root / "out" / RUN, "--base", "first", "--out", root / "out", "--overwrite"],
        4,
        "contains the input",
    )


def out_inside_checkpoint(root):
    base, run = _small(root)
    return [run, "--base", base, "--out", run / "checkpoint-20" / "o"], 4, "lies inside the input"


def out_is_run(root):
    base, run = _small(root)
    return [run, "--base", base, "--out", run, "--overwrite"], 4, "is the input"


def out_via_symlink(root):
    base, run = _small(root)
    (root / "link").symlink_to(run / "checkpoint-10")
    return [run, "--base", base, "--out", root / "link" / "o"], 4, "lies inside the input"


def out_empty(root):
    base, run = _small(root)
    return [run, "--base", base, "--out", ""], 2, "--out: empty path"


def out_is_file(root):
    base, run = _small(root)
    (root / "out").write_text("a file")
    return [run, "--base", base], 4, "exists and is not a directory"


def negative_shape(root):
    base, run = _small(root)
    for f in [base / "model.safetensors", *run.glob("checkpoint-*/model.safetensors")]:
        _edit_header(f, lambda h: h["layer.0.weight"].update(shape=[-12, -8]))
    return [run, "--base", base], 3, "dimensions are integers >= 0"


def float_shape(root):
    base, run = _small(root)
    _edit_header(
        run / "checkpoint-20" / "model.safetensors", lambda h: h["layer.0.bias"].update(shape=[12.0])
    )
    return [run, "--base", base], 3, "has shape [12.0]"


def string_offsets(root):
    base, run = _small(root)
    f = run / "checkpoint-30" / "model.safetensors"
    _edit_header(f, lambda h: h["scale"].update(data_offsets=[str(o) for o in h["scale"]["data_offsets"]]))
    return [run, "--base", base], 3, "data_offsets"


def overlapping_offsets(root):
    base, run = _small(root)
    f = run / "checkpoint-10" / "model.safetensors"

    def overlap(h):
        a, b = h["layer.0.bias"]["data_offsets"]
        h["scale"]["data_offsets"] = [a, a + 4]

    _edit_header(f, overlap)
    return [run, "--base", base], 3, "corrupt safetensors file"


def index_path_outside(root):
    base, run = _small(root, shards=2)
    (root / "outside").mkdir()
    ckpt = run / "checkpoint-20"
    shutil.copy(ckpt / "model-00002-of-00002.safetensors", root / "outside" / "x.safetensors")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        k: ("../../outside/x.safetensors" if v.startswith("model-00002") else v)
        for k, v in index["weight_map"].items()
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return [run, "--base", base], 3, "a path outside the folder"


def index_names_missing_tensor(root):
    base, run = _small(root, shards=2)
    f = run / "checkpoint-30" / "model.safetensors.index.json"
    index = json.loads(f.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    f.write_text(json.dumps(index))
    return [run, "--base", base], 3, "'ghost.weight'"


def index_wrong_type(root):
    base, run = _small(root, shards=2)
    (run / "checkpoint-10" / "model.safetensors.index.json").write_text('{"weight_map": ["a", "b"]}')
    return [run, "--base", base], 3, "not a valid safetensors index"


def dangling_symlink(root):
    base, run = _small(root)
    (run / "checkpoint-40").symlink_to(root / "gone")
    return [run, "--base", base], 3, "dangling symbolic link"


def looping_symlink(root):
    base, run = _small(root)
    (run / "checkpoint-40").symlink_to(run / "checkpoint-40")
    return [run, "--base", base], 3, "symbolic link loop"


def mixed_dtypes(root):
    import torch
    from safetensors.torch import load_file, save_file

    base, run = _small(root)
    f = run / "checkpoint-20" / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f)
    return [run, "--base", base, "--cast-base"], 3, "mixed dtypes need --out-dtype"


def tau_at_last(root):
    base, run = _small(root)
    return [run, "--base", base, "--tau", "30"], 2, "--tau 30: at or beyond the last checkpoint step (30)"


def tau_beyond_last(root):
    base, run = _small(root)
    return [run, "--base", base, "--tau", "1000"], 2, "--tau 1000"


def steps_empty(root):
    base, run = _small(root)
    return [run, "--base", base, "--steps", ""], 2, "--steps: no value given"


def tau_not_int(root):
    base, run = _small(root)
    return (
        [run, "--base", base, "--tau", "abc"],
        2,
        "error: --tau: 'abc' is not an integer (see bema stabilize --help)",
    )


def unknown_flag(root):
    base, run = _small(root)
    return [run, "--base", base, "--kappaa", "0.5"], 2, "no such option: --kappaa"


def missing_out_flag(root):
    base, run = _small(root)
    return [run, "--base", base, "--out"], 2, "--out"


def size_unknown_unit(root):
    base, run = _small(root)
    return [run, "--base", base, "--max-memory", "3PB"], 2, "--max-memory: '3PB' is not a size"


def manifest_wrong_type(root):
    base, run = _small(root)
    (root / "out").mkdir()
    (root / "out" / "manifest.json").write_text("[1, 2]")
    return [run, "--base", base], 3, "not a bema manifest"


def manifest_runs_wrong_type(root):
    base, run = _small(root)
    _fake_output(root / "out", run)
    (root / "out" / "manifest.json").write_text('{"runs": {"bema-k0.5-e0.2": 1}}')
    return [run, "--base", base, "--overwrite"], 3, "not a bema manifest"


def bracket_path_missing(root):
    return [root / "r[/b]x" / "run"], 3, "r[/b]x"


def eval_manifest_wrong_type(root):
    base, run = _small(root)
    _fake_output(root / "stab", run)
    (root / "stab" / "manifest.json").write_text('{"runs": [{"run": "x", "outputs": [{"step": 1}]}]}')
    return ["eval", root / "stab", "--out", root / "out"], 3, "not a bema manifest"


def eval_bema_json_wrong_type(root):
    base, run = _small(root)
    _fake_output(root / "stab", run)
    (root / "stab" / RUN / "checkpoint-10" / "bema.json").write_text('["run"]')
    return ["eval", root / "stab" / RUN / "checkpoint-10", "--out", root / "out"], 3, "not a bema.json record"


def eval_bema_json_bad_step(root):
    base, run = _small(root)
    _fake_output(root / "stab", run)
    (root / "stab" / RUN / "checkpoint-10" / "bema.json").write_text('{"run": "r", "step": "ten"}')
    return ["eval", root / "stab" / RUN / "checkpoint-10", "--out", root / "out"], 3, "'step' is 'ten'"


def rescore_unknown_task(root):
    (root / "s").mkdir()
    line = {"model_path": "m", "task": "trivia", "responses": ["a"], "gold": "a"}
    (root / "s" / "samples.jsonl").write_text(json.dumps(line) + "\n")
    return ["rescore", root / "s" / "samples.jsonl"], 3, "samples.jsonl: unknown task 'trivia'"


HOSTILE = [
    overwrite_own_input, out_inside_checkpoint, out_is_run, out_via_symlink, out_empty, out_is_file,
    negative_shape, float_shape, string_offsets, overlapping_offsets, index_path_outside,
    index_names_missing_tensor, index_wrong_type, dangling_symlink, looping_symlink, mixed_dtypes, tau_at_last,
    tau_beyond_last, steps_empty, tau_not_int, unknown_flag, missing_out_flag, size_unknown_unit, manifest_wrong_type, manifest_runs_wrong_type,
    bracket_path_missing, eval_manifest_wrong_type, eval_bema_json_wrong_type, eval_bema_json_bad_step,
    rescore_unknown_task,
]  # fmt: skip


def _inputs_hash(root: Path) -> dict[str, str]:
    """Hash of every input tree under root (OUT excluded; a run folder used as OUT is an input here)."""
    return {p.name: tree_hash(p) for p in sorted(root.iterdir()) if p.is_dir() and p.name != "out"}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """Build every hostile case, run them all (3 at a time), return {name: (expected, proc, root, hashes)}."""
    prepared = {}
    for case in HOSTILE:
        root = tmp_path_factory.mktemp(case.__name__)
        args, code, message = case(root)
        if args[0] not in ("eval", "rescore"):
            args = ["stabilize", *args]
            if "--out" not in args:
                args += ["--out", root / "out"]
        out_before = tree_hash(root / "out") if (root / "out").is_dir() else None
        prepared[case.__name__] = (args, code, message, root, _inputs_hash(root), out_before)
    with ThreadPoolExecutor(3) as pool:
        futures = {k: pool.submit(run_bema, *v[0]) for k, v in prepared.items()}
        return {k: (prepared[k], f.result()) for k, f in futures.items()}


@pytest.mark.parametrize("name", [c.__name__ for c in HOSTILE])
def test_hostile_input(hostile, name):
    (args, code, message, root, hashes, out_before), proc = hostile[name]
    assert message in one_line_error(proc, code), proc.stderr
    assert proc.stdout == ""
    assert _inputs_hash(root) == hashes, "an input was modified"
    out = root / "out"
    if out_before is None:
        assert not out.exists() or out.is_file(), f"{out} left behind: {list(out.iterdir())}"
    else:
        assert tree_hash(out) == out_before, "OUT changed"
    assert not list(root.rglob(".bema-*")), "temp folder or lock left behind"


def test_brackets_in_paths_are_data(traj, tmp_path):
    """A successful run into --out 'o[/x]y' prints its summary (it crashed on rich markup after writing)."""
    base, run = traj
    out = tmp_path / "o[/x]y"
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--steps", "30", env={"COLUMNS": "500"})
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and f"{out}/{RUN}/checkpoint-30" in r.stdout
    assert (out / RUN / "checkpoint-30" / "model.safetensors").is_file()


def test_sizes_in_tb_and_tib(traj, tmp_path):
    base, run = traj
    for size in ("1TB", "1TiB", "0.5tib"):
        r = run_bema(
            "stabilize",
            run,
            "--base",
            base,
            "--out",
            tmp_path / "o",
            "--max-memory",
            size,
            "--dry-run",
            "--json",
        )
        assert r.returncode == 0, r.stderr
        want = {"1TB": 10**12, "1TiB": 2**40, "0.5tib": 2**39}[size]
        assert json.loads(r.stdout)["plan"]["max_memory"] == want


def test_bare_bema_prints_usage_on_stderr():
    r = run_bema()
    assert r.returncode == 2 and r.stdout == ""
    assert "Usage: bema" in r.stderr and "stabilize" in r.stderr


def test_disk_full_names_the_file(traj, tmp_path):
    """A write that fails (here: a file-size limit, EFBIG, as a full disk gives ENOSPC) names its path."""
    import resource

    base, run = traj
    out = tmp_path / "out"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))

    cmd = [str(BEMA), "stabilize", run, "--base", base, "--out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert r.returncode == 4, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "cannot write (File too large)" in lines[0], r.stderr
    assert f"{out}/.bema-tmp-" in lines[0] and "model.safetensors" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["plain", "json"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_sighup_during_walk_clean_up(tmp_path, sig, json_flag):
    """What SLURM/Kubernetes (SIGTERM) and a closed terminal (SIGHUP) send: handled like Ctrl-C; under
    --json stdout holds one JSON error document, as for every other error."""
    base, run = write_trajectory(tmp_path, STEPS, shapes={"w": (3000, 4)}, with_int=False)
    out = tmp_path / "out"
    proc = _start(run, "--base", base, "--out", out, "--max-memory", "200B", *json_flag)
    assert _wait_for(lambda: list(out.glob(".bema-tmp-*/*/checkpoint-*")), proc), proc.communicate()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    line = f"interrupted by {signal.Signals(sig).name}; nothing half-written was kept"
    assert stderr.splitlines() == [f"error: {line}"]
    if json_flag:
        assert json.loads(stdout) == {"error": line, "exit_code": 128 + sig}
    assert not out.exists(), "the temp folder, the lock and the OUT this run created are gone"


def test_config_dtype_matches_written_tensors(tmp_path):
    """A checkpoint whose config.json names another dtype than its tensors: the output's config tells the truth."""
    base, run = write_trajectory(tmp_path, STEPS, with_int=False)
    for s in STEPS:
        cfg = run / f"checkpoint-{s}" / "config.json"
        cfg.write_text(json.dumps({"model_type": "toy", "torch_dtype": "bfloat16"}))
    r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "out", "--steps", "30")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "out" / RUN / "checkpoint-30" / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and "dtype" not in cfg
