"""torch.distributed.checkpoint (DCP) folders, e.g. the HF Trainer's FSDP `pytorch_model_fsdp_0/`.

A DCP folder holds `.metadata` (a pickle: every tensor's shape, dtype and the chunks it
was saved in, one per rank) and `__<rank>_<n>.distcp` files. We read it in one process,
with no process group: the rows [a, b) of one tensor are planned against the saved
chunks with DCP's own resharding helper, and only the overlapping chunks are read.

`.metadata` is unpickled with an allowlist of DCP's metadata classes (torch's own reader
uses plain `pickle.load`, which would run whatever a hostile file asks); chunk data goes
through `torch.load(weights_only=True)` as in torch. Accelerate saves `{"model": state_dict}`,
so names carry a `model.` prefix, stripped where that matches the base model's names.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import is_regular
from bema_cli.io.safetensors import ModelIndex, TensorInfo
from bema_cli.io.torchbin import dtype_tag
from bema_cli.io.torchzip import (
    FileWindow,
    contiguous_strides,
    data_records,
    read_rows,
    release_freed_memory,
    tensor_layout,
)

METADATA = ".metadata"
ACCELERATE_PREFIX = "model."
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch._utils": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata objects, torch.Size and dtypes; any other global is refused."""

    def find_class(self, module: str, name: str):
        import torch

        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


def find_dcp_dir(folder: Path) -> Path | None:
    """The DCP folder of a checkpoint: the folder itself or a `pytorch_model_fsdp_*` child; None if neither."""
    if is_regular(folder / METADATA) or any(folder.glob("*.distcp")):
        return folder
    found = sorted(p for p in folder.glob("pytorch_model_fsdp_*") if p.is_dir())
    if len(found) > 1:
        raise InputError(f"{folder}: several DCP model folders ({', '.join(p.name for p in found)})")
    return found[0] if found else None


def read_metadata(dcp_dir: Path):
    path = dcp_dir / METADATA
    if not is_regular(path):
        raise InputError(f"{dcp_dir}: DCP checkpoint without {METADATA} (incomplete save?)")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
        md.state_dict_metadata, md.storage_data  # noqa: B018 - both must exist
    except pickle.UnpicklingError as exc:
        raise InputError(f"{path}: refused: not DCP metadata, nothing of it was run ({exc})") from None
    except Exception as exc:
        raise InputError(f"{path}: corrupt DCP metadata ({type(exc).__name__}: {exc})") from None
    return md


class DcpIndex(ModelIndex):
    dcp_dir: Path
    metadata: object
    fqns: dict[str, str]  # our name -> DCP key

    def open(self) -> DcpReader:
        return DcpReader(self)


def _names(keys: list[str], like: set[str] | None) -> dict[str, str]:
    """DCP keys -> model names: drop accelerate's `model.` prefix when every key has it and the
    stripped names match the base model at least as well as the raw ones."""
    if not keys or not all(k.startswith(ACCELERATE_PREFIX) for k in keys):
        return {k: k for k in keys}
    stripped = {k[len(ACCELERATE_PREFIX) :]: k for k in keys}
    if like is not None and len(like & set(keys)) > len(like & set(stripped)):
        return {k: k for k in keys}
    return stripped


def index_dcp(folder: Path, dcp_dir: Path, like: set[str] | None = None) -> DcpIndex:
    """Every tensor of a DCP checkpoint, checked against the files' sizes (no tensor data read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_metadata(dcp_dir)
    keys = [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    sizes: dict[str, int] = {}
    for where, info in md.storage_data.items():
        if where.fqn not in md.state_dict_metadata:
            continue
        file = dcp_dir / info.relative_path
        if info.relative_path not in sizes:
            if Path(info.relative_path).name != info.relative_path or not is_regular(file):
                raise InputError(
                    f"{dcp_dir}: {METADATA} names data file {info.relative_path!r}, which is missing"
                )
            sizes[info.relative_path] = file.stat().st_size
        if info.offset + info.length > sizes[info.relative_path]:
            raise InputError(
                f"{file}: truncated DCP data file ({sizes[info.relative_path]} bytes, "
                f"tensor {where.fqn!r} needs {info.offset + info.length})"
            )
    tensors: dict[str, TensorInfo] = {}
    fqns = _names(keys, like)
    for name, key in fqns.items():
        meta = md.state_dict_metadata[key]
        tensors[name] = TensorInfo(
            name, dcp_dir, dtype_tag(dcp_dir, key, meta.properties.dtype), tuple(meta.size)
        )
    index = DcpIndex(folder, tensors)
    index.dcp_dir, index.metadata, index.fqns = dcp_dir, md, fqns
    return index


class _Rows:
    """The minimal LoadPlanner that FileSystemReader.read_data needs: copy into our row buffer."""

    def __init__(self, dest):
        self.dest = dest

    def resolve_tensor(self, item):
        from torch.distributed._shard._utils import narrow_tensor_by_index  # the helper torch itself uses

        return narrow_tensor_by_index(self.dest, item.dest_offsets, item.lengths)

    def commit_tensor(self, item, tensor) -> None:
        pass

    def load_bytes(self, item, value) -> None:  # only tensors are ever planned
        raise InputError(f"unexpected non-tensor item {item.dest_index.fqn!r}")


class DcpReader:
    """Rows [start, stop) of DCP tensors, read from the saved chunks that overlap them.

    Chunks split along dim 0 only (FSDP's layout) are read in place: each chunk is a torch.save
    zip whose tensor bytes are stored uncompressed, so the rows are one pread at a known offset
    (found once per chunk from the zip directory and a data-free `map_location="meta"` load).
    Anything else (tensor-parallel splits, transformed streams) goes through DCP's own reader,
    which loads whole chunks.
    """

    def __init__(self, index: DcpIndex):
        self.index = index
        self._storage = None

    def __enter__(self) -> DcpReader:
        return self

    def __exit__(self, *exc) -> None:
        self._storage = None
        release_freed_memory()

    def read(self, name: str, start: int, stop: int):
        import torch

        info, key = self.index.tensors[name], self.index.fqns[name]
        meta = self.index.metadata.state_dict_metadata[key]
        shape = list(info.shape)
        if shape:
            shape[0] = stop - start
        dest = torch.empty(shape, dtype=meta.properties.dtype)
        try:
            if not (shape and self._read_rows(key, meta, start, stop, dest)):
                self._read_planned(key, meta, start, dest)
        except InputError:
            raise
        except Exception as exc:  # truncated or corrupt chunk data
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"{self.index.dcp_dir}: cannot read tensor {key!r} ({first})") from None
        return dest

    def _read_rows(self, key: str, meta, start: int, stop: int, dest) -> bool:
        """Fill dest by preads from dim-0 chunks; False (nothing read) when a chunk is not in that layout."""
        full = tuple(meta.size)[1:]
        spans = []
        for chunk in meta.chunks:
            lo, n = chunk.offsets[0], chunk.sizes[0]
            if tuple(chunk.sizes)[1:] != full or any(chunk.offsets[1:]):
                return False
            if lo < stop and lo + n > start:
                where = _chunk_record(self.index, key, chunk)
                if where is None:
                    return False
                spans.append((max(lo, start), min(lo + n, stop), lo, where))
        if sum(b - a for a, b, _, _ in spans) != stop - start:
            raise InputError(f"{self.index.dcp_dir}: tensor {key!r} is not covered by its saved chunks")
        row = dest[0].numel() * dest.element_size() if dest.shape[0] else 0
        for a, b, lo, (path, offset) in spans:
            read_rows(path, offset + (a - lo) * row, dest[a - start : b - start])
        return True

    def _read_planned(self, key: str, meta, start: int, dest) -> None:
        """DCP's own resharding planner and FileSystemReader (whole chunks, torch.load weights_only)."""
        import torch
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        offsets = [start] + [0] * (dest.dim() - 1) if dest.dim() else []
        wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
        items = create_read_items_for_chunk_list(key, meta, [wanted])
        if sum(int(torch.Size(it.lengths).numel()) for it in items) < dest.numel():
            raise InputError(f"{self.index.dcp_dir}: tensor {key!r} is not covered by its saved chunks")
        if self._storage is None:
            self._storage = FileSystemReader(str(self.index.dcp_dir))
            self._storage.set_up_storage_reader(self.index.metadata, True)
        self._storage.read_data(LoadPlan(items), _Rows(dest)).wait()


def _chunk_record(index: DcpIndex, key: str, chunk) -> tuple[Path, int] | None:
    """(file, byte offset of the chunk's first element) when the chunk is a plain little-endian,
    uncompressed, contiguous torch.save record; None otherwise. Cached on the index."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    cache = index.__dict__.setdefault("_records", {})
    where = (key, tuple(chunk.offsets))
    if where not in cache:
        meta = index.metadata.state_dict_metadata[key]
        info = index.metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        cache[where] = (
            None if info.transform_descriptors else _locate(index.dcp_dir / info.relative_path, info, meta)
        )
    return cache[where]


def _locate(path: Path, info, meta) -> tuple[Path, int] | None:
    """(file, offset) of a chunk's first element when its record is plain and its tensor contiguous."""
    with open(path, "rb") as f:
        chunk = FileWindow(f, info.offset, info.length)
        records = data_records(chunk)
        layout = tensor_layout(chunk) if records is not None and len(records) == 1 else None
    if layout is None:
        return None  # not the plain layout: the planned path decides (and names any corruption)
    ((data, size),) = records.values()
    offset, shape, stride = layout
    itemsize = meta.properties.dtype.itemsize
    nbytes = itemsize * math.prod(shape)
    if stride != contiguous_strides(shape) and nbytes:
        return None
    if offset * itemsize + nbytes > size:
        return None
    return path, info.offset + data + offset * itemsize
