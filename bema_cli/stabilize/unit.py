"""One work unit of `bema stabilize`, start to end: the fused, cache-blocked pass over the trajectory.

A unit is a group of tensors (or a row range of one) whose working set fits --max-memory
(plan.py). `process_unit` reads its rows of theta0 once, then for each checkpoint walks the
unit in blocks of plan.block elements: read (safetensors: one pread per tensor part, straight into
the block buffer), finite check, state updates, outputs, all on a block that stays in the CPU
cache, whose output bytes then go to a background writer thread (io/write_behind.py) while
the next block is computed. On a GPU the same pipeline runs with larger blocks: the reader threads
fill pinned buffers, and the copies to and from the device are io/transfer.py's (its only CUDA
calls). The math is recurrence.py's; the engine (engine.py) plans, holds files and commits.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from functools import partial
from time import perf_counter

from bema_cli import stages
from bema_cli.io.read_ahead import ReadAhead
from bema_cli.io.reader import streams
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF
from bema_cli.io.write_behind import WriteBehind
from bema_cli.io.writer import ShardedWriter, tensor_bytes
from bema_cli.recurrence import BUFFERED, estimate, needs_drift, update
from bema_cli.stabilize import state_store
from bema_cli.stabilize.blocks import check_finite, first_element, load, read_raw
from bema_cli.stabilize.motion import UnitMotion
from bema_cli.stabilize.plan import Options, Piece, Plan
from bema_cli.stabilize.workspace import Workspace

Outputs = dict[tuple[str, int], ShardedWriter]  # (run name, step) -> the writer of that output folder


def _blocks(unit: list[Piece], size: int, block: int) -> list[tuple[int, int, list[tuple[Piece, int, int]]]]:
    """Cut a unit's flat float range [0, size) into blocks of `block` elements: (lo, hi, the float
    pieces' parts in the block as (piece, a, b) with lo <= a < b <= hi)."""
    floats = [p for p in unit if p.info.dtype in FLOATING and p.hi > p.lo]
    out = []
    for lo in range(0, size, block):
        hi = min(lo + block, size)
        out.append((lo, hi, [(p, max(p.lo, lo), min(p.hi, hi)) for p in floats if p.lo < hi and p.hi > lo]))
    return out


def _emit(
    ws: Workspace, wb: WriteBehind, writer: ShardedWriter, parts: list, lo: int, result, out_dtypes: dict
):
    """Hand one block of an output (`result` holds flat[lo:hi]) to the write-behind thread: cast into
    a pool buffer per output dtype (none when `result` is one already), one pwrite per tensor part."""
    import torch

    tags = {out_dtypes[p.info.name] for p, _, _ in parts}
    for tag in sorted(tags):
        dtype = getattr(torch, DTYPES[tag][0])
        data, ready = result, None
        if not wb.owns(result, dtype):
            data = wb.buffer(dtype, result.numel())
            ready = ws.transfers.to_host(result, data)
        size = DTYPES[tag][1]
        writes = [
            _part_write(writer, p.info.name, first_element(p, a) * size, a - lo, b - lo)
            for p, a, b in parts
            if out_dtypes[p.info.name] == tag
        ]
        wb.put(data, writes, ready=ready)


def _emit_state(ws: Workspace, wb: WriteBehind, writer: ShardedWriter, name: str, parts: list, lo: int, rows):
    """Hand one block of a state tensor (`rows` holds flat[lo:hi]) to the write-behind thread, as
    `_emit` does an output's: the state files take the accumulation dtype as computed."""
    data = wb.buffer(rows.dtype, rows.numel())
    ready = ws.transfers.to_host(rows, data)
    size = rows.element_size()
    writes = [
        _part_write(writer, f"{name}/{p.info.name}", first_element(p, a) * size, a - lo, b - lo)
        for p, a, b in parts
    ]
    wb.put(data, writes, stage="state", ready=ready)


def _part_write(writer: ShardedWriter, name: str, at: int, a: int, b: int):
    return lambda data: writer.write(name, at, tensor_bytes(data[a:b]))


def _write_raw(writer: ShardedWriter, unit: list[Piece], raw: dict) -> None:
    """Non-float tensors (ids, masks) are copied from theta_s as read."""
    for p in unit:
        if p.info.name in raw:
            writer.write(p.info.name, p.start * p.info.row_bytes, tensor_bytes(raw[p.info.name]))


def unit_bytes(unit: list[Piece]) -> int:
    """Bytes of one checkpoint that a unit covers (the progress measure)."""
    return sum(p.info.row_bytes * (p.stop - p.start) for p in unit)


def read_ranges(plan: Plan) -> list:
    """(file, start, end) byte ranges of the safetensors inputs in the order the pass reads them:
    unit by unit, theta0's rows (the base's) then each step's (io/prefetch.py hints them ahead)."""
    ranges = []
    for unit in plan.units:
        indexes = [plan.base_index] if plan.theta0_index is plan.base_index else []
        for index in indexes + [plan.indexes[step] for step in plan.read_steps]:
            for p in unit:
                info = index.tensors.get(p.info.name)
                if info is not None and info.offset >= 0:  # safetensors: other formats have no offsets
                    ranges.append(
                        (
                            info.file,
                            info.offset + p.start * info.row_bytes,
                            info.offset + p.stop * info.row_bytes,
                        )
                    )
    return ranges


def _stream_in(ws: Workspace, reader, blocks: list, flat, readers: int) -> None:
    """A unit's float pieces into `flat` through the read-ahead ring and `to_device` (a GPU's theta0:
    pinned buffers and a cast on the device, never a cross-device cast on the CPU)."""
    ahead = ReadAhead(reader, blocks, first_element, readers, ws.transfers, ahead=_ahead(ws, readers))
    try:
        for i, parts in enumerate(ahead):
            ahead.release(i, ws.transfers.to_device(parts, flat, 0))
    finally:
        ahead.close()


def _ahead(ws: Workspace, readers: int) -> int | None:
    """Blocks read ahead: the CPU's reservation (read_ahead.ahead_blocks); on a GPU at least two, so
    a block is read while the one before it crosses to the device."""
    return max(2, readers + 1) if ws.transfers.staged else None


def _check_sums(index, reader, blocks: list, sums, acc) -> None:
    """A GPU's finite check, once per step: the block sums (float64: a sum of float32 values cannot
    overflow it) read back together; a block whose sum is not finite is read again on the CPU and
    checked exactly, so the error names its tensor as the CPU path's does."""
    import torch

    for k, total in enumerate(sums.tolist()):
        if not math.isfinite(total):
            lo, hi, parts = blocks[k]
            again = torch.empty(hi - lo, dtype=acc)
            for p, a, b in parts:
                reader.read_elements_into(p.info.name, first_element(p, a), b - a, again[a - lo : b - lo])
            check_finite(index, [p for p, _, _ in parts], again, 0, hi - lo, lo)


def process_unit(plan: Plan, opts: Options, unit: list[Piece], outputs: Outputs, ws: Workspace):
    """One work unit, start to end: read its slices of theta0 and of every checkpoint, run the
    recurrences, write its bytes at their final offsets in the pre-created `outputs`.

    Self-contained and idempotent (the same bytes land at the same offsets on a re-run), so any
    executor may run units in any order, in any process, and retry one that was lost.

    Per step, the finite check, the read (where the reader can read any element range: safetensors),
    every state update, every output and its write run block by block (ws.block elements): a block's
    buffers stay in the CPU cache across those passes instead of streaming the whole unit through
    memory once per pass. Other formats are read whole into `theta` first. Every update is
    elementwise, so the bytes are those of whole-unit passes (docs/design.md, "The fused pass").
    On a GPU the stages are the same; the reads always go through the pinned read-ahead ring, the
    finite check reads its block sums back once per step, and nothing waits for the device but
    the write-behind thread, on each block's copy event (docs/design.md, "The GPU path").
    Run inside `ws.batch()`: a unit's writes, its files' closes included, finish in the writer's
    thread while the next unit reads; the batch's end waits for them.
    """
    import torch

    gpu = ws.transfers.staged  # a GPU, or its pipeline on the CPU (io/transfer.py)
    check = not opts.allow_nonfinite
    out_dtypes = {t.name: t.dtype for t in plan.out_tensors}
    tau = plan.runs[0].schedule.tau  # shared by the grid: burn-in happens at the same steps for all runs
    size = max((p.hi for p in unit), default=0)
    block = ws.block
    blocks = _blocks(unit, size, max(block, 1))
    theta0, scratch = ws.view("theta0", size), ws.scratch(unit)
    acc_tag = TAG_OF[str(ws.acc).removeprefix("torch.")]
    direct = not gpu and all(out_dtypes[p.info.name] == acc_tag for p in unit if p.info.dtype in FLOATING)

    def load_theta0(reader, u, flat):
        if gpu and streams(reader):
            _stream_in(ws, reader, blocks, flat, plan.readers)
        else:
            load(reader, u, flat, scratch)
        if check:
            check_finite(reader.index, u, flat, 0, size)

    with stages.stage("read", unit_bytes(unit) if plan.theta0_index is not None else 0):
        state_store.read_theta0(plan, unit, theta0, load_theta0)
    # one Stabilizer per track (runs sharing a state, e.g. ema and bema at one kappa): from theta0,
    # or continued from OUT's persistent state
    # (no per-unit clones: the states live in the workspace's reused buffers)
    stabs = state_store.start_unit(plan, unit, theta0, lambda key: ws.view(key, size), scratch)
    track_of = {r.name: i for i, t in enumerate(plan.tracks) for r in t.runs}
    last = plan.read_steps[-1] if plan.read_steps else None
    # how far each checkpoint moved from the previous one (motion.py); a fresh run's first from theta0
    fresh = plan.theta0_index is not None and plan.read_steps[:1] == [plan.checkpoints[0].step]
    motion = UnitMotion(ws.view("prev", size), fresh)
    if fresh:
        motion.prev.copy_(theta0)
    for step in plan.read_steps:
        index = plan.indexes[step]
        advancing, after = state_store.step_updates(plan, stabs, step)
        writing = [(run, outputs[run.name, step]) for run in plan.runs if (run.name, step) in outputs]
        # the unit's rows of the new state, final once a block has taken the last step: they go out
        # with the outputs, from the write-behind thread, rather than after the pass from this one
        saving = state_store.saved_states(plan, stabs, theta0) if step == last else []
        wb = ws.write_behind(block)
        with index.open() as reader, ExitStack() as held:
            raw = read_raw(reader, unit)
            for writer in [w for _, w in writing] + [w for w, _, _ in saving]:
                # files open for the step's many block writes, then closed: both in the writer's
                # thread, after its blocks, so this thread goes on to the next step meanwhile
                wb.call(writer.hold)
                held.callback(wb.call, writer.release, partial(writer.release, flush=False))
            streamed = streams(reader)
            t_unit, t_read = perf_counter(), 0.0
            if not streamed:
                theta = ws.view("theta", size)
                load(reader, unit, theta, scratch)
                t_read = perf_counter() - t_unit
            ahead = (
                ReadAhead(reader, blocks, first_element, plan.readers, ws.transfers, _ahead(ws, plan.readers))
                if streamed and (plan.readers > 1 or gpu)
                else None
            )
            if ahead is not None:
                held.callback(ahead.close)
            fetched = iter(ahead) if ahead else None
            sums = ws.transfers.sums(len(blocks)) if gpu and check and streamed else None
            wait0 = wb.waited
            for k, (lo, hi, parts) in enumerate(blocks):
                if streamed:
                    th = ws.block_view("theta", hi - lo)
                    t = perf_counter()
                    if fetched is None:
                        for p, a, b in parts:
                            first = first_element(p, a)
                            reader.read_elements_into(p.info.name, first, b - a, th[a - lo : b - lo], scratch)
                    else:  # read by the read-ahead threads; cast here, as read_elements_into does
                        ahead.release(k, ws.transfers.to_device(next(fetched), th, lo))
                    t_read += perf_counter() - t
                else:
                    th = theta[lo:hi]
                if sums is not None:
                    sums[k] = th.sum(dtype=torch.float64)  # checked after the block loop
                elif check:
                    check_finite(index, [p for p, _, _ in parts], th, 0, hi - lo, lo)
                motion.block(step, lo, hi, parts, th, ws.block_view("motion", hi - lo))
                if step <= tau:
                    theta0[lo:hi].copy_(th)  # burn-in: theta0 = theta_s, held in its own buffer
                update(advancing, lo, hi, th, theta0[lo:hi])
                drift = None  # theta_s - theta0, computed once per block for every bema output
                for run, writer in writing:  # the output is only computed where it is written
                    event = run.events[step]
                    method = run.schedule.method
                    if drift is None and needs_drift(run.schedule, event):
                        drift = torch.sub(th, theta0[lo:hi], out=ws.block_view("drift", hi - lo))
                    out = None
                    if method in BUFFERED:  # computed straight into a write buffer when it can
                        out = wb.buffer(ws.acc, hi - lo) if direct else ws.block_view("out", hi - lo)
                    part = stabs[track_of[run.name]].view(lo, hi)
                    result = estimate(part, run.schedule, event, th, drift, out)
                    _emit(ws, wb, writer, parts, lo, result, out_dtypes)
                    if out is not None and result is not out and direct:
                        wb.release(out)  # a burn-in step returned theta_s instead
                update(after, lo, hi, th)
                for writer, names, tensors in saving:
                    for name, t in zip(names, tensors, strict=True):
                        _emit_state(ws, wb, writer, name, parts, lo, t[lo:hi])
            if sums is not None:  # an error drops the step's queued writes (the caller's batch)
                _check_sums(index, reader, blocks, sums, ws.acc)
            waited = wb.waited - wait0
            motion.end_step()
            stages.add("read", t_read, unit_bytes(unit))
            stages.add("compute", perf_counter() - t_unit - t_read - waited)
            for _, writer in writing:
                wb.call(partial(_write_raw, writer, unit, raw))
        del raw
    if last is None:  # no step read: the states (continued or fresh) are saved as they are
        state_store.end_unit(plan, unit, stabs, theta0)
    return motion.result()
