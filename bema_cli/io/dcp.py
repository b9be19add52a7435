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

import pickle
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.io.safetensors import ModelIndex, TensorInfo
from bema_cli.io.torchbin import dtype_tag

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
    if (folder / METADATA).is_file() or any(folder.glob("*.distcp")):
        return folder
    found = sorted(p for p in folder.glob("pytorch_model_fsdp_*") if p.is_dir())
    if len(found) > 1:
        raise InputError(f"{folder}: several DCP model folders ({', '.join(p.name for p in found)})")
    return found[0] if found else None


def read_metadata(dcp_dir: Path):
    path = dcp_dir / METADATA
    if not path.is_file():
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
            if Path(info.relative_path).name != info.relative_path or not file.is_file():
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
    """Rows [start, stop) of DCP tensors, read chunk by overlapping chunk."""

    def __init__(self, index: DcpIndex):
        self.index = index
        self._storage = None

    def __enter__(self) -> DcpReader:
        return self

    def __exit__(self, *exc) -> None:
        self._storage = None

    def read(self, name: str, start: int, stop: int):
        import torch
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        info, key = self.index.tensors[name], self.index.fqns[name]
        meta = self.index.metadata.state_dict_metadata[key]
        shape = list(info.shape)
        if shape:
            shape[0] = stop - start
        offsets = [start] + [0] * (len(shape) - 1) if shape else []
        dest = torch.empty(shape, dtype=meta.properties.dtype)
        wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
        items = create_read_items_for_chunk_list(key, meta, [wanted])
        covered = sum(int(torch.Size(it.lengths).numel()) for it in items)
        if covered < dest.numel():
            raise InputError(f"{self.index.dcp_dir}: tensor {key!r} is not fully covered by its saved chunks")
        if self._storage is None:
            self._storage = FileSystemReader(str(self.index.dcp_dir))
            self._storage.set_up_storage_reader(self.index.metadata, True)
        try:
            self._storage.read_data(LoadPlan(items), _Rows(dest)).wait()
        except InputError:
            raise
        except Exception as exc:  # truncated or corrupt chunk data
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"{self.index.dcp_dir}: cannot read tensor {key!r} ({first})") from None
        return dest
