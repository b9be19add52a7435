"""`--lora-output adapter`: a stabilized delta per module, factorized back into a PEFT adapter.

The stabilized delta D of a module (a weighted sum of scale_s * B_s @ A_s) has rank at most
r times the number of averaged checkpoints, more than the training rank. The best rank-R
approximation in Frobenius norm is the truncated SVD D_R = U_R S_R V_R^T (Eckart-Young); its
relative error is sqrt(sum_{i>R} s_i^2 / sum_i s_i^2), recorded per module. With R >= rank(D)
it is exact. Factors are split evenly, B' = U_R sqrt(S_R / c), A' = sqrt(S_R / c) V_R^T, where c
is the scale PEFT applies at rank R, so that c * B' @ A' = D_R.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bema_cli import output
from bema_cli.io.lora import CONFIG_NAME, Adapter, scale_of
from bema_cli.io.safetensors import DTYPES, TensorInfo
from bema_cli.io.writer import ShardedWriter, plan_shards, tensor_bytes

ADAPTER_FILE = "adapter_model.safetensors"
WARN_ERROR = 1e-2  # relative Frobenius error above which the adapter output is flagged


def truncate(delta, rank: int):
    """(U_R sqrt(S_R), sqrt(S_R) V_R^T, relative Frobenius error) of the best rank-`rank` approximation."""
    import torch

    u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
    total = float((s * s).sum())
    rest = float((s[rank:] * s[rank:]).sum())
    err = math.sqrt(rest / total) if total > 0 else 0.0
    root = s[:rank].sqrt()
    left, right = u[:, :rank] * root, root[:, None] * vh[:rank]
    if left.shape[1] < rank:  # rank above min(out, in): pad with zero directions
        left = torch.nn.functional.pad(left, (0, rank - left.shape[1]))
        right = torch.nn.functional.pad(right, (0, 0, 0, rank - right.shape[0]))
    return left, right, err


def adapter_config(layout: Adapter, rank: int, base_source: str) -> dict:
    """The training adapter's config at the new uniform rank (patterns cleared: every module has rank R).
    Its base stays portable: a Hub id the user gave, else the training adapter's own
    base_model_name_or_path, else theta0's folder by name (never an absolute local path: a push
    publishes this file)."""
    from bema_cli.io.provenance import input_name

    given = layout.config.get("base_model_name_or_path")
    if Path(base_source).is_absolute():
        usable = isinstance(given, str) and given and not Path(given).is_absolute()
        base_source = given if usable else input_name(base_source)
    return {
        **layout.config,
        "r": rank,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "base_model_name_or_path": base_source,
    }


def write_adapter(
    folder: Path, deltas, layout: Adapter, rank: int, base_source: str, header: dict[str, str]
) -> dict[str, float]:
    """Turn the stabilized deltas (a reader of folder's delta tensors) into adapter_model.safetensors.

    Returns the relative truncation error per adapted module. One module's delta and its SVD are
    in memory at a time; tensors are streamed into the file as they are produced. `header`: the
    file's metadata, bema's provenance (`bema verify` rebuilds the adapter from it).
    """
    import torch

    scale = scale_of(layout.config, rank)
    infos, plan = [], {}
    for name, m in layout.modules.items():
        tag = layout.index.tensors[m.a_key].dtype
        rows, cols = deltas.index.tensors[name].shape
        out_dim, in_dim = (cols, rows) if m.transpose else (rows, cols)
        infos += [
            TensorInfo(m.b_key, None, tag, (out_dim, rank)),
            TensorInfo(m.a_key, None, tag, (rank, in_dim)),
        ]
    for name, key in layout.full.items():
        info = deltas.index.tensors[name]
        infos.append(TensorInfo(key, None, info.dtype, info.shape))
        plan[key] = name
    shard = plan_shards(infos, 1 << 62)[0]
    shard.filename = ADAPTER_FILE
    writer = ShardedWriter(folder, [shard], {**header, "bema_lora_rank": str(rank)}).open()
    errors = {}
    modules = output.track(
        layout.modules.items(), f"{folder.name}: rank-{rank} SVDs", len(layout.modules), "modules"
    )
    for name, m in modules:
        info = deltas.index.tensors[name]
        delta = deltas.read(name, 0, info.shape[0])
        ba = (delta.T if m.transpose else delta) / scale
        left, right, errors[name.removesuffix(".weight")] = truncate(ba, rank)
        dtype = getattr(torch, DTYPES[layout.index.tensors[m.a_key].dtype][0])
        writer.write(m.b_key, 0, tensor_bytes(left.to(dtype)))
        writer.write(m.a_key, 0, tensor_bytes(right.to(dtype)))
    for key, name in plan.items():
        info = deltas.index.tensors[name]
        writer.write(key, 0, tensor_bytes(deltas.read(name, 0, info.shape[0] if info.shape else 1)))
    writer.close()
    config = adapter_config(layout, rank, base_source)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return errors
