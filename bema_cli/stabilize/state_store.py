"""The state's tensor store: the layout of a state folder, and the per-unit reads and writes of its
tensors (and of theta0 and a window's members) that the stabilize pass and the sweep's walk make.

The decisions (which state continues, from which folder, whether theta0 is kept) are state.py's;
this module only moves the bytes, in the accumulation dtype, exactly.
"""

from __future__ import annotations

import time
from pathlib import Path

from bema_cli import __version__, stages
from bema_cli.io.reader import read_into
from bema_cli.io.safetensors import FLOATING, TAG_OF, ModelIndex, TensorInfo
from bema_cli.io.writer import ShardedWriter, plan_shards, tensor_bytes
from bema_cli.recurrence import Stabilizer, Window
from bema_cli.stabilize.plan import Options, Piece, Plan, Track

STATE_DIR = ".bema-state"


def state_layout(plan: Plan, names: tuple[str, ...], accum_dtype: str, max_shard_size: int):
    """The shards of a state folder: tensors "<state>/<tensor>" in the accumulation dtype, each state's
    in files of their own. A unit's rows of every state go out block by block, state after state
    (unit.py): sharing a file, DEMA's e1 and e2 (or a window's members) alternated between two
    places in it, so it was neither written past the page cache nor summed as written (read back)."""
    tag = TAG_OF[accum_dtype]
    tensors = [
        TensorInfo(f"{n}/{t.name}", Path(), tag, t.shape)
        for n in names
        for t in plan.base_index.tensors.values()
        if t.dtype in FLOATING and t.numel
    ]
    return plan_shards(sorted(tensors, key=lambda t: t.name), max_shard_size, group=_state_name)


def _state_name(t: TensorInfo) -> str:
    return t.name.split("/", 1)[0]


def folders(plan: Plan, opts: Options) -> dict[str, tuple[str, ...]]:
    """The state folders this call writes, each with its state names; none with --no-state."""
    if opts.write.no_state:
        return {}
    names = {t.folder: t.names for t in plan.tracks if t.advancing and t.folder}
    if plan.theta0_folder:
        names[plan.theta0_folder] = ("theta0",)
    return names


def open_writers(plan: Plan, opts: Options, tmp: Path) -> dict[str, ShardedWriter]:
    """Pre-create the state folders this call writes (tmp/.bema-state/<folder>), like the outputs."""
    return {f: _writer(tmp / STATE_DIR / f, plan, names, opts) for f, names in folders(plan, opts).items()}


def written_bytes(plan: Plan, opts: Options) -> int:
    """Bytes of the state folders this call writes (the projection's; headers to within a few bytes)."""
    return sum(
        ShardedWriter(
            Path(), state_layout(plan, names, opts.accum_dtype, opts.write.max_shard_size), {}
        ).nbytes
        for names in folders(plan, opts).values()
    )


def _writer(folder: Path, plan: Plan, names, opts: Options) -> ShardedWriter:
    shards = state_layout(plan, names, opts.accum_dtype, opts.write.max_shard_size)
    meta = {"bema_version": __version__, "bema_state": folder.name}
    return ShardedWriter(folder, shards, meta, digest=True).open()


def read_unit(index: ModelIndex, unit: list[Piece], names: tuple[str, ...], tensors: list) -> None:
    """Copy this unit's rows of each state tensor from a state folder into `tensors` (flat, unit-sized)."""
    with index.open() as reader:
        for p in unit:
            if p.hi > p.lo:
                for n, t in zip(names, tensors, strict=True):
                    read_into(reader, f"{n}/{p.info.name}", p.start, p.stop, t[p.lo : p.hi])


def write_unit(writer: ShardedWriter, unit: list[Piece], names: tuple[str, ...], tensors: list) -> int:
    """Write this unit's rows of each state tensor at their offsets in a state folder's files, state by
    state (each state's tensors lie in file order, so the files are written front to back: past the
    page cache, io/writer.py). Returns the bytes written."""
    done = 0
    with writer.held():
        for n, t in zip(names, tensors, strict=True):
            for p in unit:
                if p.hi > p.lo:
                    data = t[p.lo : p.hi]
                    row = data.numel() // (p.stop - p.start) * data.element_size()
                    done += writer.write(f"{n}/{p.info.name}", p.start * row, tensor_bytes(data))
    return done


def start_unit(plan: Plan, unit: list[Piece], theta0, buffer=None, scratch=None) -> list[Stabilizer | Window]:
    """One Stabilizer (a Window for lawa/wsm) per track for this unit: from theta0, or continued from
    its state folder. `buffer(key)`, if given, returns reused storage of theta0's shape for each state
    tensor; `scratch` is the byte buffer a cast read goes through."""
    import torch

    stabs = []
    for i, t in enumerate(plan.tracks):
        if t.window:
            new = buffer or (lambda key: torch.empty_like(theta0))
            ring = Window([new(f"state{i}-slot{j}") for j in range(t.ring)])
            if t.advancing:
                for step in t.ring_steps(t.start):
                    index, prefix = t.ring_sources[step]
                    slot = ring.slots[t.runs[0].events[step].member % t.ring]
                    _read_members(index, unit, prefix, slot, scratch)
            stabs.append(ring)
            continue
        buffers = [buffer(f"state{i}-{n}") for n in t.names] if buffer else None
        stab = Stabilizer(t.method, theta0, buffers)
        if t.source is not None and t.advancing:
            read_unit(t.source, unit, t.names, [getattr(stab, n) for n in t.names])
        stabs.append(stab)
    return stabs


def _read_members(index: ModelIndex, unit: list[Piece], prefix: str, flat, scratch=None) -> None:
    """One member of a window's ring, this unit's rows, from a checkpoint ("") or the state ("s<step>/")."""
    with index.open() as reader:
        for p in unit:
            if p.hi > p.lo:
                read_into(reader, prefix + p.info.name, p.start, p.stop, flat[p.lo : p.hi], scratch)


def _state_tensors(t: Track, stab) -> list:
    """The tensors of a track's state, in `t.names` order (a window: the slots of its last members)."""
    if t.window:
        return [stab.slots[t.runs[0].events[st].member % t.ring] for st in t.ring_steps(t.last)]
    return [getattr(stab, n) for n in t.names]


def saved_states(plan: Plan, stabs: list, theta0) -> list[tuple[ShardedWriter, tuple[str, ...], list]]:
    """(writer, names, tensors) of every state a unit saves: each advanced track's, and theta0 after a
    burn-in. None with --no-state."""
    saved = [
        (plan.state_writers[track.folder], track.names, _state_tensors(track, stab))
        for track, stab in zip(plan.tracks, stabs, strict=True)
        if track.advancing and track.folder in plan.state_writers
    ]
    if plan.theta0_folder in plan.state_writers:
        saved.append((plan.state_writers[plan.theta0_folder], ("theta0",), [theta0]))
    return saved


def end_unit(plan: Plan, unit: list[Piece], stabs: list, theta0) -> None:
    """Save this unit's rows of every saved state from the main thread. The fused pass hands them to
    its write-behind thread block by block during the unit's last step instead (unit.py); this is
    for a unit that read no step."""
    t, done = time.perf_counter(), 0
    for writer, names, tensors in saved_states(plan, stabs, theta0):
        done += write_unit(writer, unit, names, tensors)
    if done:
        stages.add("state", time.perf_counter() - t, done)


def read_theta0(plan: Plan, unit: list[Piece], theta0, load) -> None:
    """theta0's rows of this unit into `theta0`: from the base (`load`), the state's burn-in copy, or not at all."""
    if plan.theta0_index is plan.base_index:
        with plan.base_index.open() as reader:
            load(reader, unit, theta0)
    elif plan.theta0_index is not None:
        read_unit(plan.theta0_index, unit, ("theta0",), [theta0])


def traffic(plan: Plan) -> int:
    """Bytes of state this call reads (continued states, theta0's copy); `written` adds the new states."""
    read = sum(t.source.nbytes for t in plan.tracks if t.source is not None and t.advancing)
    read += sum(  # a continued window's members kept in the state
        tensor.nbytes
        for t in plan.tracks
        if t.advancing
        for index, prefix in t.ring_sources.values()
        if prefix
        for name, tensor in index.tensors.items()
        if name.startswith(prefix)
    )
    if plan.theta0_index is not None and plan.theta0_index is not plan.base_index:
        read += plan.theta0_index.nbytes
    return read


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
