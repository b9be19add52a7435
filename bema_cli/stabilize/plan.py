"""What a `bema stabilize` call will do, decided before any tensor data is read.

Options (the flags), Run (one config of the grid and the steps it writes), Piece and
work units (row ranges of tensors whose working set fits --max-memory), and Plan (the
checkpoints, theta0, the output layout). `prepare` builds it; engine.py executes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from bema_cli.errors import InputError, UsageError
from bema_cli.io.checkpoints import Checkpoint, find_checkpoints, model_weight_files, resolve_base
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF, ModelIndex, TensorInfo, index_model
from bema_cli.io.writer import Shard, plan_shards
from bema_cli.recurrence import STATE_TENSORS, PlannedStep, Schedule, run_name, state_key

OUT_DTYPES = ("float32", "bfloat16", "float16", "float64")
ACCUM_DTYPES = ("float32", "float64")


@dataclass
class Options:
    checkpoint_dir: str
    schedules: list[Schedule]
    out: str
    base: str | None = None
    max_memory: int = 2 * 1024**3
    max_shard_size: int = 5 * 10**9
    device: str = "auto"
    accum_dtype: str = "float32"
    out_dtype: str | None = None  # None: each tensor keeps its input dtype
    final_only: bool = False
    steps: list[int] | None = None
    dry_run: bool = False
    overwrite: bool = False
    allow_nonfinite: bool = False
    cast_base: bool = False  # accept a floating base of another dtype (e.g. bf16 Hub base, fp32 fine-tune)


@dataclass
class Run:
    """One stabilizer config of the grid and what it writes."""

    schedule: Schedule  # resolved
    name: str
    events: dict[int, PlannedStep]
    out_steps: list[int]

    @property
    def last_needed(self) -> int:
        return self.out_steps[-1]


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one tensor; `lo:hi` is its span in the unit's flat float buffer."""

    info: TensorInfo
    start: int
    stop: int
    lo: int = 0
    hi: int = 0


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


def grid(methods: list[str], kappas: list[float], etas: list[float], **common) -> list[Schedule]:
    """Every (method, kappa, eta) combination, validated, one per output run name.

    Methods without bias correction (ema, dema, vanilla) record eta = inf, so the grid
    `--method bema,ema --eta 0.2,inf` does not produce the same EMA run twice.
    """
    if not methods:
        raise UsageError("--method: no method given")
    out: dict[str, Schedule] = {}
    for method in methods:
        for kappa in kappas:
            for eta in etas:
                eta = eta if method in ("bema", "ouema") else math.inf
                s = Schedule(method=method, kappa=kappa, eta=eta, **common).resolved()
                out.setdefault(run_name(s), s)
    return list(out.values())


def _out_steps(events: list[PlannedStep], opts: Options) -> list[int]:
    done = [e.step for e in events if e.action != "skip"]
    if not done:
        raise UsageError("no checkpoint is processed with these --tau/--phi settings")
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


def _check_same(index: ModelIndex, base: ModelIndex, what: str, cast_base: bool = False) -> None:
    """Keys, shapes and dtypes of a checkpoint must match theta0's; errors name the tensor.

    With `cast_base`, a floating theta0 tensor may have another floating dtype: it is read
    into the accumulation dtype anyway, and outputs take the checkpoints' dtype.
    """
    missing = sorted(set(base.tensors) - set(index.tensors))
    extra = sorted(set(index.tensors) - set(base.tensors))
    if missing:
        raise InputError(f"{index.folder}: tensor {missing[0]!r} of the {what} ({base.folder}) is missing")
    if extra:
        raise InputError(f"{index.folder}: tensor {extra[0]!r} is not in the {what} ({base.folder})")
    for name, b in base.tensors.items():
        t = index.tensors[name]
        if t.shape != b.shape:
            raise InputError(
                f"{t.file}: tensor {name!r} has shape {list(t.shape)}, the {what} has {list(b.shape)}"
            )
        if t.dtype != b.dtype and not (cast_base and t.dtype in FLOATING and b.dtype in FLOATING):
            hint = (
                " (pass --cast-base to read theta0 in the checkpoints' dtype)" if t.dtype in FLOATING else ""
            )
            raise InputError(f"{t.file}: tensor {name!r} has dtype {t.dtype}, the {what} has {b.dtype}{hint}")


def _accumulators(runs: list[Run]) -> int:
    """Accum-dtype buffers per element that `_walk` holds: theta0, theta_s, one set of state per
    distinct state, theta_s - theta0 (bema), the output (bema, dema), ouema's two temporaries."""
    methods = {r.schedule.method for r in runs}
    distinct = {state_key(r.schedule): r.schedule.method for r in runs}  # runs sharing a state count once
    state = sum(len(STATE_TENSORS[m]) for m in distinct.values())
    scratch = ("bema" in methods) + bool(methods & {"bema", "dema"}) + 2 * ("ouema" in methods)
    return 2 + state + scratch


def _units(order: list[TensorInfo], runs: list[Run], opts: Options) -> list[list[Piece]]:
    """Cut the tensors (in output order) into work units whose working set fits opts.max_memory."""
    acc = DTYPES[TAG_OF[opts.accum_dtype]][1]
    out_size = DTYPES[TAG_OF[opts.out_dtype]][1] if opts.out_dtype else 0
    float_cost = acc * _accumulators(runs)
    units: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0
    for t in order:
        rows = t.shape[0] if t.shape else 1
        if t.numel == 0:
            continue
        # the input chunk as read, plus (floats) an output cast and the accum-dtype buffers
        per_elem = t.itemsize + (max(t.itemsize, out_size) + float_cost if t.dtype in FLOATING else 0)
        row_cost = (t.numel // rows) * per_elem
        r = 0
        while r < rows:
            n = min(rows - r, (opts.max_memory - used) // row_cost)
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


def prepare(opts: Options) -> Plan:
    """Everything decided before a byte of tensor data is read: files, plan, layout, work units."""
    if opts.accum_dtype not in ACCUM_DTYPES:
        raise UsageError(f"--accum-dtype: choose from {', '.join(ACCUM_DTYPES)}, got {opts.accum_dtype!r}")
    if opts.out_dtype is not None and opts.out_dtype not in OUT_DTYPES:
        raise UsageError(f"--out-dtype: choose from {', '.join(OUT_DTYPES)}, got {opts.out_dtype!r}")
    if opts.max_memory <= 0 or opts.max_shard_size <= 0:
        raise UsageError("--max-memory and --max-shard-size must be positive")
    if len({s.tau for s in opts.schedules}) > 1:
        raise UsageError("--tau: every config of one run must share the burn-in (theta0 is shared)")
    checkpoints = find_checkpoints(opts.checkpoint_dir)
    base = resolve_base(opts.base, checkpoints)
    steps = [c.step for c in checkpoints]
    runs = []
    for s in opts.schedules:
        events = s.plan(steps)
        runs.append(Run(s, run_name(s), {e.step: e for e in events}, _out_steps(events, opts)))
    read_steps = sorted(
        {st for r in runs for st, e in r.events.items() if e.action != "skip" and st <= r.last_needed}
    )
    base_index = index_model(base.path, model_weight_files(base.path))
    if not base_index.tensors:
        raise InputError(f"{base.path}: the base model has no tensors")
    indexes = {}
    for c in checkpoints:
        if c.step in read_steps:
            indexes[c.step] = index_model(c.path, model_weight_files(c.path))
            _check_same(indexes[c.step], base_index, "base model", opts.cast_base)
    out_tag = TAG_OF[opts.out_dtype] if opts.out_dtype else None
    # outputs default to the checkpoints' dtypes (== theta0's unless --cast-base)
    like = indexes[read_steps[0]] if read_steps else base_index
    out_tensors = [
        TensorInfo(t.name, Path(), out_tag if out_tag and t.dtype in FLOATING else t.dtype, t.shape)
        for t in sorted(like.tensors.values(), key=lambda t: t.name)
    ]
    shards = plan_shards(out_tensors, opts.max_shard_size)
    order = [base_index.tensors[t.name] for s in shards for t in s.tensors]
    plan = Plan(checkpoints, base.source, base_index, indexes, runs, read_steps, out_tensors, shards)
    plan.units = _units(order, runs, opts)
    return plan
