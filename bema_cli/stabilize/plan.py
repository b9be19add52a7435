"""What a `bema stabilize` call will do, decided before any tensor data is read.

Options (the flags), Run (one config of the grid and the steps it writes), Piece and
work units (row ranges of tensors whose working set fits --max-memory), and Plan (the
checkpoints, theta0, the output layout). `prepare` builds it; engine.py executes it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from bema_cli import output
from bema_cli.errors import InputError, UsageError
from bema_cli.io.checkpoints import Checkpoint, aux_files, find_checkpoints, is_adapter, resolve_base
from bema_cli.io.fingerprint import weight_files
from bema_cli.io.lora import Adapter, lora_index, read_adapter, same_targets
from bema_cli.io.reader import ModelIndex, TensorInfo, has_weights, open_checkpoint
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF
from bema_cli.io.write_behind import DEPTH
from bema_cli.io.writer import Shard, plan_shards
from bema_cli.recurrence import STATE_TENSORS, PlannedStep, Schedule, run_name, state_key
from bema_cli.stabilize import state
from bema_cli.stabilize.state import Resume, Track

OUT_DTYPES = ("float32", "bfloat16", "float16", "float64")
ACCUM_DTYPES = ("float32", "float64")
LORA_OUTPUTS = ("merged", "adapter")
TIED_HEAD = "lm_head.weight"  # HF name of the output embedding, tied to the input one by tie_word_embeddings


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
    allow_gaps: bool = False  # go on past checkpoints the run's cadence says were saved but are gone
    cast_base: bool = False  # accept a floating base of another dtype (e.g. bf16 Hub base, fp32 fine-tune)
    checkpoints: list[Checkpoint] | None = None  # given explicitly (a `STEP PATH` list) instead of found
    lora_output: str = "merged"  # LoRA runs: full merged models, or PEFT adapters of rank lora_rank
    lora_rank: int | None = None  # None: the training rank r
    restart: bool = False  # ignore OUT's persistent state: recompute the grid's runs from theta0
    keep_last: int | None = None  # keep only the K newest outputs of each run
    fingerprint: str = "full"  # consumed files: a digest of the whole file, or "sampled" (io/fingerprint.py)
    # write no persistent state (OUT/.bema-state): the run cannot be continued. None: decided per
    # call (resolve_state): a --final-only result is a one-off unless OUT already keeps a state
    no_state: bool | None = None
    ready_steps: list[int] | None = None  # --follow: only these (complete) checkpoints exist yet


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
    lora: Adapter | None = None  # a LoRA run: the first adapter (modules, config)
    lora_rank: int | None = None  # set for --lora-output adapter
    resume: Resume | None = None  # OUT's persistent state as this call finds it
    tracks: list[Track] = field(default_factory=list)  # the recurrence states this call walks
    theta0_index: ModelIndex | None = None  # where theta0 is read from (None: not needed)
    theta0_folder: str | None = None  # state folder this call saves theta0 to (after a burn-in)
    state_writers: dict = field(default_factory=dict)  # state folder -> its ShardedWriter (pre-created)
    fingerprints: dict[int, list[dict]] = field(default_factory=dict)  # step -> its files as read (state.py)


def grid(methods: list[str], kappas: list[float], etas: list[float], **common) -> list[Schedule]:
    """Every (method, kappa, eta) combination, validated, one per output run name.

    Methods without bias correction (ema, dema, vanilla) record eta = inf, and BEMA with eta = inf
    (alpha = 0) is the EMA itself, so `--method bema,ema --eta 0.2,inf` writes that EMA once.
    """
    if not methods:
        raise UsageError("--method: no method given")
    for kappa in set(kappas) & ({0.0} | {k for k in kappas if k > 1}) if set(methods) - {"vanilla"} else ():
        output.warn(
            f"--kappa {kappa:g}: beta = 1 at every step, so the EMA is the current iterate (no averaging)"
            if kappa == 0
            else f"--kappa {kappa:g} > 1: the betas sum to a finite total, so the EMA never forgets theta0"
        )
    out: dict[str, Schedule] = {}
    for method in methods:
        for kappa in kappas:
            for eta in etas:
                eta = eta if method in ("bema", "ouema") else math.inf
                if method == "bema" and math.isinf(eta):  # alpha = 0: BEMA is the EMA, bit for bit
                    ema = Schedule(method="ema", kappa=kappa, eta=eta, **common).resolved()
                    output.log(
                        f"bema with --eta inf is {run_name(ema)} (no bias correction): written once, as {run_name(ema)}"
                    )
                    out.setdefault(run_name(ema), ema)
                    continue
                s = Schedule(method=method, kappa=kappa, eta=eta, **common).resolved()
                out.setdefault(run_name(s), s)
    return list(out.values())


def _out_steps(events: list[PlannedStep], opts: Options, start: int | None = None) -> list[int]:
    done = [e.step for e in events if e.action != "skip"]
    if not done:
        raise UsageError("no checkpoint is processed with these --tau/--phi settings")
    if start is not None:  # continuing from OUT's state: only steps after the last processed one
        return [s for s in _out_steps(events, opts) if s > start]
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


def _drop_tied_head(index: ModelIndex, base: ModelIndex) -> None:
    """A tied output head is the input embedding: HF safetensors files omit it, a raw state_dict
    (.bin, DCP) has it. Drop it from whichever side has it alone when the base config ties them."""
    config = base.folder / "config.json"
    try:
        tied = json.loads(config.read_text()).get("tie_word_embeddings", False) if config.is_file() else False
    except (OSError, ValueError, AttributeError):
        tied = False
    if tied and (TIED_HEAD in index.tensors) != (TIED_HEAD in base.tensors):
        index.tensors.pop(TIED_HEAD, None)
        base.tensors.pop(TIED_HEAD, None)


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


def _check_one_dtype(indexes: dict[int, ModelIndex]) -> None:
    """Outputs keep the checkpoints' dtype, so (with --cast-base) the checkpoints must agree on it."""
    first = indexes[min(indexes)] if indexes else None
    for step in sorted(indexes):
        for name, t in indexes[step].tensors.items():
            f = first.tensors[name]
            if t.dtype != f.dtype:
                raise InputError(
                    f"{t.file}: tensor {name!r} has dtype {t.dtype}, {f.file} has {f.dtype}; "
                    "checkpoints of mixed dtypes need --out-dtype"
                )


def _accumulators(runs: list[Run]) -> int:
    """Accum-dtype buffers per element that `_walk` holds: theta0, theta_s, one set of state per
    distinct state, theta_s - theta0 (bema), the output (bema, dema), ouema's two temporaries."""
    methods = {r.schedule.method for r in runs}
    distinct = {state_key(r.schedule): r.schedule.method for r in runs}  # runs sharing a state count once
    state = sum(len(STATE_TENSORS[m]) for m in distinct.values())
    scratch = ("bema" in methods) + bool(methods & {"bema", "dema"}) + 2 * ("ouema" in methods)
    return 2 + state + scratch


def _units(
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


def resolve_state(opts: Options) -> Options:
    """Decide whether this call keeps a persistent state when the user did not say (--state/--no-state).

    A full trajectory is what a later call continues, so it keeps one; a --final-only result is
    a one-off (a grid sweep, say) whose state would double the bytes written, so it keeps none,
    unless OUT already has a state: then its runs are continued from it as before.
    """
    if opts.no_state is not None:
        return opts
    out = Path(opts.out).expanduser()
    return replace(opts, no_state=opts.final_only and not (out / state.STATE_DIR).exists())


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
    checkpoints = opts.checkpoints or find_checkpoints(opts.checkpoint_dir)
    if opts.ready_steps is not None:
        checkpoints = [c for c in checkpoints if c.step in set(opts.ready_steps)]
    if opts.base == "first" and is_adapter(checkpoints[0].path):
        raise UsageError("--base first: a LoRA run starts from the base model it adapts; pass --base DIR")
    out = Path(opts.out).expanduser().resolve()
    stored = state.read(out, opts.restart or opts.overwrite)
    if opts.no_state is None:
        raise ValueError("Options.no_state is decided by resolve_state before planning")
    if opts.no_state and stored is not None:
        raise UsageError(
            f"--no-state: {out / state.STATE_DIR} exists (these runs are continued from it); "
            "drop --no-state or choose another --out"
        )
    base = resolve_base(
        opts.base or (stored and stored["theta0"].get("source")), checkpoints, check=has_weights
    )
    if not opts.base and not stored and base.path != checkpoints[0].path:  # say what was inferred
        named_by = "adapter_config.json" if is_adapter(checkpoints[0].path) else "config.json"
        output.log(
            f"base model (theta0): {base.source}, as {checkpoints[0].path / named_by} names it (--base to choose)"
        )
    resume = state.resume(opts, out, checkpoints, base.source, weight_files(base.path))
    steps = resume.steps
    tau = opts.schedules[0].tau if opts.schedules else 0
    if tau > 0 and tau >= steps[-1] and opts.ready_steps is None:  # --follow: later steps will come
        raise UsageError(
            f"--tau {tau}: at or beyond the last checkpoint step ({steps[-1]}); every output would be a "
            "plain copy of a checkpoint (steps <= tau restart the average)"
        )
    runs = []
    for s in opts.schedules:
        events = s.plan(steps)
        start = resume.start(run_name(s))
        runs.append(Run(s, run_name(s), {e.step: e for e in events}, _out_steps(events, opts, start), start))
    read_steps = sorted(
        {
            st
            for r in runs
            for st, e in r.events.items()
            if e.action != "skip" and (r.start is None or st > r.start) and st <= r.last_needed
        }
    )
    present = {c.step: c for c in checkpoints}
    for st in read_steps:
        if st not in present:
            who = next(r.name for r in runs if r.start is None or st > r.start)
            raise InputError(
                f"{Path(opts.checkpoint_dir).expanduser()}/checkpoint-{st}: needed by run {who} "
                "(processed from theta0: a new run, or --restart) but no longer on disk"
            )
    # a side file linking outside its checkpoint and the base is refused now, not after the walk
    out_steps = {st for r in runs for st in r.out_steps}
    for folder in [c.path for c in checkpoints if c.step in out_steps] + [base.path]:
        aux_files(folder, [folder, base.path])
    base_index = open_checkpoint(base.path)
    if not base_index.tensors:
        raise InputError(f"{base.path}: the base model has no tensors")
    reading = [c for c in checkpoints if c.step in read_steps]
    lora = _lora_sources(reading, base_index, opts) if is_adapter(checkpoints[0].path) else None
    if lora:
        layout, base_index, indexes = lora
    else:
        layout = None
        for c in checkpoints:
            if is_adapter(c.path):
                raise InputError(f"{c.path}: a LoRA adapter among full-weight checkpoints")
        if opts.lora_output != "merged" or opts.lora_rank is not None:
            raise UsageError("--lora-output/--lora-rank: the checkpoints are not LoRA adapters")
        indexes = {c.step: open_checkpoint(c.path, like=set(base_index.tensors)) for c in reading}
    for index in indexes.values():
        _drop_tied_head(index, base_index)
        _check_same(index, base_index, "base model", opts.cast_base)
    if not opts.out_dtype:
        _check_one_dtype(indexes)
    out_tag = TAG_OF[opts.out_dtype] if opts.out_dtype else None
    # outputs default to the checkpoints' dtypes (== theta0's unless --cast-base)
    like = indexes[read_steps[0]] if read_steps else base_index
    out_tensors = [
        TensorInfo(t.name, Path(), out_tag if out_tag and t.dtype in FLOATING else t.dtype, t.shape)
        for t in sorted(like.tensors.values(), key=lambda t: t.name)
    ]
    shards = plan_shards(out_tensors, opts.max_shard_size)
    order = [like.tensors[t.name] for s in shards for t in s.tensors]
    plan = Plan(checkpoints, base.source, base_index, indexes, runs, read_steps, out_tensors, shards)
    # the write-behind pool holds DEPTH blocks of the widest dtype a block is written in
    acc = DTYPES[TAG_OF[opts.accum_dtype]][1]
    widest = max([acc] + [DTYPES[t.dtype][1] for t in plan.out_tensors if t.dtype in FLOATING])
    plan.block = block_size(opts.max_memory, widest)
    plan.units = _units(order, runs, opts, like.read_itemsize, reserved=DEPTH * plan.block * widest)
    if layout is not None:
        plan.lora = layout
        plan.lora_rank = (opts.lora_rank or layout.config["r"]) if opts.lora_output == "adapter" else None
    state.attach(plan, resume, out)
    return plan


def _lora_sources(reading: list[Checkpoint], base: ModelIndex, opts: Options):
    """A LoRA run: (first adapter, theta0 index, {step: index}) in the view --lora-output needs."""
    if opts.lora_output not in LORA_OUTPUTS:
        raise UsageError(f"--lora-output: choose merged or adapter, got {opts.lora_output!r}")
    if opts.lora_rank is not None and (opts.lora_output != "adapter" or opts.lora_rank <= 0):
        raise UsageError("--lora-rank: a positive rank, with --lora-output adapter")
    if opts.lora_output == "adapter" and opts.out_dtype:
        raise UsageError(
            "--out-dtype: adapter outputs keep the adapter's dtype (use it with --lora-output merged)"
        )
    adapters = []
    for c in reading:
        if not is_adapter(c.path):
            raise InputError(f"{c.path}: full weights among LoRA adapter checkpoints")
        adapters.append(read_adapter(c.path, base))
        same_targets(adapters[0], adapters[-1])
    if not adapters:
        raise UsageError("no checkpoint is processed with these --tau/--phi settings")
    mode = "merged" if opts.lora_output == "merged" else "delta"
    indexes = {c.step: lora_index(a, adapters[0], base, mode) for c, a in zip(reading, adapters, strict=True)}
    return adapters[0], lora_index(None, adapters[0], base, mode), indexes
