"""The streaming writer and lazy reader, round-tripped through the real safetensors library."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from trajectory import load_model

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import model_weight_files
from bema_cli.io.safetensors import TAG_OF, ChunkReader, TensorInfo, index_model, read_header
from bema_cli.io.writer import ShardedWriter, plan_shards, tensor_bytes


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 7, generator=g).bfloat16(),
        "b.weight": torch.randn(5, 3, 2, generator=g).half(),
        "c.bias": torch.randn(9, generator=g),
        "d.double": torch.randn(4, generator=g, dtype=torch.float64),
        "e.ids": torch.arange(11, dtype=torch.int64),
        "f.mask": torch.tensor([True, False, True]),
        "g.scalar": torch.tensor(3.5),
        "h.empty": torch.zeros(0, 4),
        "i.odd": torch.randn(3, generator=g).bfloat16(),  # 6 bytes: later tensors must stay aligned
    }


def _infos(state) -> list[TensorInfo]:
    return [
        TensorInfo(k, None, TAG_OF[str(v.dtype).removeprefix("torch.")], tuple(v.shape))
        for k, v in state.items()
    ]


def _write(folder, state, max_shard_size, chunk_rows=None, in_order=False, digest=False):
    """Write `state` through ShardedWriter, optionally in row chunks, in reverse order unless
    `in_order` (each shard's tensors in file order); returns the shards (and the writer with `digest`)."""
    shards = plan_shards(_infos(state), max_shard_size)
    writer = ShardedWriter(folder, shards, {"bema_version": "test", "bema_run": "r"}, digest=digest).open()
    names = [t.name for s in shards for t in s.tensors] if in_order else list(reversed(state))
    for name in names:
        tensor = state[name]
        rows = tensor.shape[0] if tensor.dim() else 1
        step = chunk_rows or rows or 1
        for r in range(0, rows, step):
            piece = tensor[r : r + step] if tensor.dim() else tensor
            row_bytes = tensor.numel() // rows * tensor.element_size() if rows else 0
            writer.write(name, r * row_bytes, tensor_bytes(piece))
    writer.close()
    return (shards, writer) if digest else shards


@pytest.mark.parametrize("max_shard_size,chunk_rows", [(10**9, None), (200, 2)])
def test_digest_summed_as_written_equals_the_files(tmp_path, max_shard_size, chunk_rows):
    """A file written front to back is summed on the way (the state's checksums need no read-back):
    the digest is file_digest's of the file on disk, header included."""
    from bema_cli.io.fingerprint import file_digest

    shards, writer = _write(tmp_path, _state(), max_shard_size, chunk_rows, in_order=True, digest=True)
    sums = writer.digests()
    assert set(sums) == {s.filename for s in shards}
    for name, digest in sums.items():
        assert digest == file_digest(tmp_path / name), name


def test_digest_of_a_file_written_out_of_order_is_left_to_read_back(tmp_path):
    shards, writer = _write(tmp_path, _state(), 10**9, chunk_rows=2, digest=True)  # reverse order
    assert len(shards) == 1 and writer.digests() == {}


@pytest.mark.parametrize("max_shard_size,chunk_rows", [(10**9, None), (200, 2)])
def test_writer_round_trip_values_exact(tmp_path, max_shard_size, chunk_rows):
    state = _state()
    shards = _write(tmp_path, state, max_shard_size, chunk_rows)
    loaded = load_model(tmp_path)  # safetensors.torch.load_file on every shard
    assert set(loaded) == set(state)
    for k, v in state.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape
        assert torch.equal(loaded[k], v), k
    for shard in shards:
        with safe_open(str(tmp_path / shard.filename), framework="pt") as f:
            assert f.metadata() == {"format": "pt", "bema_version": "test", "bema_run": "r"}
        (n,) = struct.unpack("<Q", (tmp_path / shard.filename).read_bytes()[:8])
        assert n % 8 == 0  # header padded to 8 bytes
        header = read_header(tmp_path / shard.filename)
        for name, entry in header.items():
            if name != "__metadata__":
                itemsize = state[name].element_size()
                assert entry["data_offsets"][0] % itemsize == 0, f"{name} misaligned"


def test_sharding_and_index(tmp_path):
    state = _state()
    shards = _write(tmp_path, state, max_shard_size=200)
    n = len(shards)
    assert n > 2
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state.values())
    assert set(index["weight_map"]) == set(state)
    for name, fname in index["weight_map"].items():
        assert name in load_file(tmp_path / fname)
    big = 33 * 7 * 2  # a.weight alone is larger than the limit: a shard of its own
    assert any(s.data_size == big and len(s.tensors) == 1 for s in shards)
    assert all(s.data_size <= 200 or len(s.tensors) == 1 for s in shards)
    assert model_weight_files(tmp_path) == [tmp_path / f for f in names]


def test_single_shard_is_model_safetensors(tmp_path):
    _write(tmp_path, _state(), 10**9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_group_starts_a_shard_of_its_own():
    """`group` (a state's name) starts a new shard where it changes; the size limit still splits
    within a group."""
    from pathlib import Path

    tensors = [TensorInfo(f"{g}/{n}", Path(), "F32", (10,)) for g in ("e1", "e2") for n in ("a", "b", "c")]
    by_state = lambda t: t.name.split("/")[0]  # noqa: E731
    names = [[t.name for t in s.tensors] for s in plan_shards(tensors, 10**9, group=by_state)]
    assert names == [["e1/a", "e1/b", "e1/c"], ["e2/a", "e2/b", "e2/c"]]
    names = [[t.name for t in s.tensors] for s in plan_shards(tensors, 80, group=by_state)]  # 2 per shard
    assert names == [["e1/a", "e1/b"], ["e1/c"], ["e2/a", "e2/b"], ["e2/c"]]
    assert [[t.name for t in s.tensors] for s in plan_shards(tensors, 10**9)] == [[t.name for t in tensors]]


def test_reader_slices_match(tmp_path):
    state = {"w": torch.randn(10, 3).bfloat16(), "s": torch.tensor(2.0)}
    save_file(state, tmp_path / "model.safetensors")
    index = index_model(tmp_path, model_weight_files(tmp_path))
    assert index.tensors["w"].shape == (10, 3) and index.tensors["w"].dtype == "BF16"
    with ChunkReader(index) as reader:
        assert torch.equal(reader.read("w", 3, 7), state["w"][3:7])
        assert torch.equal(reader.read("w", 0, 10), state["w"])
        assert torch.equal(reader.read("s", 0, 1), state["s"])


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda b: b[:-3], "truncated"),
        (lambda b: b[:5], "not a safetensors file"),
        (lambda b: struct.pack("<Q", 10**7) + b[8:], "corrupt or truncated"),
        (lambda b: b[:8] + b"{nonsense" + b[17:], "not valid JSON"),
    ],
)
def test_corrupt_files_name_the_file(tmp_path, damage, match):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(4, 4)}, path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(InputError, match=match) as err:
        read_header(path)
    assert str(path) in str(err.value)
