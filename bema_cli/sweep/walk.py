"""The step-major walk of `bema sweep`: every state of a grid over the whole model, advanced one
checkpoint at a time, and each config's weights produced tensor by tensor when asked.

`bema stabilize` walks tensor-major (a unit of rows through every step), which suits writing
files. A sweep evaluates between steps, so it walks step-major: the model is ONE unit (plan.py's
Piece offsets into flat buffers), each checkpoint is read once, every distinct state advances
(recurrence.py's Stabilizer and Window, the same code and planned events as stabilize), and
`weights(run)` computes a config's estimate one tensor at a time, cast to the dtype the disk path
would write, so an engine loads exactly the bytes `bema stabilize` + `bema eval` would have
loaded. Nothing is written.

Memory (hold.py, `state_bytes`): every distinct EMA-family state, one model each in the accumulation
dtype. theta0, theta_s and a window's K-1 members are not held where their files allow (`reread`:
safetensors, states on the CPU): each use reads its block again (HOLD_BLOCK elements, one pread
per tensor part, from the page cache), and a ring (`FileRing`) holds only which checkpoint each
slot has, whose files the walk keeps open meanwhile. On the 0.5B shape in bf16 that frees 2 GB
of a 7.4 GB sweep, and 7 GB per window of 8. Elsewhere they are held, in the checkpoints' own
dtype when exact (`hold_dtype`). Every block is computed in the accumulation dtype, so the
numbers equal an all-float32 walk's bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import Checkpoint
from bema_cli.io.reader import ModelIndex, open_checkpoint
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF, ChunkReader
from bema_cli.recurrence import BUFFERED, Window, estimate, needs_drift, update
from bema_cli.stabilize import state_store
from bema_cli.stabilize.blocks import check_finite, first_element, load, read_raw
from bema_cli.stabilize.motion import UnitMotion
from bema_cli.stabilize.plan import Options, Plan
from bema_cli.stabilize.prepare import check_same, drop_tied_head, prepare
from bema_cli.stabilize.state_store import step_updates
from bema_cli.stabilize.workspace import Workspace
from bema_cli.sweep.hold import HOLD_BLOCK, FileRing, hold_dtype, index_streams, reread

WHOLE_MODEL = 1 << 62  # --max-memory for the plan: one work unit holds every tensor


def sweep_options(opts: Options) -> Options:
    """stabilize's Options as a sweep plans them: one unit, no state, nothing written."""
    return replace(opts, max_memory=WHOLE_MODEL, final_only=False, steps=None, write=None)


def steps_to(plan: Plan, step: int) -> list[int]:
    """The steps a walk to `step` reads (every earlier step the run's cadence reads, and `step`)."""
    return [s for s in plan.read_steps if s <= step]


def walk_to(plan: Plan, step: int, advance, finish):
    """The walk to one step, as a sweep walks: each read step up to `step` advanced, every one but
    `step` finished (its outputs done with); yields each step once it is advanced. `advance`/`finish`:
    a Walker's own, or the same calls into an engine's weight source (ship's Arena)."""
    for s in steps_to(plan, step):
        advance(s)
        if s != step:
            finish()
        yield s


def plan_sweep(opts: Options, held: dict[str, str] | None = None) -> Plan:
    plan = prepare(sweep_options(opts))
    for index in plan.indexes.values():
        _reach(index, held)
    return plan


def _reach(index: ModelIndex, held: dict[str, str] | None) -> None:
    """Read `index`'s files through the paths `held` maps them to: --follow keeps each landed
    checkpoint's files open (/proc/<pid>/fd/N), so one the trainer rotates away is still read whole."""
    if held:
        index.tensors = {
            n: replace(t, file=Path(held.get(str(t.file), t.file))) for n, t in index.tensors.items()
        }


def check_landed(
    plan: Plan, index: ModelIndex, cast_base: bool, held: dict[str, str] | None = None
) -> ModelIndex:
    """--follow: a checkpoint that landed (its index read as it landed), checked against theta0 and
    read through its held files."""
    drop_tied_head(index, plan.base_index)
    check_same(index, plan.base_index, "base model", cast_base)
    _reach(index, held)
    return index


def add_landed(plan: Plan, landed: list[tuple[int, Path, ModelIndex]]) -> None:
    """--follow: add checkpoints that landed since the plan was made. Events are planned again over
    every step so far; a new step never changes an earlier one's (incremental stabilize relies on it)."""
    for step, folder, index in sorted(landed, key=lambda x: x[0]):
        if step <= max((c.step for c in plan.checkpoints), default=-1):
            raise InputError(
                f"{folder}: step {step} landed after a later step was read; a sweep walks steps in order"
            )
        plan.checkpoints.append(Checkpoint(step, Path(folder)))
        plan.indexes[step] = index
    steps = [c.step for c in plan.checkpoints]
    for run in plan.runs:
        run.events = {e.step: e for e in run.schedule.plan(steps)}
    for track in plan.tracks:
        track.last = steps[-1]
    plan.read_steps = [s for s in steps if any(r.events[s].action != "skip" for r in plan.runs)]


class Walker:
    """The grid's states over the whole model (see the module docstring). Used in one process: the
    caller's (transformers) or a vLLM worker's (the weights load where the states live)."""

    def __init__(self, plan: Plan, opts: Options):
        import torch

        self.opts = opts
        self.plan = plan  # plan_sweep's (the driver's: a worker gets a copy, headers only)
        self.unit = [p for u in plan.units for p in u]
        if len(plan.units) > 1:  # cannot happen with WHOLE_MODEL; said plainly if it ever does
            raise InputError(f"{opts.checkpoint_dir}: the model did not fit one work unit")
        self.ws = ws = Workspace.for_plan(plan, self.opts)
        self.size = size = max((p.hi for p in self.unit), default=0)
        self.scratch = ws.scratch(self.unit)
        self.check = not self.opts.allow_nonfinite
        self.hold = getattr(torch, hold_dtype(plan, opts.accum_dtype))
        again_theta, again_theta0 = reread(plan, ws.device.type)
        self._step_files = ExitStack()  # the current step's reader, kept open while theta_s is read again
        self._theta0_files = ExitStack()  # theta0's reader (the base's, or a burn-in checkpoint's)
        self._theta0_reader: ChunkReader | None = None
        # the motion (motion.py): the previous checkpoint's files stay open one step longer and a
        # block of it is read again (from the page cache) beside theta_s's, held or not; only a
        # checkpoint that cannot be read by element range is copied before the next step
        self.motion = UnitMotion()
        self._prev_files = ExitStack()
        self._prev_held = None
        self._kept_reader: ChunkReader | None = None  # this step's files, read again at the next
        self._parts: dict[int, list] = {}
        self.theta0 = None if again_theta0 else ws.view("theta0", size, self.hold)

        def load_theta0(reader, unit, flat):
            load(reader, unit, flat, self.scratch)
            if self.check:
                check_finite(reader.index, unit, flat, 0, size)

        def buffer(key: str):  # a ring slot is a copy of some theta_s: exact in the held dtype
            if "-slot" in key and again_theta:
                return None  # a FileRing's member is read again from its files, not held
            return ws.view(key, size, self.hold if "-slot" in key else None)

        if self.theta0 is not None:
            state_store.read_theta0(plan, self.unit, self.theta0, load_theta0)
            self.stabs = state_store.start_unit(plan, self.unit, self.theta0, buffer, self.scratch)
        else:  # every state starts at theta0: read it into the first state's storage, then drop it
            self._theta0_reader = self._theta0_files.enter_context(plan.base_index.open())
            first = next(f"state{i}-{t.names[0]}" for i, t in enumerate(plan.tracks) if not t.window)
            start = buffer(first)  # the others copy it as they start (restart)
            for a, b in self._blocks(0, size):
                self._read(self._theta0_reader, a, b, start[a:b])
            if self.check:
                check_finite(plan.base_index, self.unit, start, 0, size)
            self.stabs = state_store.start_unit(plan, self.unit, start, buffer, self.scratch)
            for track, stab in zip(plan.tracks, self.stabs, strict=True):
                if not track.window:
                    stab.theta0 = None  # read again at each use (`_theta0`), not held
        if again_theta:
            self.stabs = [FileRing(len(s.slots)) if isinstance(s, Window) else s for s in self.stabs]
        self._members: dict[int, tuple[ExitStack, ChunkReader]] = {}  # a ring's steps -> their open files
        self.theta = None if again_theta else ws.view("theta", size, self.hold)
        self.track_of = {r.name: i for i, t in enumerate(plan.tracks) for r in t.runs}
        self.out_dtypes = {t.name: t.dtype for t in plan.out_tensors}
        self.step: int | None = None
        self.raw: dict = {}
        self._rings: list = []
        self._scratch: dict = {}
        self._reader = None  # the current step's, while theta_s is read again from it

    def _read(self, reader, a: int, b: int, out) -> None:
        """Positions [a, b) of the model's flat float buffer, read from `reader`'s files into `out`
        (cast to its dtype): one pread per tensor part the range covers."""
        for p in self.unit:
            if p.hi > a and p.lo < b:
                lo, hi = max(p.lo, a), min(p.hi, b)
                reader.read_elements_into(
                    p.info.name, first_element(p, lo), hi - lo, out[lo - a : hi - a], self.scratch
                )

    def _theta(self, a: int, b: int):
        """theta_s[a:b] in the accumulation dtype: read again, or upcast from the held copy."""
        return self._input("up-theta", self.theta, self._reader, a, b)

    def _theta0(self, a: int, b: int):
        """theta0[a:b] in the accumulation dtype: read again, or upcast from the held copy."""
        return self._input("up-theta0", self.theta0, self._theta0_reader, a, b)

    def _input(self, name: str, held, reader, a: int, b: int):
        if held is not None:
            return self._up(name, held[a:b])
        out = self._block(name)[: b - a]
        self._read(reader, a, b, out)
        return out

    def _up(self, name: str, held):
        """`held` (a block of theta0 or theta_s) in the accumulation dtype: a view when already in
        it, else an exact copy into a reused block buffer."""
        if held.dtype == self.ws.acc:
            return held
        return self._block(name)[: held.numel()].copy_(held)

    def _block(self, name: str):
        """A reused HOLD_BLOCK buffer in the accumulation dtype, on the states' device."""
        import torch

        if name not in self._scratch:
            self._scratch[name] = torch.empty(HOLD_BLOCK, dtype=self.ws.acc, device=self.ws.device)
        return self._scratch[name]

    def _blocks(self, lo: int, hi: int):
        return ((a, min(a + HOLD_BLOCK, hi)) for a in range(lo, hi, HOLD_BLOCK))

    def extend(self, plan: Plan) -> None:
        """--follow: the driver's plan, extended by `add_landed` with the checkpoints that landed."""
        self.plan = plan

    def advance(self, step: int) -> None:
        """Read checkpoint `step` into theta_s and move every state that takes it, a block at a time
        (rings wait for `finish`: a window's merge at this step still needs its oldest member)."""
        import torch

        self.finish()
        index = self.plan.indexes.get(step)
        if index is None:  # a step every config skips (--phi): read for vanilla alone
            folder = next(c.path for c in self.plan.checkpoints if c.step == step)
            index = open_checkpoint(folder, like=set(self.plan.base_index.tensors))
            drop_tied_head(index, self.plan.base_index)
        self._check_held(index)
        prev = self._previous()
        self._prev_files.close()
        self._prev_files = self._step_files.pop_all()  # the previous checkpoint's reader, if it had one
        self._reader = reader = self._step_files.enter_context(index.open())
        self._kept_reader = reader if index_streams(index) else None
        self.raw = read_raw(reader, self.unit)
        self.step = step
        indexed = step in self.plan.indexes
        updates, self._rings = step_updates(self.plan, self.stabs, step) if indexed else ([], [])
        burnin = indexed and step <= self.plan.runs[0].schedule.tau  # theta0 = theta_s from here on
        if burnin and self.theta0 is None and index_streams(index):  # theta0 read again from here: kept open
            self._prev_files.enter_context(self._theta0_files)  # closed at the next step (the motion's)
            self._theta0_files, self._step_files = self._step_files, ExitStack()
            self._theta0_reader = reader
        elif burnin and self.theta0 is None:  # a checkpoint not read by element range: theta0 held
            self.theta0 = self.ws.view("theta0", self.size, self.hold)
        held = self.theta is not None or not index_streams(index)
        if held:  # a held theta_s (or a checkpoint that cannot be read by element range: held from now on)
            if self.theta is None:
                self.theta = self.ws.view("theta", self.size, self.hold)
            load(reader, self.unit, self.theta, self.scratch)
            if self._kept_reader is None:  # nothing to read again from
                self._step_files.close()
            self._reader = None  # theta_s is held: a FileRing cannot take this step
            if self.check:
                check_finite(index, self.unit, self.theta, 0, self.size)
        reads_theta0 = any(e.action == "burnin" or s.method == "ouema" for s, e in updates)
        with torch.no_grad():
            for a, b in self._blocks(0, self.size):
                theta = self._theta(a, b)
                if prev is not None:
                    self.motion.add(
                        step,
                        a,
                        self._block_parts(a, b),
                        theta,
                        self._prev_block(prev, a, b),
                        self._block("motion")[: b - a],
                    )
                if not held and self.check:
                    check_finite(index, self.unit, theta, 0, b - a, a)
                if burnin and self.theta0 is not None:
                    self.theta0[a:b].copy_(theta)  # exact: theta_s is in the held dtype
                theta0 = self._theta0(a, b) if reads_theta0 else None
                update(updates, a, b, theta, theta0)

    def _previous(self):
        """Where the previous checkpoint is read from at this step (before theta_s is replaced): a
        reader, or a held buffer; None where there is none. The first step's previous is theta0,
        unless the grid never reads it (windows alone, as stabilize's first step then: not measured)."""
        if self.step is None:
            if self.plan.theta0_index is None:
                return None
            return (self._theta0_reader, None) if self.theta0 is None else (None, self.theta0)
        if self._kept_reader is not None:  # read again a block at a time: no second model held
            return self._kept_reader, None
        if self._prev_held is None:
            self._prev_held = self.ws.view("theta-prev", self.size, self.hold)
        self._prev_held.copy_(self.theta)
        return None, self._prev_held

    def _prev_block(self, prev, a: int, b: int):
        reader, held = prev
        if held is not None:
            return self._up("up-prev", held[a:b])
        out = self._block("prev")[: b - a]
        self._read(reader, a, b, out)
        return out

    def _block_parts(self, a: int, b: int) -> list:
        """The (tensor name, lo, hi) ranges positions [a, b) cover (a block of HOLD_BLOCK)."""
        if a not in self._parts:
            self._parts[a] = [
                (p.info.name, max(p.lo, a), min(p.hi, b)) for p in self.unit if p.hi > a and p.lo < b
            ]
        return self._parts[a]

    def motion_sums(self) -> dict:
        """Every walked step's motion sums (motion.rows reads them)."""
        return self.motion.result()

    def close(self) -> None:
        """Close the files kept open to read theta_s, theta0 and the rings' members again."""
        self._step_files.close()
        self._prev_files.close()
        self._theta0_files.close()
        while self._members:
            self._members.popitem()[1][0].close()

    def _check_held(self, index: ModelIndex) -> None:
        """A checkpoint that landed later (--follow) in a wider dtype than theta_s is held in would be
        rounded: refused, naming it (its dtype was unknown when the walk started). A theta_s read
        again from its file is cast straight to the accumulation dtype: nothing to refuse."""
        if self.hold == self.ws.acc or (self.theta is None and self.theta0 is None and index_streams(index)):
            return
        held = TAG_OF[str(self.hold).removeprefix("torch.")]
        for t in index.tensors.values():
            if t.dtype in FLOATING and t.dtype != held:
                raise InputError(
                    f"{t.file}: tensor {t.name!r} is {t.dtype}, but the sweep holds theta_s as {held} "
                    "(the dtype of the checkpoints before it); sweep this run again from the start"
                )

    def finish(self) -> None:
        """The rings take theta_s (after every estimate of the step): a held copy, or for a FileRing
        the step, whose files then stay open while some ring has it."""
        for ring, event in self._rings:
            ring.advance(event, self.step if isinstance(ring, FileRing) else self.theta)
        self._rings = []
        kept = {s for r in self.stabs if isinstance(r, FileRing) for s in r.steps if s is not None}
        if self.step in kept and self.step not in self._members:
            if self._reader is None:  # --follow: a checkpoint that landed in a format read whole
                where = self.plan.indexes[self.step].folder
                raise InputError(
                    f"{where}: a window's member must be safetensors like the checkpoints "
                    "before it; sweep this run again from the start"
                )
            self._members[self.step] = (self._step_files.pop_all(), self._reader)
        for step in [s for s in self._members if s not in kept]:
            self._members.pop(step)[0].close()

    def _ring_view(self, ring: FileRing, a: int, b: int) -> Window:
        """Positions [a, b) of `ring`'s members, read again from their files (in the accumulation
        dtype: exact), as the Window a merge reads."""
        slots = []
        for j, step in enumerate(ring.steps):
            block = None
            if step is not None:
                block = self._block(f"slot{j}")[: b - a]
                self._read(self._members[step][1], a, b, block)
            slots.append(block)
        return Window(slots)

    def weights(self, run: str | None, dtype=None) -> Iterator[tuple[str, object]]:
        """(name, tensor) of config `run` at the current step (None: theta_s itself, i.e. vanilla),
        each cast to its output dtype (what stabilize writes; vanilla: the checkpoint's), then to
        `dtype` when given (an engine's). Fresh tensors: a loader may keep them."""
        import torch

        if self.step is None:
            raise RuntimeError("Walker.weights before any step")
        by_name = {r.name: r for r in self.plan.runs}
        if run is not None and run not in by_name:
            raise KeyError(run)
        found = by_name.get(run)
        event = found.events[self.step] if found else None
        method = found.schedule.method if found else "vanilla"
        stab = self.stabs[self.track_of[run]] if found else None
        with torch.no_grad():
            for p in self.unit:
                name, shape = p.info.name, p.info.shape
                if name in self.raw:
                    yield name, self.raw[name].clone().view(shape)
                    continue
                tag = self.out_dtypes[name] if found else p.info.dtype  # vanilla: the checkpoint as saved
                tensor = torch.empty(p.hi - p.lo, dtype=getattr(torch, DTYPES[tag][0]), device=self.ws.device)
                for a, b in self._blocks(p.lo, p.hi):
                    theta = self._theta(a, b)
                    if stab is None:
                        result = theta
                    else:
                        drift = None
                        if needs_drift(found.schedule, event):
                            drift = torch.sub(theta, self._theta0(a, b), out=self._block("drift")[: b - a])
                        buffer = self._block("out")[: b - a] if method in BUFFERED else None
                        part = self._ring_view(stab, a, b) if isinstance(stab, FileRing) else stab.view(a, b)
                        result = estimate(part, found.schedule, event, theta, drift, buffer)
                    tensor[a - p.lo : b - p.lo].copy_(result)  # the cast stabilize's writer does
                if dtype is not None and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor.view(shape)
