"""The writer's O_DIRECT path (io/writer.py `DirectFile`): whatever order and split the writes
come in, the file holds exactly the bytes written, and no writer touches a byte outside its range
(work units of one file written by several processes at once, as the Ray executor does)."""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bema_cli.io import direct as direct_mod
from bema_cli.io import writer as writer_mod
from bema_cli.io.direct import PAGE
from bema_cli.io.safetensors import TensorInfo
from bema_cli.io.writer import ShardedWriter, plan_shards, tensor_bytes

# odd sizes: no tensor starts or ends on a page boundary
SIZES = {"a": 7, "b": 300_001, "c": 5_003, "d": (1 << 21) + 5, "e": 3, "f": 777_777}


def model() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(n, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
        for i, (name, n) in enumerate(SIZES.items())
    }


def new_writer(folder: Path, tensors: dict) -> ShardedWriter:
    infos = [TensorInfo(n, Path(), "BF16" if t.dtype == torch.bfloat16 else "F32", tuple(t.shape))
             for n, t in tensors.items()]  # fmt: skip
    return ShardedWriter(folder, plan_shards(infos, 1 << 40), {"format": "pt"}).open()


def pieces(w: ShardedWriter, tensors: dict, step: int = 100_003) -> list[tuple[str, int, object]]:
    """(name, byte offset, bytes) in file order, cut every `step` bytes (mid-element, mid-page)."""
    out = []
    for t in w.shards[0].tensors:
        data = tensor_bytes(tensors[t.name])
        out += [(t.name, a, data[a : a + step]) for a in range(0, len(data), step)]
    return out


def same(folder: Path, tensors: dict) -> bool:
    got = load_file(folder / "model.safetensors")
    return set(got) == set(tensors) and all(torch.equal(got[n], tensors[n]) for n in tensors)


def total(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_units_split_mid_page_write_their_whole_pages_direct(tmp_path):
    tensors = model()
    w = new_writer(tmp_path / "m", tensors)
    parts = pieces(w, tensors)
    for unit in (parts[:7], parts[7:30], parts[30:]):  # three held() sessions, as work units are
        with w.held():
            for name, at, data in unit:
                w.write(name, at, data)
    assert same(tmp_path / "m", tensors)
    # all but the partial pages at each unit's ends (and the header's) went past the page cache
    assert total(tensors) - 6 * PAGE <= w.direct_bytes < total(tensors)


def test_writes_out_of_order_fall_back_to_the_page_cache(tmp_path):
    tensors = model()
    w = new_writer(tmp_path / "m", tensors)
    parts = pieces(w, tensors)
    with w.held():
        for name, at, data in parts[:20] + parts[20:][::-1]:
            w.write(name, at, data)
    assert same(tmp_path / "m", tensors)
    assert 0 < w.direct_bytes <= sum(len(d) for _, _, d in parts[:20])


def _write_range(w: ShardedWriter, parts: list) -> None:
    with w.held():
        for name, at, data in parts:
            w.write(name, at, data)


def test_processes_writing_neighbouring_ranges_of_one_file(tmp_path):
    """Two processes at once, their ranges meeting mid-page: the shared page goes through the page
    cache from both, so neither overwrites the other's bytes with stale ones."""
    tensors = model()
    w = new_writer(tmp_path / "m", tensors)
    parts = pieces(w, tensors, step=65_537)
    half = len(parts) // 2
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_range, args=(w, p)) for p in (parts[:half], parts[half:])]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert same(tmp_path / "m", tensors)


def test_a_filesystem_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    tensors = model()
    w = new_writer(tmp_path / "m", tensors)
    direct_fds, real_open, real_pwrite = set(), os.open, os.pwrite

    def opened(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def pwrite(fd, data, pos):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(writer_mod.os, "open", opened)
    monkeypatch.setattr(writer_mod.os, "pwrite", pwrite)
    _write_range(w, pieces(w, tensors))
    assert direct_fds and w.direct_bytes == 0
    assert same(tmp_path / "m", tensors)


def big_model() -> dict:
    """Three tensors over several CHUNKs each, odd sizes: chunks meet mid-tensor and mid-piece."""
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(k, generator=g) for n, k in (("a", 5_000_003), ("b", 3), ("c", 4_194_311))}


def test_chunks_go_to_the_disk_from_its_thread_while_the_next_is_staged(tmp_path, monkeypatch):
    """Past the first direct write, each full chunk is written by the disk thread while the caller
    stages the next in the other buffer: every chunk but each file's first goes out from there, and
    the file holds every byte."""
    import threading

    from bema_cli.io import direct

    threads, real = [], direct.pwrite_all

    def pwrite_all(fd, view, pos):
        threads.append((threading.current_thread().name, len(view)))
        return real(fd, view, pos)

    monkeypatch.setattr(direct, "pwrite_all", pwrite_all)
    tensors = big_model()
    w = new_writer(tmp_path / "m", tensors)
    _write_range(w, pieces(w, tensors, step=1_000_003))
    assert same(tmp_path / "m", tensors)
    chunks = [t for t, n in threads if n == direct.CHUNK]
    assert len(chunks) == total(tensors) // direct.CHUNK  # 4 full chunks
    assert chunks[0] == "MainThread" and set(chunks[1:]) == {"bema-disk_0"}, chunks
    assert total(tensors) - 2 * PAGE <= w.direct_bytes < total(tensors)


def test_a_write_that_fails_on_the_disk_thread_names_the_file(tmp_path, monkeypatch):
    """A full disk met by a chunk written in the background fails the next write or the flush, with
    the file's name, as a write in the caller's thread does."""
    import pytest

    from bema_cli.errors import OutputError
    from bema_cli.io import direct

    calls, real = [], direct.pwrite_all

    def pwrite_all(fd, view, pos):
        calls.append(pos)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, view, pos)

    monkeypatch.setattr(direct, "pwrite_all", pwrite_all)
    tensors = big_model()
    w = new_writer(tmp_path / "m", tensors)
    with pytest.raises(OutputError, match=r"model\.safetensors: cannot write \(No space left on device\)"):
        _write_range(w, pieces(w, tensors, step=1_000_003))


def test_stabilize_outputs_are_the_same_bytes_either_way(tmp_path):
    """The whole command with O_DIRECT on and off (BEMA_DIRECT_IO=0): bitwise the same files; a
    --max-memory that cuts the model into several work units, so units meet inside files."""
    from conftest import run_bema
    from trajectory import write_trajectory

    shapes = {"embed.weight": (1000, 257), "layer.weight": (513, 129), "layer.bias": (513,), "norm": (257,)}
    base, run = write_trajectory(tmp_path, [10, 20, 30], shapes=shapes, shards=2)
    outs = {}
    for value in ("1", "0"):
        out = tmp_path / f"out{value}"
        r = run_bema("stabilize", run, "--base", base, "--method", "bema,ema", "--out", out,
                     "--max-memory", "2MiB", "--max-shard-size", "600KB", env={"BEMA_DIRECT_IO": value})  # fmt: skip
        assert r.returncode == 0, r.stderr
        outs[value] = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*.safetensors"))}
    assert outs["1"] == outs["0"] and len(outs["1"]) >= 12  # 2 runs x 3 steps x 2+ shards


@pytest.mark.parametrize("method", [["dema"], ["lawa", "--window", "3"]], ids=["dema", "lawa"])
def test_a_state_of_several_tensors_is_written_front_to_back(tmp_path, monkeypatch, method):
    """DEMA's e1 and e2, and a window's members, go out block by block, one state after the other.
    Each state's tensors lie in files of their own, so every state file is written front to back:
    past the page cache (none of its bytes go through it but the partial pages at a unit's ends) and
    summed as written. When they shared a file, its writes alternated between two places: it went
    through the page cache and was read back whole to be summed."""
    from safetensors import safe_open
    from trajectory import write_trajectory
    from typer.testing import CliRunner

    from bema_cli.cli import app
    from bema_cli.stabilize import state_doc

    summed_by_reading: list[Path] = []
    buffered: list[int] = []  # bytes written to state files through the page cache
    real_digest, real_pwrite = state_doc.file_digest, writer_mod.pwrite_all

    def digest(path, *args, **kwargs):
        summed_by_reading.append(Path(path))
        return real_digest(path, *args, **kwargs)

    def pwrite_all(fd, view, pos):
        cached = not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        if cached and ".bema-state" in os.readlink(f"/proc/self/fd/{fd}"):
            buffered.append(len(view))
        return real_pwrite(fd, view, pos)

    monkeypatch.setattr(state_doc, "file_digest", digest)
    monkeypatch.setattr(writer_mod, "pwrite_all", pwrite_all)
    monkeypatch.setattr(direct_mod, "pwrite_all", pwrite_all)  # DirectFile's writes, direct or not
    shapes = {"embed.weight": (1000, 257), "layer.weight": (513, 129), "layer.bias": (513,), "norm": (257,)}
    base, run = write_trajectory(tmp_path, [10, 20, 30, 40], shapes=shapes)
    out = tmp_path / "out"
    flags = ["--base", str(base), "--method", *method, "--max-memory", "2MiB"]
    result = CliRunner().invoke(app, ["stabilize", str(run), *flags, "--out", str(out)])
    assert result.exit_code == 0, result.output
    files = sorted((out / ".bema-state").rglob("*.safetensors"))
    states = [{k.split("/")[0] for k in safe_open(f, "pt").keys()} for f in files]
    assert len(files) >= 2 and all(len(s) == 1 for s in states), states  # one state per file
    assert not [p for p in summed_by_reading if ".bema-state" in str(p)], summed_by_reading
    state_bytes = sum(f.stat().st_size for f in files)
    # through the page cache: only the partial pages at the units' ends (2.6% here; 61% when shared)
    assert sum(buffered) < state_bytes / 20, (sum(buffered), state_bytes)


def test_the_state_goes_out_from_the_write_behind_thread(tmp_path, monkeypatch):
    """The new state's rows go to the write-behind thread with the outputs, during each unit's last
    step, instead of from the pass's own thread after it (where they stood still on the disk: 4.9 s
    of a 1.5B run): every state byte is written from that thread, each state file front to back
    (so it is summed as written, none read back), and a later call continues from it bitwise."""
    import threading

    from trajectory import write_trajectory
    from typer.testing import CliRunner

    from bema_cli.cli import app
    from bema_cli.stabilize import state_doc

    written: dict[str, list[int]] = {}  # thread name -> state bytes it wrote
    summed_by_reading: list[Path] = []
    real_write, real_digest = ShardedWriter.write, state_doc.file_digest

    def write(self, name, byte_offset, data):
        n = real_write(self, name, byte_offset, data)
        if ".bema-state" in str(self.folder):
            written.setdefault(threading.current_thread().name, []).append(n)
        return n

    def digest(path, *args, **kwargs):
        summed_by_reading.append(Path(path))
        return real_digest(path, *args, **kwargs)

    monkeypatch.setattr(ShardedWriter, "write", write)
    monkeypatch.setattr(state_doc, "file_digest", digest)
    shapes = {"embed.weight": (1000, 257), "layer.weight": (513, 129), "layer.bias": (513,), "norm": (257,)}
    base, run = write_trajectory(tmp_path, [10, 20, 30], shapes=shapes)
    flags = ["--base", str(base), "--method", "bema,ema", "--max-memory", "2MiB"]
    runner = CliRunner()
    one = runner.invoke(app, ["stabilize", str(run), *flags, "--out", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    state_bytes = sum(p.stat().st_size for p in (tmp_path / "one" / ".bema-state").rglob("*.safetensors"))
    assert set(written) == {"bema-write-behind"}, written
    assert state_bytes - 4096 < sum(written["bema-write-behind"]) <= state_bytes  # all but the header
    assert not [p for p in summed_by_reading if ".bema-state" in str(p)]

    # continued: the state written this way is the one a one-shot run over every step holds
    (tmp_path / "part").mkdir()
    for step in (10, 20):
        (tmp_path / "part" / f"checkpoint-{step}").symlink_to(run / f"checkpoint-{step}")
    assert (
        runner.invoke(
            app, ["stabilize", str(tmp_path / "part"), *flags, "--out", str(tmp_path / "inc")]
        ).exit_code
        == 0
    )
    (tmp_path / "part" / "checkpoint-30").symlink_to(run / "checkpoint-30")
    again = runner.invoke(app, ["stabilize", str(tmp_path / "part"), *flags, "--out", str(tmp_path / "inc")])
    assert again.exit_code == 0, again.output
    for name in ("bema", "ema"):
        got = load_file(next((tmp_path / "inc").glob(f"{name}-*/checkpoint-30/model.safetensors")))
        want = load_file(next((tmp_path / "one").glob(f"{name}-*/checkpoint-30/model.safetensors")))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
