"""One work unit of `bema stabilize`, start to end: the fused, cache-blocked pass over the trajectory.

A unit is a group of tensors (or a row range of one) whose working set fits --max-memory
(plan.py). `process_unit` reads its rows of theta0 once, then for each checkpoint walks the
unit in blocks of plan.block elements: read (safetensors: one pread per tensor part, straight into
the block buffer), finite check, state updates, outputs, all on a block that stays in the CPU
cache, whose output bytes then go to a background writer thread (io/write_behind.py) while
the next block is computed. The math is recurrence.py's; the engine (engine.py) plans, holds
files and commits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from time import perf_counter

from bema_cli import stages
from bema_cli.errors import InputError, UsageError
from bema_cli.io.read_ahead import ReadAhead
from bema_cli.io.reader import TensorReader, read_into, streams
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF
from bema_cli.io.write_behind import WriteBehind
from bema_cli.io.writer import ShardedWriter, tensor_bytes
from bema_cli.recurrence import Window
from bema_cli.schedule import WINDOW_METHODS
from bema_cli.stabilize import state_store
from bema_cli.stabilize.plan import Options, Piece, Plan

Outputs = dict[tuple[str, int], ShardedWriter]  # (run name, step) -> the writer of that output folder
BUFFERED = ("bema", "dema", *WINDOW_METHODS)  # methods whose output is a new tensor (not a state)


def torch_device(name: str, need_torch: bool = True):
    """The torch device of --device; with need_torch False (a dry run) only the name is checked
    unless it says cuda, so a dry run does not pay torch's ~1-2 s import."""
    if name not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device: choose auto, cpu or cuda, got {name!r}")
    if not need_torch and name != "cuda":
        return None
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device(name)


def _load(reader: TensorReader, unit: list[Piece], flat, scratch=None) -> None:
    """Read one unit's float pieces into `flat` (a reused accum-dtype buffer)."""
    for p in unit:
        if p.info.dtype in FLOATING:
            read_into(reader, p.info.name, p.start, p.stop, flat[p.lo : p.hi], scratch)


def _read_raw(reader: TensorReader, unit: list[Piece]) -> dict:
    """{name: rows} of the unit's non-float pieces (ids, masks: copied to the outputs as read)."""
    return {
        p.info.name: reader.read(p.info.name, p.start, p.stop) for p in unit if p.info.dtype not in FLOATING
    }


def _first_element(p: Piece, a: int) -> int:
    """Element offset, within its (flattened) tensor, of position `a` of the unit's flat buffer."""
    return p.start * p.info.row_numel + (a - p.lo)


def _check_finite(index, unit: list[Piece], flat, lo: int, hi: int, base: int = 0) -> None:
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


class Workspace:
    """Buffers sized for the largest work unit, allocated once and reused by every unit and step.

    Fresh multi-MB tensors per step cost a page fault per page on first touch (measured ~3.5x
    slower copies), so theta0, the states, theta_s, theta_s - theta0 and one output live here;
    `view(name, n)` is the first n elements (the block-sized ones only ever touch a block's worth:
    pages never touched are never resident). Outputs being written live in the write-behind pool.
    """

    def __init__(self, size: int, acc, device):
        self.size, self.acc, self.device = size, acc, device
        self.buffers: dict = {}
        self._writes: WriteBehind | None = None

    @classmethod
    def for_plan(cls, plan: Plan, opts: Options) -> Workspace:
        """A workspace that fits every unit of `plan`."""
        import torch

        size = max((p.hi for u in plan.units for p in u), default=0)
        return cls(size, getattr(torch, opts.accum_dtype), torch_device(opts.device))

    def view(self, name: str, n: int, dtype=None):
        import torch

        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.size, dtype=dtype or self.acc, device=self.device)
        return self.buffers[name][:n]

    def write_behind(self, block: int):
        """The write-behind pool and thread of this workspace (made once: see io/write_behind.py).
        On a GPU a unit is one block and its writes are synchronous."""
        background = self.device.type == "cpu"
        size = block if background else self.size
        if self._writes is None or self._writes.block < size:
            self.close()
            self._writes = WriteBehind(size, background=background)
        return self._writes

    def close(self) -> None:
        """End the write-behind thread (its queue is empty between units)."""
        if self._writes is not None:
            self._writes.close()
            self._writes = None

    def scratch(self, unit: list[Piece]):
        """A CPU byte buffer for inputs that must be cast (bf16 read, f32 accumulated): the largest
        float piece's bytes, grown as needed (the plan's memory budget counts the input as read)."""
        import torch

        need = max(
            (p.info.row_bytes * (p.stop - p.start) for p in unit if p.info.dtype in FLOATING), default=0
        )
        old = self.buffers.get("scratch")
        if old is None or old.numel() < need:
            self.buffers["scratch"] = old = torch.empty(need, dtype=torch.uint8)
        return old


@contextmanager
def compute_threads(ws: Workspace, threads: int | None = None) -> Iterator[None]:
    """torch's CPU threads while units run: one fewer than the cores (`threads`, default torch's own
    count), leaving a core to the write-behind thread and the kernel's page-cache copies. On 2 cores
    that is 1 thread: OpenMP workers that spin between the many short block ops (the GNU runtime's
    default) measured as a third of all CPU time, and slower wall time (docs/performance.md)."""
    import torch

    before = torch.get_num_threads()
    if ws.device.type == "cpu":
        torch.set_num_threads(max(1, (threads or before) - 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _blocks(unit: list[Piece], size: int, block: int) -> list[tuple[int, int, list[tuple[Piece, int, int]]]]:
    """Cut a unit's flat float range [0, size) into blocks of `block` elements: (lo, hi, the float
    pieces' parts in the block as (piece, a, b) with lo <= a < b <= hi)."""
    floats = [p for p in unit if p.info.dtype in FLOATING and p.hi > p.lo]
    out = []
    for lo in range(0, size, block):
        hi = min(lo + block, size)
        out.append((lo, hi, [(p, max(p.lo, lo), min(p.hi, hi)) for p in floats if p.lo < hi and p.hi > lo]))
    return out


def _emit(wb: WriteBehind, writer: ShardedWriter, parts: list, lo: int, result, out_dtypes: dict) -> None:
    """Hand one block of an output (`result` holds flat[lo:hi]) to the write-behind thread: cast into
    a pool buffer per output dtype (none when `result` is one already), one pwrite per tensor part."""
    import torch

    tags = {out_dtypes[p.info.name] for p, _, _ in parts}
    for tag in sorted(tags):
        dtype = getattr(torch, DTYPES[tag][0])
        data = result if wb.owns(result, dtype) else wb.buffer(dtype, result.numel()).copy_(result)
        size = DTYPES[tag][1]
        writes = [
            _part_write(writer, p.info.name, _first_element(p, a) * size, a - lo, b - lo)
            for p, a, b in parts
            if out_dtypes[p.info.name] == tag
        ]
        wb.put(data, writes)


def _emit_state(wb: WriteBehind, writer: ShardedWriter, name: str, parts: list, lo: int, rows) -> None:
    """Hand one block of a state tensor (`rows` holds flat[lo:hi]) to the write-behind thread, as
    `_emit` does an output's: the state files take the accumulation dtype as computed."""
    data = wb.buffer(rows.dtype, rows.numel()).copy_(rows)
    size = rows.element_size()
    writes = [
        _part_write(writer, f"{name}/{p.info.name}", _first_element(p, a) * size, a - lo, b - lo)
        for p, a, b in parts
    ]
    wb.put(data, writes, stage="state")


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


def step_updates(plan: Plan, stabs: list, step: int) -> tuple[list, list]:
    """The (state, event) updates of `step`, one per distinct state that takes it: the recurrences
    (applied before the outputs) and the windows' rings (after them: a full window's merge still
    reads its oldest slice, which the ring's update overwrites)."""
    updates = [
        (stab, track.runs[0].events[step])
        for track, stab in zip(plan.tracks, stabs, strict=True)
        if track.advances(step)
    ]
    rings = [(stab, event) for stab, event in updates if isinstance(stab, Window)]
    return [(stab, event) for stab, event in updates if not isinstance(stab, Window)], rings


def run_estimate(part, run, event, theta, drift=None, out=None):
    """One run's output at `event` from its state `part` (a Stabilizer or Window view) and theta_s;
    `drift` = theta_s - theta0 (bema), `out` storage for methods that compute a new tensor (BUFFERED)."""
    if run.schedule.method in WINDOW_METHODS:
        return part.estimate(event, theta, run.schedule, out=out)
    return part.estimate(event, theta, drift=drift, out=out, method=run.schedule.method)


def process_unit(plan: Plan, opts: Options, unit: list[Piece], outputs: Outputs, ws: Workspace | None = None):
    """One work unit, start to end: read its slices of theta0 and of every checkpoint, run the
    recurrences, write its bytes at their final offsets in the pre-created `outputs`.

    Self-contained and idempotent (the same bytes land at the same offsets on a re-run), so any
    executor may run units in any order, in any process, and retry one that was lost.

    Per step, the finite check, the read (where the reader can read any element range: safetensors),
    every state update, every output and its write run block by block (plan.block elements): a block's
    buffers stay in the CPU cache across those passes instead of streaming the whole unit through
    memory once per pass. Other formats are read whole into `theta` first. Every update is
    elementwise, so the bytes are those of whole-unit passes (docs/design.md, "The fused pass").
    """
    import torch

    ws = ws or Workspace.for_plan(plan, opts)
    check = not opts.allow_nonfinite
    out_dtypes = {t.name: t.dtype for t in plan.out_tensors}
    tau = plan.runs[0].schedule.tau  # shared by the grid: burn-in happens at the same steps for all runs
    size = max((p.hi for p in unit), default=0)
    block = size if ws.device.type != "cpu" else plan.block  # a GPU gains nothing from cache-sized passes
    blocks = _blocks(unit, size, max(block, 1))
    theta0, scratch = ws.view("theta0", size), ws.scratch(unit)
    acc_tag = TAG_OF[str(ws.acc).removeprefix("torch.")]
    direct = ws.device.type == "cpu" and all(
        out_dtypes[p.info.name] == acc_tag for p in unit if p.info.dtype in FLOATING
    )

    def load_theta0(reader, u, flat):
        _load(reader, u, flat, scratch)
        if check:
            _check_finite(reader.index, u, flat, 0, size)

    with stages.stage("read", unit_bytes(unit) if plan.theta0_index is not None else 0):
        state_store.read_theta0(plan, unit, theta0, load_theta0)
    # one Stabilizer per track (runs sharing a state, e.g. ema and bema at one kappa): from theta0,
    # or continued from OUT's persistent state
    # (no per-unit clones: the states live in the workspace's reused buffers)
    stabs = state_store.start_unit(plan, unit, theta0, lambda key: ws.view(key, size), scratch)
    track_of = {r.name: i for i, t in enumerate(plan.tracks) for r in t.runs}
    last = plan.read_steps[-1] if plan.read_steps else None
    for step in plan.read_steps:
        index = plan.indexes[step]
        advancing, after = step_updates(plan, stabs, step)
        writing = [(run, outputs[run.name, step]) for run in plan.runs if (run.name, step) in outputs]
        # the unit's rows of the new state, final once a block has taken the last step: they go out
        # with the outputs, from the write-behind thread, rather than after the pass from this one
        saving = state_store.saved_states(plan, stabs, theta0) if step == last else []
        with index.open() as reader, ExitStack() as held:
            raw = _read_raw(reader, unit)
            for writer in [w for _, w in writing] + [w for w, _, _ in saving]:
                held.enter_context(writer.held())  # files open for the unit's many block writes
            streamed = streams(reader)
            t_unit, t_read = perf_counter(), 0.0
            if not streamed:
                theta = ws.view("theta", size)
                _load(reader, unit, theta, scratch)
                t_read = perf_counter() - t_unit
            ahead = (
                ReadAhead(reader, blocks, _first_element, plan.readers)
                if streamed and plan.readers > 1
                else None
            )
            if ahead is not None:
                held.callback(ahead.close)
            fetched = iter(ahead) if ahead else None
            with ws.write_behind(block).batch() as wb:
                wait0 = wb.waited
                for lo, hi, parts in blocks:
                    if streamed:
                        th = ws.view("theta", hi - lo)
                        t = perf_counter()
                        if fetched is None:
                            for p, a, b in parts:
                                first = _first_element(p, a)
                                reader.read_elements_into(
                                    p.info.name, first, b - a, th[a - lo : b - lo], scratch
                                )
                        else:  # read by the read-ahead threads; cast here, as read_elements_into does
                            for a, b, data in next(fetched):
                                th[a - lo : b - lo].copy_(data)
                        t_read += perf_counter() - t
                    else:
                        th = theta[lo:hi]
                    if check:
                        _check_finite(index, [p for p, _, _ in parts], th, 0, hi - lo, lo)
                    if step <= tau:
                        theta0[lo:hi].copy_(th)  # burn-in: theta0 = theta_s, held in its own buffer
                    for stab, event in advancing:
                        stab.view(lo, hi).advance(event, theta0[lo:hi] if event.action == "burnin" else th)
                    drift = None  # theta_s - theta0, computed once per block for every bema output
                    for run, writer in writing:  # the output is only computed where it is written
                        event = run.events[step]
                        method = run.schedule.method
                        if method == "bema" and drift is None and event.action == "update":
                            drift = torch.sub(th, theta0[lo:hi], out=ws.view("drift", hi - lo))
                        out = None
                        if method in BUFFERED:  # computed straight into a write buffer when it can
                            out = wb.buffer(ws.acc, hi - lo) if direct else ws.view("out", hi - lo)
                        part = stabs[track_of[run.name]].view(lo, hi)
                        result = run_estimate(part, run, event, th, drift, out)
                        _emit(wb, writer, parts, lo, result, out_dtypes)
                        if out is not None and result is not out and direct:
                            wb.release(out)  # a burn-in step returned theta_s instead
                    for ring, event in after:
                        ring.view(lo, hi).advance(event, th)
                    for writer, names, tensors in saving:
                        for name, t in zip(names, tensors, strict=True):
                            _emit_state(wb, writer, name, parts, lo, t[lo:hi])
                waited = wb.waited - wait0
            stages.add("read", t_read, unit_bytes(unit))
            stages.add("compute", perf_counter() - t_unit - t_read - waited)
            for _, writer in writing:
                _write_raw(writer, unit, raw)
        del raw
    if last is None:  # no step read: the states (continued or fresh) are saved as they are
        state_store.end_unit(plan, unit, stabs, theta0)
