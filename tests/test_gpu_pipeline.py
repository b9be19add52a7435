"""The GPU's pipeline (io/transfer.py, unit.py) tested where no GPU is: BEMA_GPU_PIPELINE=1 runs its
shape on the CPU (staging slots, the read-ahead ring always on, the finite check deferred to one
read-back per step, GPU-sized blocks), so its order, offsets, back-pressure and error paths are
checked here; only the stream and event calls are left to `make gpu-check` on a GPU machine."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from conftest import one_line_error, run_bema
from safetensors.torch import load_file, save_file
from trajectory import tensor_section, write_trajectory

STEPS = [10, 20, 30, 40]
METHODS = ("vanilla", "ema", "bema", "dema", "ouema", "lawa")


@pytest.fixture(scope="module")
def trajs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-pipeline")
    return {
        "f32": write_trajectory(root / "f32", STEPS),
        "bf16": write_trajectory(root / "bf16", STEPS, torch.bfloat16),
    }


def _files(out):
    """Every output and state file's tensors, bitwise (the provenance records how the run was asked for)."""
    return {str(p.relative_to(out)): tensor_section(p) for p in sorted(out.rglob("*.safetensors"))}


@pytest.mark.parametrize("which", ["f32", "bf16"])
@pytest.mark.parametrize("readers", [1, 3])
def test_the_gpu_pipeline_writes_the_cpu_paths_bytes(trajs, tmp_path, monkeypatch, which, readers):
    """Blocks of 7 elements (every block cuts through rows and tensors, the staging slots hold several
    parts at aligned offsets), bf16 inputs staged raw and cast after the copy, a burn-in, a window,
    outputs and states through the outbound slots: every output and state file bitwise the CPU's."""
    from bema_cli.schedule import Schedule
    from bema_cli.stabilize import stabilize as run
    from bema_cli.stabilize import workspace
    from bema_cli.stabilize.plan import Options, Output

    base, run_dir = trajs[which]
    ref = tmp_path / "ref"
    args = ["--method", ",".join(METHODS), "--tau", "10", "--window", "3", "--readers", str(readers)]
    r = run_bema("stabilize", run_dir, "--base", base, "--out", ref, *args, env={"BEMA_GPU_PIPELINE": "0"})
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("BEMA_GPU_PIPELINE", "1")
    monkeypatch.setattr(workspace, "GPU_BLOCK", 7)
    copies = []
    from bema_cli.io import transfer

    real = transfer.Transfers.to_device
    monkeypatch.setattr(transfer.Transfers, "to_device", lambda self, *a: copies.append(1) or real(self, *a))
    schedules = [Schedule(method=m, tau=10, window=3).resolved() for m in METHODS]
    out = tmp_path / "out"
    run(Options(str(run_dir), schedules, str(out), base=str(base), readers=readers, write=Output()))
    assert _files(out) == _files(ref) and len([k for k in _files(ref) if "checkpoint-" in k]) == 6 * len(
        STEPS
    )
    assert len(copies) > 100  # the staged path really ran, block by block


def test_a_nan_found_by_the_deferred_check_names_its_tensor_and_writes_nothing(trajs, tmp_path):
    base, run_dir = trajs["f32"]
    bad = tmp_path / "run"
    for step in STEPS:
        src = run_dir / f"checkpoint-{step}"
        dst = bad / src.name
        dst.mkdir(parents=True)
        for f in src.iterdir():
            dst.joinpath(f.name).write_bytes(f.read_bytes())
    path = bad / "checkpoint-30" / "model.safetensors"
    weights = load_file(path)
    name = sorted(k for k, v in weights.items() if v.is_floating_point())[-1]
    weights[name].view(-1)[weights[name].numel() // 2] = float("nan")
    save_file(weights, path)
    out = tmp_path / "out"
    r = run_bema(
        "stabilize", bad, "--base", base, "--out", out, "--method", "ema", env={"BEMA_GPU_PIPELINE": "1"}
    )
    line = one_line_error(r)
    assert f"{path}: tensor {name!r} contains NaN or Inf" in line, line
    assert not list(out.glob("*/checkpoint-*")) and not list(out.glob(".bema-tmp-*"))


class Gate:
    """A stand-in for a device event: `synchronize` waits until the test opens it."""

    def __init__(self):
        self.opened = threading.Event()

    def synchronize(self):
        assert self.opened.wait(10)


def test_the_read_ahead_ring_is_preallocated_bounded_and_refills_a_buffer_only_after_its_copy(trajs):
    from bema_cli.io.read_ahead import ReadAhead
    from bema_cli.io.safetensors import index_model
    from bema_cli.stabilize.blocks import first_element
    from bema_cli.stabilize.plan import Piece
    from bema_cli.stabilize.unit import _blocks

    base, _ = trajs["f32"]
    index = index_model(base, [base / "model.safetensors"])
    info = index.tensors["layer.0.weight"]
    piece = Piece(info, 0, info.shape[0], 0, info.numel)
    blocks = _blocks([piece], info.numel, 4)
    with index.open() as reader:
        ahead = ReadAhead(reader, blocks, first_element, readers=2, ahead=2)
        ring = [b.data_ptr() for b in ahead.ring]
        assert len(ring) == 3  # ahead + the block being copied in
        gate = Gate()
        whole = reader.read("layer.0.weight", 0, info.shape[0]).reshape(-1)
        got, it = [], iter(ahead)
        first = next(it)  # block 0 is in buffer 0
        got.append(first[0][2].clone())
        ahead.release(0, gate)  # its copy to the device is still in flight
        for i in (1, 2):
            got.append(next(it)[0][2].clone())
            ahead.release(i)
        done = threading.Event()
        threading.Thread(target=lambda: (got.append(next(it)[0][2].clone()), done.set()), daemon=True).start()
        time.sleep(0.3)
        assert not done.is_set()  # block 3 goes into buffer 0: it waits for block 0's copy
        assert torch.equal(first[0][2], whole[0:4])  # buffer 0 untouched meanwhile
        gate.opened.set()
        assert done.wait(10)
        for i in range(3, len(blocks)):
            ahead.release(i)
            if i + 1 < len(blocks):
                got.append(next(it)[0][2].clone())
        ahead.close()
        assert [b.data_ptr() for b in ahead.ring] == ring  # reused, never reallocated
    assert torch.equal(torch.cat(got), whole)


def test_write_behind_waits_for_a_blocks_copy_before_writing_it():
    from bema_cli.io.write_behind import WriteBehind

    gate, order = Gate(), []
    with WriteBehind(8, depth=2) as wb:
        wb.put(wb.buffer(torch.float32, 8), [lambda d: order.append("written")], ready=gate)
        time.sleep(0.3)
        order.append("opened")
        gate.opened.set()
    assert order == ["opened", "written"]


def test_staged_copies_land_at_their_offsets_in_every_dtype(monkeypatch):
    from bema_cli.io.transfer import Transfers

    monkeypatch.setenv("BEMA_GPU_PIPELINE", "1")
    t = Transfers(torch.device("cpu"))
    assert t.staged and not t.cuda
    g = torch.Generator().manual_seed(0)
    for _ in range(5):  # parts of 3 dtypes at odd offsets in one staged block, cast on arrival
        out = torch.full((40,), float("nan"))
        parts = [(3, 10, torch.randn(7, generator=g).to(torch.bfloat16)), (10, 11, torch.randn(1, generator=g)),
                 (11, 40, torch.randn(29, generator=g).to(torch.float16))]  # fmt: skip
        assert t.to_device(parts, out, 3) is None
        for a, b, data in parts:
            assert torch.equal(out[a - 3 : b - 3], data.float())
        assert out[37:].isnan().all()  # nothing written past the block
        host = torch.empty(37, dtype=torch.bfloat16)
        t.to_host(out[:37], host)
        assert torch.equal(host, out[:37].to(torch.bfloat16))
    assert len(t._in) == 2 and len(t._out) == t.depth  # the slots: allocated once, reused


def test_device_auto_says_its_choice_and_reason(trajs, tmp_path):
    base, run_dir = trajs["f32"]
    r = run_bema("stabilize", run_dir, "--base", base, "--out", tmp_path / "o", "--method", "ema", "--json")
    assert r.returncode == 0, r.stderr
    choice = json.loads(r.stdout)["device"]
    assert choice["device"] == "cpu" and choice["asked"] == "auto" and "no CUDA device" in choice["reason"]
    assert "device:" not in r.stderr  # no choice to speak of in a pipe without a GPU (gpu-check shows it)
