"""Reading a work unit's rows: the pieces a unit holds, read into flat buffers, checked for NaN/Inf.

Shared by stabilize's fused pass (unit.py) and the sweep's walk (sweep/walk.py).
"""

from __future__ import annotations

import math

from bema_cli.errors import InputError
from bema_cli.io.reader import TensorReader, read_into
from bema_cli.io.safetensors import FLOATING
from bema_cli.stabilize.plan import Piece


def load(reader: TensorReader, unit: list[Piece], flat, scratch=None) -> None:
    """Read one unit's float pieces into `flat` (a reused accum-dtype buffer)."""
    for p in unit:
        if p.info.dtype in FLOATING:
            read_into(reader, p.info.name, p.start, p.stop, flat[p.lo : p.hi], scratch)


def read_raw(reader: TensorReader, unit: list[Piece]) -> dict:
    """{name: rows} of the unit's non-float pieces (ids, masks: copied to the outputs as read)."""
    return {
        p.info.name: reader.read(p.info.name, p.start, p.stop) for p in unit if p.info.dtype not in FLOATING
    }


def first_element(p: Piece, a: int) -> int:
    """Element offset, within its (flattened) tensor, of position `a` of the unit's flat buffer."""
    return p.start * p.info.row_numel + (a - p.lo)


def check_finite(index, unit: list[Piece], flat, lo: int, hi: int, base: int = 0) -> None:
    """NaN/Inf in flat[lo:hi] stop the run, naming the tensor and its file (`index`'s). flat[0] is
    position `base` of the unit's flat buffer (a block read on its own).

    A sum is finite only if every term is (NaN/Inf propagate); one reduction is ~10x cheaper than
    isfinite(...).all(). On a non-finite sum (or an overflow) the exact per-tensor check decides.
    """
    import torch

    block = flat[lo:hi]
    if not block.numel() or math.isfinite(float(block.sum())) or bool(torch.isfinite(block).all()):
        return
    for p in unit:
        a, b = max(p.lo - base, lo), min(p.hi - base, hi)
        if a < b and not bool(torch.isfinite(flat[a:b]).all()):
            raise InputError(
                f"{index.tensors[p.info.name].file}: tensor {p.info.name!r} contains NaN or Inf "
                "(use --allow-nonfinite to proceed)"
            )
