"""What engines cost on this machine, measured: the floors under the projections of `bema sweep`
and `bema ship --dry-run` (sweep/project.py).

The projection counts arithmetic and bytes. On a small model an engine's start, a swap, a forward
and a decode step cost what the framework costs (vLLM's scheduler, tokenising, the weights'
loading path), which no count of FLOPs sees: a TRL user's dry run said 14 s of a ship that took
85-165 s. So every command that runs an engine keeps, per backend and machine, what it measured
(the engine's start, a swap, a held-out record's forward, a decode step), and a projection takes
each as a floor; where this machine has measured nothing yet, the projection says so.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

FILE = "timings.json"
_seen: dict[str, list[float]] = {}  # this process's seconds per unit, a call each: loss_record, decode_step


def note(kind: str, seconds: float, units: int) -> None:
    """A timed call of `units` units (records of a loss call, decode steps of a generate call)."""
    if units > 0 and seconds > 0:
        _seen.setdefault(kind, []).append(seconds / units)


def save(backend: str, stages: dict) -> None:
    """What this command measured, kept for this machine: per kind the median call's seconds per
    unit (a call's cost as the command met it; the fastest call alone is a best case it rarely
    met), the engine's start and a swap from the command's stages; across commands the
    lowest, a floor. Best effort: a cache that cannot be written costs the next projection its
    floors, never the command."""
    got = {kind: statistics.median(per) for kind, per in _seen.items()}
    _seen.clear()
    for kind in ("engine_start", "swap"):
        s = stages.get(kind)
        if s and s.get("count"):
            got[kind] = s["seconds"] / s["count"]
    if not got:
        return
    path = _path()
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
        entry = doc.setdefault(_key(backend), {})
        for kind, per in got.items():
            entry[kind] = round(min(entry.get(kind, float("inf")), per), 6)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except (OSError, ValueError, AttributeError, TypeError):
        pass


def floors(backend: str) -> dict[str, float]:
    """{kind: seconds per unit} this machine measured with `backend` ({} when none)."""
    try:
        entry = json.loads(_path().read_text()).get(_key(backend), {})
        return {k: float(v) for k, v in entry.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _key(backend: str) -> str:
    """A backend on a machine: numbers from another CPU or a GPU are not this one's floors."""
    import torch

    from bema_cli.machine import cpu_model

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return f"{backend} | {device} | {cpu_model()} | {os.cpu_count()} cores"


def _path() -> Path:
    """$BEMA_CACHE/timings.json, else the user's cache folder's bema/timings.json."""
    folder = os.environ.get("BEMA_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "bema"
    return Path(folder).expanduser() / FILE
