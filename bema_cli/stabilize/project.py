"""Before `bema stabilize` reads a checkpoint: its peak memory and wall time, projected from the
plan's headers and a half-second probe of this machine's read, compute and write speeds.

The model is the pass's own shape (unit.py): reads and compute run in the main thread, writes in
the write-behind thread beside them, the outputs' and, during each unit's last step, the unit's
rows of the new state (its float32 recurrences, as large as an output or two), so
wall >= start-up + max(read + compute, write + state). But every part is CPU work (copies, the
arithmetic, the kernel's I/O): on C cores the parts overlap at most C/2-fold. On a 2-core VM the
main thread's stages (waits for the writer included) sum to the wall time (docs/performance.md).
Writes, the state's too, go past the page cache (io/writer.py, O_DIRECT) at the disk's own speed
(the probe's O_DIRECT write); with BEMA_DIRECT_IO=0 through the page cache until the kernel's
dirty limit (vm.dirty_ratio of the available memory), then at the disk's speed. Compute counts
element passes: per step, each read element is cast and checked (2), advanced once per state that
takes the step, and each written output costs ~3 passes (estimate, cast, hand-off).
"""

from __future__ import annotations

import os
from pathlib import Path

from bema_cli.io.direct import direct_io
from bema_cli.io.probe import probe
from bema_cli.io.safetensors import FLOATING
from bema_cli.machine import available_memory

RUNTIME_BYTES = 400 << 20  # Python, torch and bema before the first unit: measured ~330-380 MB RSS
START_SECONDS = 1.5  # interpreter, torch import, discovery
PASSES_READ, PASSES_OUTPUT = 2, 3


def dirty_limit() -> int:
    """Bytes the kernel lets sit dirty before it throttles writers to the disk's speed."""
    try:
        ratio = int(Path("/proc/sys/vm/dirty_ratio").read_text()) / 100
    except (OSError, ValueError):
        ratio = 0.2
    return int(ratio * available_memory())


def peak_memory(plan, opts) -> int:
    """Runtime + the largest unit's theta0, the previous checkpoint (the motion's, motion.py) and the
    states (full size) + block buffers and the write pool + the two staging chunks of each file
    written past the page cache at once (io/direct.py)."""
    from bema_cli.io.direct import CHUNK
    from bema_cli.io.read_ahead import ahead_blocks
    from bema_cli.io.safetensors import DTYPES, TAG_OF
    from bema_cli.io.write_behind import DEPTH
    from bema_cli.recurrence import STATE_TENSORS
    from bema_cli.stabilize import state_store

    acc = DTYPES[TAG_OF[opts.accum_dtype]][1]
    unit = max((sum(p.hi - p.lo for p in u) for u in plan.units), default=0)
    states = sum(t.ring if t.window else len(STATE_TENSORS[t.method]) for t in plan.tracks)
    blocks = (6 + 2 * DEPTH + ahead_blocks(plan.readers)) * plan.block * acc  # theta_s, drift, out,
    # scratch; the pool per dtype; the blocks read ahead
    files = max((sum(1 for r in plan.runs if step in r.out_steps) for step in plan.read_steps), default=0)
    files += len(state_store.folders(plan, opts))
    staging = 2 * CHUNK * files if direct_io() else 0
    return RUNTIME_BYTES + unit * acc * (2 + states) + blocks + staging


def seconds(plan, read_bytes: int, written_bytes: int, speeds: dict, state_bytes: int = 0) -> dict:
    """The projected wall time, and its parts. `state_bytes`, the state folders this call writes,
    go out from the write-behind thread with the outputs (unit.py)."""
    numel = sum(t.numel for t in plan.out_tensors if t.dtype in FLOATING)
    passes = 0
    for step in plan.read_steps:
        advancing = sum(1 for t in plan.tracks if t.advances(step))
        outputs = sum(1 for r in plan.runs if step in r.out_steps)
        passes += numel * (PASSES_READ + advancing + PASSES_OUTPUT * outputs)
    read = read_bytes / speeds["read"]
    compute = passes / speeds["compute"]
    write, state = _write_seconds(written_bytes + state_bytes, speeds), 0.0
    if write and state_bytes:
        state = write * state_bytes / (written_bytes + state_bytes)
        write -= state
    overlap = max(1.0, len(os.sched_getaffinity(0)) / 2)
    main = read + compute  # the main thread's share; the writes run beside it
    return {
        "seconds": START_SECONDS + max(main, write + state, (main + write + state) / overlap),
        "read": read,
        "compute": compute,
        "write": write,
        "state": state,
    }


def _write_seconds(nbytes: int, speeds: dict) -> float:
    """Seconds to write `nbytes` as the writer does: past the page cache at the disk's speed, or with
    BEMA_DIRECT_IO=0 at the page cache's speed up to the kernel's dirty limit, then the disk's."""
    if direct_io():
        return nbytes / speeds["write_disk"]
    limit = dirty_limit()
    return min(nbytes, limit) / speeds["write_cache"] + max(0, nbytes - limit) / speeds["write_disk"]


def probe_sample(plan) -> Path | None:
    """A safetensors file of the run for the read probe (the first checkpoint's, else the base's);
    None for other formats (then only memory is projected)."""
    folders = [c.path for c in plan.checkpoints[:1]] + [plan.base_index.folder]
    return next((f for d in folders for f in sorted(Path(d).glob("*.safetensors"))), None)


def project(plan, opts, read_bytes: int, written_bytes: int, out_dir: Path) -> dict:
    """The --json `projection`: peak memory, wall time, its parts and the probe's speeds."""
    sample = probe_sample(plan)
    if sample is None:
        return {"peak_memory_bytes": peak_memory(plan, opts)}
    from bema_cli.stabilize import state_store

    speeds, state_bytes = probe(sample, out_dir), state_store.written_bytes(plan, opts)
    parts = seconds(plan, read_bytes, written_bytes, speeds, state_bytes)
    return {
        "peak_memory_bytes": peak_memory(plan, opts),
        "seconds": round(parts.pop("seconds"), 1),
        "parts_seconds": {k: round(v, 1) for k, v in parts.items()},
        "state_bytes": state_bytes,
        "speeds": {k: round(v) for k, v in speeds.items()},
    }


def projection_line(p: dict) -> str:
    """The one line a stabilize or sweep run starts with (on a terminal): peak memory, wall time
    and its parts when the probe ran."""
    from bema_cli import output

    when = f", ~{p['seconds']:.0f} s" if p.get("seconds") is not None else ""
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in p.get("parts_seconds", {}).items())
    return (
        f"projected: peak memory {output.size(p['peak_memory_bytes'])}{when}"
        f"{f' ({parts})' if parts else ''} (this machine's probe; --json: projection)"
    )


CUDA_START_SECONDS = 1.0  # CUDA's context, the pinned pool and ring, the streams: seen 0.5-1.5 s
GPU_MARGIN = 0.9  # the GPU is chosen only when projected at least 10% faster: never the slower one


def choose_device(plan, opts, projection: dict, read_bytes: int, written_bytes: int) -> dict:
    """`--device auto` for a stabilize written to disk: the device whose projected wall time is the
    shorter, from the work per byte (element passes per step: the grid's distinct states and outputs)
    and this machine's probe (disk, host<->device copies, both devices' arithmetic). The GPU moves
    every read byte in and every written byte out over PCIe, so a small grid on a many-core machine
    stays on the CPU; a grid of many states is arithmetic the GPU does ~100x faster."""
    from bema_cli.machine import cuda_present, gpu_speeds

    asked = opts.device
    if asked != "auto":
        return {"asked": asked, "device": asked, "reason": "--device " + asked}
    if not cuda_present():
        return {"asked": "auto", "device": "cpu", "reason": "no CUDA device"}
    parts = projection.get("parts_seconds")
    if not parts:  # another format than safetensors: no probe of its reads
        return {"asked": "auto", "device": "cuda", "reason": "no speed probe for this input format"}
    gpu = gpu_speeds()
    cpu_s = projection["seconds"]
    passes = parts["compute"] * projection["speeds"]["compute"]
    state = projection.get("state_bytes", 0)
    copies = read_bytes / gpu["h2d"] + (written_bytes + state) / gpu["d2h"]
    main = parts["read"] + read_bytes / gpu["h2d"] + passes / gpu["compute"]
    writer = parts["write"] + parts["state"] + (written_bytes + state) / gpu["d2h"]
    gpu_s = START_SECONDS + CUDA_START_SECONDS + max(main, writer)
    device = "cuda" if gpu_s < GPU_MARGIN * cpu_s else "cpu"
    reason = (
        f"projected cpu {cpu_s:.1f} s (arithmetic {parts['compute']:.1f} s), cuda {gpu_s:.1f} s "
        f"(copies {copies:.1f} s)"
    )
    return {
        "asked": "auto",
        "device": device,
        "reason": reason,
        "cpu_seconds": round(cpu_s, 2),
        "cuda_seconds": round(gpu_s, 2),
        "gpu_speeds": {k: round(v) for k, v in gpu.items()},
    }
