"""What a `bema stabilize` call will do, decided before any tensor data is read.

Options (the flags), Run (one config of the grid and the steps it writes), Piece and
work units (row ranges of tensors whose working set fits --max-memory), Resume and Track
(what OUT's persistent state says, the recurrence states a call walks) and Plan (the
checkpoints, theta0, the output layout), with the pure rules that shape them. prepare.py
fills a Plan from the disk; engine.py executes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bema_cli.errors import UsageError
from bema_cli.io.checkpoints import Checkpoint
from bema_cli.io.lora import Adapter
from bema_cli.io.reader import ModelIndex, TensorInfo
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF
from bema_cli.io.write_behind import DEPTH
from bema_cli.io.writer import MAX_SHARD_SIZE, Shard
from bema_cli.recurrence import STATE_TENSORS
from bema_cli.schedule import (
    WINDOW_METHODS,
    PlannedStep,
    Schedule,
    last_members,
    state_key,
)

OUT_DTYPES = ("float32", "bfloat16", "float16", "float64")
ACCUM_DTYPES = ("float32", "float64")
LORA_OUTPUTS = ("merged", "adapter")
MAX_MEMORY = 2 * 1024**3  # --max-memory's default: the working set the units are cut to


@dataclass(frozen=True)
class Output:
    """What only stabilize's writing reads: OUT's shards, its persistent state, a LoRA run's output
    form, and what the call does with what OUT holds. A plan without one (ship's and verify's
    vectors, a sweep's walk) writes nothing and reads no state."""

    max_shard_size: int = MAX_SHARD_SIZE
    dry_run: bool = False
    overwrite: bool = False
    lora_output: str = "merged"  # LoRA runs: full merged models, or PEFT adapters of rank lora_rank
    lora_rank: int | None = None  # None: the training rank r
    restart: bool = False  # ignore OUT's persistent state: recompute the grid's runs from theta0
    keep_last: int | None = None  # keep only the K newest outputs of each run
    fingerprint: str = "full"  # consumed files: a digest of the whole file, or "sampled" (io/fingerprint.py)
    # write no persistent state (OUT/.bema-state): the run cannot be continued. None: decided per
    # call (resolve_state): a --final-only result is a one-off unless OUT already keeps a state
    no_state: bool | None = None

    @property
    def recompute(self) -> bool:
        """OUT's state is not continued from: --restart, or --overwrite (which replaces outputs anyway)."""
        return self.restart or self.overwrite


@dataclass
class Options:
    """What planning a run reads: the run, its checkpoints, the schedules, theta0, the input flags
    and how the walk holds and serves its tensors; `write` what stabilize's writing reads besides."""

    checkpoint_dir: str
    schedules: list[Schedule]
    # the folder the run's records live in, naming their inputs from it (provenance.input_name): where
    # stabilize writes; a sweep's OUT/.sweep, ship's race folder; None: records name inputs absolutely
    out: str | None
    base: str | None = None
    max_memory: int = MAX_MEMORY
    device: str = "auto"
    readers: int | None = None  # threads reading ahead (io/read_ahead.py); None: chosen from the device
    accum_dtype: str = "float32"
    out_dtype: str | None = None  # None: each tensor keeps its input dtype
    final_only: bool = False
    steps: list[int] | None = None
    allow_nonfinite: bool = False
    allow_gaps: bool = False  # go on past checkpoints the run's cadence says were saved but are gone
    durations: dict | None = None  # flag -> how each duration resolved on this run (durations.py)
    min_interval: int | None = None  # thin the inputs: kept checkpoints at least this many steps apart
    min_checkpoints: int | None = None  # refuse a run with fewer checkpoints (after thinning)
    cast_base: bool = False  # accept a floating base of another dtype (e.g. bf16 Hub base, fp32 fine-tune)
    checkpoints: list[Checkpoint] | None = None  # given explicitly (a `STEP PATH` list) instead of found
    ready_steps: list[int] | None = None  # --follow: only these (complete) checkpoints exist yet
    write: Output | None = None  # None: a plan that writes nothing (no state read, no shards written)


@dataclass
class Run:
    """One stabilizer config of the grid and what it writes."""

    schedule: Schedule  # resolved
    name: str
    events: dict[int, PlannedStep]  # every step of the trajectory, earlier calls' included
    out_steps: list[int]  # written by this call
    start: int | None = None  # last step an earlier call processed (OUT's state); None: from theta0

    @property
    def last_needed(self) -> int:
        """The last step whose state this call needs (== start: nothing new)."""
        return self.out_steps[-1] if self.out_steps else self.start


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one tensor; `lo:hi` is its span in the unit's flat float buffer."""

    info: TensorInfo
    start: int
    stop: int
    lo: int = 0
    hi: int = 0


BLOCK = 1 << 19  # elements per block of the fused pass: 2 MiB per float32 buffer, and the ~5 buffers a
# block touches (theta0, theta_s, state, drift, output) fit in the 32 MiB L3 of the benchmark's machine


def block_size(max_memory: int, itemsize: int) -> int:
    """Elements per block: BLOCK, less when the write-behind pool (DEPTH blocks in flight) would take
    over a quarter of --max-memory; the pool is subtracted from the budget the units are cut to."""
    return max(1024, min(BLOCK, max_memory // (4 * DEPTH * itemsize)))


@dataclass
class Resume:
    """What the persistent state says about one call (empty when OUT has none)."""

    stored: dict | None
    steps: list[int]  # the whole trajectory: consumed steps, then the new present ones
    starts: dict[str, int | None]  # run name -> last step already processed; None: from theta0
    theta0_state: str | None  # folder in .bema-state holding theta0 after a burn-in, if any
    base_files: list[Path] = field(default_factory=list)  # theta0's weight files (fingerprinted)

    def start(self, name: str) -> int | None:
        return self.starts.get(name)


@dataclass
class Track:
    """One recurrence state walked by this call, shared by the runs with the same state_key and start.

    A window track's state is its ring: the last ring_size members as of a step, stored as the
    tensors "s<step>/<name>" so a call with another ring size (or another slot order) reads them.
    """

    method: str  # the Stabilizer's method (that of the track's first run)
    runs: list[Run]
    start: int | None  # last step already in the state; None: the state starts at theta0
    last: int  # the last step this call advances it to (== start: nothing new)
    source: ModelIndex | None  # the state folder to resume from (read one unit at a time)
    folder: str | None  # the state folder after this call (new when it advances)
    # a continued window: where each member its ring holds at `start` is read, step -> (index, the
    # tensor name prefix: "" for the run's own checkpoint, "s<step>/" for the state's copy)
    ring_sources: dict[int, tuple[ModelIndex, str]] = field(default_factory=dict)

    @property
    def window(self) -> bool:
        return self.method in WINDOW_METHODS

    @property
    def ring(self) -> int:
        return ring_size(self.runs) if self.window else 0

    def ring_steps(self, at: int | None) -> list[int]:
        """The members a window's ring holds after step `at` (oldest first; none before any step)."""
        return last_members(self.runs[0].events, at, self.ring)

    @property
    def names(self) -> tuple[str, ...]:
        """The state tensors this call saves (a window: its ring after `last`)."""
        if self.window:
            return tuple(f"s{st}" for st in self.ring_steps(self.last))
        return STATE_TENSORS[self.method]

    @property
    def advancing(self) -> bool:
        return self.last != self.start

    def advances(self, step: int) -> bool:
        return (self.start is None or step > self.start) and step <= self.last


@dataclass
class Plan:
    checkpoints: list[Checkpoint]
    base_source: str
    base_index: ModelIndex
    indexes: dict[int, ModelIndex]  # only the steps that are read
    runs: list[Run]
    read_steps: list[int]
    out_tensors: list[TensorInfo]
    shards: list[Shard]
    units: list[list[Piece]] = field(default_factory=list)
    block: int = BLOCK  # elements per block of a unit's fused pass (unit.process_unit)
    readers: int = 1  # threads reading ahead (io/read_ahead.py); their blocks are reserved in the budget
    lora: Adapter | None = None  # a LoRA run: the first adapter (modules, config)
    lora_rank: int | None = None  # set for --lora-output adapter
    resume: Resume | None = None  # OUT's persistent state as this call finds it
    tracks: list[Track] = field(default_factory=list)  # the recurrence states this call walks
    theta0_index: ModelIndex | None = None  # where theta0 is read from (None: not needed)
    theta0_folder: str | None = None  # state folder this call saves theta0 to (after a burn-in)
    state_writers: dict = field(default_factory=dict)  # state folder -> its ShardedWriter (pre-created)
    fingerprints: dict[int, list[dict]] = field(default_factory=dict)  # step -> its files as read (state.py)


def out_steps(events: list[PlannedStep], opts: Options, start: int | None = None) -> list[int]:
    done = [e.step for e in events if e.action != "skip"]
    if not done:
        raise UsageError("no checkpoint is processed with these --tau/--phi settings")
    if start is not None:  # continuing from OUT's state: only steps after the last processed one
        return [s for s in out_steps(events, opts) if s > start]
    if opts.steps:
        for step in opts.steps:
            ev = next((e for e in events if e.step == step), None)
            if ev is None:
                have = ", ".join(str(e.step) for e in events)
                raise UsageError(f"--steps: {step} is not a checkpoint step (found {have})")
            if ev.action == "skip":
                raise UsageError(f"--steps: step {step} is skipped by the --phi cadence")
        return sorted(set(opts.steps))
    return done[-1:] if opts.final_only else done


def _accumulators(runs: list[Run]) -> int:
    """Accum-dtype buffers per element that `_walk` holds: theta0, theta_s, the previous checkpoint, one set of state per
    distinct state (a window's ring: K-1 slices), theta_s - theta0 (bema), the output (bema, dema,
    windows), ouema's two temporaries."""
    methods = {r.schedule.method for r in runs}
    distinct: dict[tuple, int] = {}  # runs sharing a state count once
    for r in runs:
        key = (state_key(r.schedule), r.start)
        size = (
            ring_size([r]) if r.schedule.method in WINDOW_METHODS else len(STATE_TENSORS[r.schedule.method])
        )
        distinct[key] = max(distinct.get(key, 0), size)
    scratch = (
        ("bema" in methods) + bool(methods & {"bema", "dema", *WINDOW_METHODS}) + 2 * ("ouema" in methods)
    )
    return 3 + sum(distinct.values()) + scratch  # theta0, theta_s, the previous checkpoint (motion.py)


def ring_size(runs: list[Run]) -> int:
    """Slices a window track keeps: K-1 for the largest window K of its runs (theta_s is the K-th)."""
    return max((r.schedule.window - 1 for r in runs if r.schedule.method in WINDOW_METHODS), default=0)


def cut_units(
    order: list[TensorInfo], runs: list[Run], opts: Options, read_itemsize, reserved: int = 0
) -> list[list[Piece]]:
    """Cut the tensors (in output order) into work units whose working set fits opts.max_memory
    less `reserved` bytes (the write-behind pool).

    `read_itemsize(info)`: bytes per element a read holds (more than the dtype for LoRA rows)."""
    acc = DTYPES[TAG_OF[opts.accum_dtype]][1]
    out_size = DTYPES[TAG_OF[opts.out_dtype]][1] if opts.out_dtype else 0
    budget = opts.max_memory - reserved
    float_cost = acc * _accumulators(runs)
    units: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0
    for t in order:
        rows = t.shape[0] if t.shape else 1
        if t.numel == 0:
            continue
        # the input chunk as read, plus (floats) an output cast and the accum-dtype buffers
        per_elem = read_itemsize(t) + (max(t.itemsize, out_size) + float_cost if t.dtype in FLOATING else 0)
        row_cost = (t.numel // rows) * per_elem
        r = 0
        while r < rows:
            n = min(rows - r, (budget - used) // row_cost)
            if n <= 0:
                if cur:
                    units.append(cur)
                    cur, used = [], 0
                    continue
                n = 1  # one row over the budget cannot be split further
            cur.append(Piece(t, r, r + n))
            used += n * row_cost
            r += n
    if cur:
        units.append(cur)
    # flat float offsets within each unit
    out = []
    for unit in units:
        pos, placed = 0, []
        for p in unit:
            n = (p.stop - p.start) * (p.info.numel // (p.info.shape[0] if p.info.shape else 1))
            if p.info.dtype in FLOATING:
                placed.append(Piece(p.info, p.start, p.stop, pos, pos + n))
                pos += n
            else:
                placed.append(p)
        out.append(placed)
    return out


def inputs_of(plan: Plan, run_dir: str) -> list[Path]:
    """Everything a call reads: the run folder, each checkpoint folder, theta0, every weight file
    (what no output may be, contain or lie inside: io/commit.check_apart)."""
    files = [t.file for index in (plan.base_index, *plan.indexes.values()) for t in index.tensors.values()]
    run = [Path(run_dir).expanduser()] if run_dir != "-" else []  # "-": a STEP PATH list on stdin
    folders = [*run, plan.base_index.folder, *(c.path for c in plan.checkpoints)]
    return folders + sorted(set(files))
