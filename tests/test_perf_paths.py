"""The performance paths of issue 16 keep behaviour: --no-state, reused state buffers, a torch-free
dry run, one batched fsync round per commit, the fused block pass (bitwise whatever the block size),
pread reads, the write-behind thread, preallocated outputs. Real CLI runs on real safetensors files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import one_line_error, run_bema
from trajectory import tensor_section, write_trajectory

from bema_cli.io import commit
from bema_cli.io.commit import OutputTransaction
from bema_cli.recurrence import STATE_TENSORS, Stabilizer
from bema_cli.schedule import PlannedStep

STEPS = [10, 20, 30, 40]
GRID = ["--method", "vanilla,ema,bema,dema,ouema", "--tau", "10"]


@pytest.fixture(scope="module")
def traj(tmp_path_factory):
    return write_trajectory(tmp_path_factory.mktemp("traj"), STEPS)


def outputs(out: Path) -> dict[str, tuple]:
    """Every output's tensors, bitwise (the header's provenance records how each run was asked for)."""
    return {
        str(p.relative_to(out)): tensor_section(p) for p in sorted(out.glob("*/checkpoint-*/*.safetensors"))
    }


def stabilize(traj, out: Path, *args: str):
    base, run = traj
    return run_bema("stabilize", run, "--base", base, "--out", out, *GRID, *args)


def test_no_state_writes_outputs_only_and_a_rerun_is_refused_with_a_hint(traj, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert stabilize(traj, ref).returncode == 0
    r = stabilize(traj, out, "--no-state", "--json")
    assert r.returncode == 0, r.stderr
    assert not (out / ".bema-state").exists()
    assert json.loads(r.stdout)["state_bytes"] == 0
    assert outputs(out) == outputs(ref) and len(outputs(out)) == 5 * len(STEPS)  # bitwise the stateful run's
    assert not list(out.glob(".bema-tmp-*"))
    # the next call cannot continue (no state): one clear line, nothing changed; --overwrite recomputes
    before = outputs(out)
    line = one_line_error(stabilize(traj, out), 4)
    assert "no saved state" in line and "--no-state" in line and "--overwrite" in line
    assert outputs(out) == before
    assert stabilize(traj, out, "--overwrite").returncode == 0
    assert (out / ".bema-state" / "state.json").exists() and outputs(out) == outputs(ref)
    # --no-state on an OUT whose runs are continued from a state: refused, the state is kept
    line = one_line_error(stabilize(traj, out, "--no-state"), 2)
    assert "--no-state" in line and ".bema-state" in line
    assert (out / ".bema-state" / "state.json").exists()


def test_final_only_keeps_a_state_only_when_asked_or_already_kept(traj, tmp_path):
    """--final-only is a one-off result by default (no state: half the bytes); --state keeps one, and
    an OUT that already has a state goes on being continued from it."""
    one_off, kept = tmp_path / "one-off", tmp_path / "kept"
    r = stabilize(traj, one_off, "--final-only", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state_bytes"] == 0 and not (one_off / ".bema-state").exists()
    again = stabilize(traj, one_off, "--final-only")  # the same finished call: up to date, not refused
    assert again.returncode == 0 and "up to date" in again.stderr, again.stderr
    # other settings under the same run name: nothing to continue from, so refused with the hint
    line = one_line_error(stabilize(traj, one_off, "--final-only", "--gamma", "2"), 4)
    assert "--final-only" in line and "--state" in line
    assert stabilize(traj, kept, "--final-only", "--state").returncode == 0
    assert (kept / ".bema-state" / "state.json").exists()
    assert outputs(kept) == outputs(one_off)
    # a later --final-only call on the stateful OUT continues (nothing new: nothing written, no refusal)
    r = stabilize(traj, kept, "--final-only", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["outputs"] == [] and (kept / ".bema-state" / "state.json").exists()


def test_no_state_with_follow_is_refused(traj, tmp_path):
    line = one_line_error(stabilize(traj, tmp_path / "out", "--no-state", "--follow"), 2)
    assert "--no-state" in line and "--follow" in line


def test_dry_run_projects_memory_and_time_and_writes_nothing(traj, tmp_path):
    """The dry run probes this machine (torch for the compute probe: ~1 s) and projects the run's
    peak memory and wall time; it writes nothing and leaves no probe file behind."""
    base, run = traj
    r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "o", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    p = doc["projection"]
    assert doc["dry_run"] is True and p["seconds"] > 0
    read, compute, write, state = (p["parts_seconds"][k] for k in ("read", "compute", "write", "state"))
    overlap = max(1, len(os.sched_getaffinity(0)) / 2)  # 2 cores: the parts run one after another
    main = read + compute + state  # the state's rows go out from the main thread
    assert p["seconds"] == pytest.approx(1.5 + max(main, write, (main + write) / overlap), abs=0.3)
    assert 400 << 20 < p["peak_memory_bytes"] < 2 << 30 and all(v > 0 for v in p["speeds"].values())
    # the state this run writes is projected at its size (headers to within a few bytes)
    real = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "real", "--json")
    assert real.returncode == 0, real.stderr
    written = json.loads(real.stdout)["state_bytes"]  # a fresh run reads no state: all of it written
    assert written > 0 and abs(p["state_bytes"] - written) <= 256, (p["state_bytes"], written)
    text = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "o", "--dry-run")
    assert "projected: peak memory" in text.stdout  # the dry run's own summary says it too
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".bema-probe-*"))
    # --device cuda still checks for a device (with torch) in a dry run
    r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "o", "--dry-run", "--device", "cuda")
    if not torch.cuda.is_available():
        assert "--device cuda" in one_line_error(r, 2)


@pytest.mark.parametrize("method", ["ema", "bema", "dema", "ouema"])
def test_stabilizer_in_given_buffers_is_bitwise_the_allocating_one(method):
    gen = torch.Generator().manual_seed(1)
    theta0 = torch.randn(1000, generator=gen)
    buffers = [torch.full_like(theta0, float("nan")) for _ in STATE_TENSORS[method]]  # stale contents
    a, b = Stabilizer(method, theta0), Stabilizer(method, theta0, buffers)
    events = [PlannedStep(1, "burnin", 0.0, 1.0), PlannedStep(2, "update", 0.3, 0.1)]
    events += [PlannedStep(3, "skip", float("nan"), float("nan")), PlannedStep(4, "update", 0.25, 0.07)]
    for event in events:
        theta = torch.randn(1000, generator=gen)
        ra, rb = a.apply(event, theta), b.apply(event, theta)
        if ra is not None:
            assert torch.equal(ra, rb)
        for name, buffer in zip(STATE_TENSORS[method], buffers, strict=True):
            assert getattr(b, name).data_ptr() == buffer.data_ptr()  # the state lives in the buffer
            assert torch.equal(getattr(a, name), getattr(b, name))


def test_commit_fsyncs_once_per_file_and_once_per_folder(tmp_path, monkeypatch):
    """The staged manifest and the journal: one fsync each, one of the temp folder, one of OUT."""
    calls = []
    real = os.fsync
    monkeypatch.setattr(commit.os, "fsync", lambda fd: calls.append(fd) or real(fd))
    out = tmp_path / "out"
    with OutputTransaction(out) as txn:
        (txn.tmp / "run").mkdir()
        (txn.tmp / "run" / "model.safetensors").write_bytes(b"x")
        calls.clear()
        txn.commit(["run"], manifest={"runs": ["run"]})
    assert len(calls) == 4, calls
    assert json.loads((out / "manifest.json").read_text()) == {"runs": ["run"]}
    assert (out / "run" / "model.safetensors").read_bytes() == b"x"


# -- the fused, cache-blocked unit pass and its I/O (docs/design.md, "The fused pass") ---------------


@pytest.fixture(scope="module")
def traj_bf16(tmp_path_factory):
    return write_trajectory(tmp_path_factory.mktemp("traj16"), STEPS, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "which,out_dtype", [("f32", None), ("bf16", None), ("f32", "bfloat16"), ("bf16", "float32")]
)
def test_block_size_does_not_change_a_byte(traj, traj_bf16, tmp_path, monkeypatch, which, out_dtype):
    """Blocks of 7 elements cut through every tensor, row and piece: the bytes are those of one block
    per unit (the CLI's default here), for every method, a burn-in, bf16 reads and casts on output."""
    from bema_cli.schedule import Schedule
    from bema_cli.stabilize import plan as plan_module
    from bema_cli.stabilize import stabilize as run
    from bema_cli.stabilize.plan import Options, Output

    base, run_dir = traj if which == "f32" else traj_bf16
    ref, out = tmp_path / "ref", tmp_path / "out"
    extra = ["--out-dtype", out_dtype] if out_dtype else []
    r = run_bema("stabilize", run_dir, "--base", base, "--out", ref, *GRID, *extra)
    assert r.returncode == 0, r.stderr
    sizes = []
    monkeypatch.setattr(plan_module, "block_size", lambda max_memory, itemsize: sizes.append(7) or 7)
    threads = torch.get_num_threads()
    schedules = [Schedule(method=m, tau=10).resolved() for m in ("vanilla", "ema", "bema", "dema", "ouema")]
    run(Options(str(run_dir), schedules, str(out), base=str(base), out_dtype=out_dtype, write=Output()))
    assert sizes == [7]
    assert outputs(out) == outputs(ref) and len(outputs(ref)) == 5 * len(STEPS)
    assert torch.get_num_threads() == threads  # one fewer while the units ran, restored after


@pytest.mark.parametrize("which", ["f32", "bf16"])
def test_readers_do_not_change_a_byte(traj, traj_bf16, tmp_path, monkeypatch, which):
    """--readers N reads blocks ahead in N threads: the same bytes as the synchronous reads, with
    blocks of 7 elements (many reads in flight per tensor) and bf16 inputs cast on arrival."""
    from bema_cli.io import read_ahead
    from bema_cli.schedule import Schedule
    from bema_cli.stabilize import plan as plan_module
    from bema_cli.stabilize import stabilize as run
    from bema_cli.stabilize.plan import Options, Output

    base, run_dir = traj if which == "f32" else traj_bf16
    ref = tmp_path / "ref"
    assert (
        run_bema("stabilize", run_dir, "--base", base, "--out", ref, *GRID, "--readers", "1").returncode == 0
    )
    monkeypatch.setattr(plan_module, "block_size", lambda max_memory, itemsize: 7)
    fetched = []
    real_fetch = read_ahead.ReadAhead._fetch
    monkeypatch.setattr(
        read_ahead.ReadAhead, "_fetch", lambda self, i: fetched.append(i) or real_fetch(self, i)
    )
    schedules = [Schedule(method=m, tau=10).resolved() for m in ("vanilla", "ema", "bema", "dema", "ouema")]
    for readers in (2, 3):
        out = tmp_path / f"out{readers}"
        run(Options(str(run_dir), schedules, str(out), base=str(base), readers=readers, write=Output()))
        assert outputs(out) == outputs(ref) and len(outputs(ref)) == 5 * len(STEPS)
    assert len(fetched) > 100  # the read-ahead threads really read the blocks


def test_a_file_truncated_after_indexing_is_an_error_naming_it(traj, tmp_path):
    """Reads are preads, not a memory map: a file that shrinks under bema is a one-line error naming it
    (a mapped file gave SIGBUS), and a read that stays inside the file still works."""
    from bema_cli.errors import InputError
    from bema_cli.io.safetensors import ChunkReader, index_model

    base, _ = traj
    path = tmp_path / "model.safetensors"
    path.write_bytes((base / "model.safetensors").read_bytes())
    index = index_model(tmp_path, [path])
    info = index.tensors["layer.0.weight"]
    with ChunkReader(index) as reader:
        whole = reader.read("layer.0.weight", 0, info.shape[0])
        part = torch.empty(5)
        reader.read_elements_into("layer.0.weight", 3, 5, part)
        assert torch.equal(part, whole.reshape(-1)[3:8])
    os.truncate(path, info.offset + info.row_bytes)  # keep the first row only
    with ChunkReader(index) as reader, pytest.raises(InputError) as err:
        reader.read("layer.0.weight", 0, info.shape[0])
    assert str(path) in str(err.value) and "truncated" in str(err.value)


@pytest.mark.parametrize("gpu_pipeline", ["0", "1"])
def test_a_run_failing_mid_unit_leaves_no_file_open(tmp_path, monkeypatch, gpu_pipeline):
    """Output files are opened and closed by the write-behind thread, step by step (unit.py), inputs
    by read-ahead threads sharing a reader; a NaN in the third step of a later unit fails the run
    there, and every file it had opened is closed. A successful run leaves none open either."""
    from safetensors.torch import load_file, save_file

    from bema_cli.errors import InputError
    from bema_cli.schedule import Schedule
    from bema_cli.stabilize import stabilize
    from bema_cli.stabilize.plan import Options, Output

    monkeypatch.setenv("BEMA_GPU_PIPELINE", gpu_pipeline)
    shapes = {"a.weight": (64, 256), "b.weight": (40, 128), "c.weight": (96, 64)}
    base, run = write_trajectory(tmp_path / "t", [10, 20, 30], shapes=shapes, with_int=False)
    path = run / "checkpoint-30" / "model.safetensors"
    weights = load_file(path)
    weights["c.weight"][-1, -1] = float("nan")
    save_file(weights, path)
    opts = Options(str(run), [Schedule(method=m).resolved() for m in ("ema", "bema")], str(tmp_path / "out"),
                   base=str(base), max_memory=200_000, write=Output())  # fmt: skip
    fds = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(InputError, match="c.weight"):
        stabilize(opts)
    assert sorted(os.listdir("/proc/self/fd")) == fds
    assert not list((tmp_path / "out").glob("*/checkpoint-*"))
    weights["c.weight"][-1, -1] = 0.0
    save_file(weights, path)
    stabilize(opts)
    assert (
        sorted(os.listdir("/proc/self/fd")) == fds
        and len(list((tmp_path / "out").glob("*/checkpoint-*"))) == 6
    )


@pytest.mark.parametrize("direct", ["1", "0"])
def test_outputs_are_allocated_up_front_and_writes_reuse_their_files(tmp_path, monkeypatch, direct):
    """fallocate(2): the blocks exist before any tensor byte is written (a full disk fails at once);
    inside held() one descriptor per shard serves every write (and one more writes it past the
    page cache, O_DIRECT: every whole page of a file written front to back), closed on exit."""
    from bema_cli.io.direct import PAGE
    from bema_cli.io.safetensors import TensorInfo
    from bema_cli.io.writer import ShardedWriter, encode_header, plan_shards, tensor_bytes

    monkeypatch.setenv("BEMA_DIRECT_IO", direct)

    info = TensorInfo("w", None, "F32", (256, 1024))
    writer = ShardedWriter(tmp_path / "ckpt", plan_shards([info], 1 << 30), {"bema_version": "t"}).open()
    st = os.stat(tmp_path / "ckpt" / "model.safetensors")
    if st.st_blocks * 512 < info.nbytes:
        pytest.skip("this filesystem does not support fallocate (the writer falls back to a sparse file)")
    fds = len(os.listdir("/proc/self/fd"))
    data = torch.arange(256 * 1024, dtype=torch.float32)
    with writer.held():
        for row in range(256):
            writer.write("w", row * 4096, tensor_bytes(data[row * 1024 : (row + 1) * 1024]))
        assert len(os.listdir("/proc/self/fd")) == fds + 1 + (direct == "1")
    assert len(os.listdir("/proc/self/fd")) == fds
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "ckpt" / "model.safetensors")["w"].reshape(-1), data)
    start = len(encode_header(writer.shards[0], writer.metadata))  # the header's last page: cached
    whole = (start + info.nbytes) // PAGE * PAGE - -(-start // PAGE) * PAGE
    assert writer.direct_bytes == (whole if direct == "1" else 0)


def test_the_speed_probes_scratch_file_has_no_name_beside_the_output(tmp_path):
    """A dry run times writes in the output's folder: with a file no listing shows (O_TMPFILE, or a
    name unlinked at once), so nothing appears beside DIR while it runs and nothing stays after a kill."""
    import os

    from bema_cli.io.probe import _scratch

    fd = _scratch(tmp_path)
    try:
        assert os.write(fd, b"x" * 4096) == 4096 and os.fstat(fd).st_nlink == 0
        assert list(tmp_path.iterdir()) == []
    finally:
        os.close(fd)
