"""The `bema stabilize` engine: stream a checkpoint trajectory into stabilized checkpoints.

Tensor-major walk: the model is cut into work units (groups of tensors, or row chunks
of one tensor along dim 0) whose working set fits `max_memory`. For each unit we read
theta0, start one `recurrence.Stabilizer` per config, walk the trajectory once (each
input chunk read once, whatever the grid size) and write that unit of every output
at its final offset. The math lives in recurrence.py; files in safetensors_io.py and
checkpoints.py. Outputs go to a temp folder under OUT and are renamed into place.
"""

from __future__ import annotations

import math
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bema_cli import __version__, output
from bema_cli import stabilize_meta as meta
from bema_cli.checkpoints import (
    Checkpoint,
    find_checkpoints,
    model_weight_files,
    resolve_base,
)
from bema_cli.errors import InputError, OutputError, UsageError
from bema_cli.recurrence import STATE_TENSORS, PlannedStep, Schedule, Stabilizer, run_name, state_key
from bema_cli.safetensors_io import (
    DTYPES,
    FLOATING,
    TAG_OF,
    ChunkReader,
    ModelIndex,
    ShardedWriter,
    TensorInfo,
    index_model,
    plan_shards,
    tensor_bytes,
)

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
    shards: list
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


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise UsageError(f"--device: choose auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def _load(reader: ChunkReader, unit: list[Piece], flat, check: bool) -> dict:
    """Read one unit into `flat` (a reused accum-dtype buffer); returns {name: raw non-float piece}."""
    import torch

    raw = {}
    for p in unit:
        t = reader.read(p.info.name, p.start, p.stop)
        if p.info.dtype in FLOATING:
            flat[p.lo : p.hi].copy_(t.reshape(-1))
        else:
            raw[p.info.name] = t
    # A sum is finite only if every term is (NaN/Inf propagate); one reduction is ~10x cheaper than
    # isfinite(...).all(). On a non-finite sum (or an overflow) the exact per-tensor check decides.
    if (
        check
        and flat.numel()
        and not math.isfinite(float(flat.sum()))
        and not bool(torch.isfinite(flat).all())
    ):
        bad = next(p for p in unit if p.hi > p.lo and not bool(torch.isfinite(flat[p.lo : p.hi]).all()))
        raise InputError(
            f"{reader.index.tensors[bad.info.name].file}: tensor {bad.info.name!r} contains NaN or Inf (use --allow-nonfinite to proceed)"
        )
    return raw


class Workspace:
    """Buffers sized for the largest work unit, allocated once and reused by every unit and step.

    Fresh multi-MB tensors per step cost a page fault per page on first touch (measured ~3.5x
    slower copies), so theta0, theta_s, theta_s - theta0, one output and the out-dtype
    conversions live here; `view(name, n)` is the first n elements.
    """

    def __init__(self, size: int, acc, device):
        self.size, self.acc, self.device = size, acc, device
        self.buffers: dict = {}

    def view(self, name: str, n: int, dtype=None):
        import torch

        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.size, dtype=dtype or self.acc, device=self.device)
        return self.buffers[name][:n]


def _write(
    writer: ShardedWriter, unit: list[Piece], result, raw: dict, out_dtypes: dict, ws: Workspace
) -> None:
    import torch

    converted = {}
    for p in unit:
        tag = out_dtypes[p.info.name]
        row = _row_bytes(p.info, tag)
        if p.info.dtype not in FLOATING:
            writer.write(p.info.name, p.start * row, tensor_bytes(raw[p.info.name]))
            continue
        if tag not in converted:
            dtype = getattr(torch, DTYPES[tag][0])
            if dtype == result.dtype and result.device.type == "cpu":
                converted[tag] = result
            else:
                converted[tag] = ws.view(f"out-{tag}", result.numel(), dtype).copy_(result).cpu()
        writer.write(p.info.name, p.start * row, tensor_bytes(converted[tag][p.lo : p.hi]))


def _row_bytes(info: TensorInfo, tag: str) -> int:
    rows = info.shape[0] if info.shape else 1
    return info.numel // rows * DTYPES[tag][1] if rows else 0


def _check_out(out: Path, runs: list[Run], overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a directory")
    for run in runs:
        if (out / run.name).exists() and not overwrite:
            raise OutputError(f"{out / run.name}: already exists (use --overwrite to replace it)")


def stabilize(opts: Options) -> dict:
    """Run (or with dry_run, only plan) one `bema stabilize`; returns the --json document."""
    t0 = time.perf_counter()
    plan = prepare(opts)
    out = Path(opts.out).expanduser().resolve()
    try:
        _check_out(out, plan.runs, opts.overwrite)
    except OutputError as exc:
        if not opts.dry_run:
            raise
        output.warn(f"{exc} (a real run would stop here)")
    _device(opts.device)  # the first check that needs torch (~2 s to import), so other errors come first
    read_bytes = plan.base_index.nbytes + sum(plan.indexes[s].nbytes for s in plan.read_steps)
    n_outputs = sum(len(r.out_steps) for r in plan.runs)
    meta0 = {"bema_version": __version__}
    written = n_outputs * ShardedWriter(out, plan.shards, meta0).nbytes  # header sizes differ by a few bytes
    doc = {"outputs": meta.outputs_of(plan, out), "read_bytes": read_bytes, "written_bytes": written}
    if opts.dry_run:
        return {
            "dry_run": True,
            **doc,
            "seconds": time.perf_counter() - t0,
            "plan": meta.dry_run_plan(plan, opts),
        }
    created_out = not out.exists()
    tmp = out / f".bema-tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise OutputError(f"{out}: cannot write the output directory ({exc.strerror or exc})") from None
    try:
        doc["written_bytes"] = _walk(plan, opts, tmp)
        for run in plan.runs:
            final = out / run.name
            if final.exists():
                _check_out(out, [run], opts.overwrite)
                shutil.rmtree(final)
            (tmp / run.name).rename(final)
        manifest = out / "manifest.json"
        (tmp / "manifest.json").write_text(output.to_json(meta.manifest(plan, out)) + "\n")
        (tmp / "manifest.json").replace(manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created_out and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    doc["seconds"] = time.perf_counter() - t0
    return doc


def _walk(plan: Plan, opts: Options, tmp: Path) -> int:
    """The tensor-major pass; writes every output folder under tmp; returns safetensors bytes written."""
    import torch

    device = _device(opts.device)
    acc = getattr(torch, opts.accum_dtype)
    ckpt = {c.step: c.path for c in plan.checkpoints}
    out_dtype = meta.out_dtype_name(plan, opts)
    out_dtypes = {t.name: t.dtype for t in plan.out_tensors}
    writers = {}
    for run in plan.runs:
        for step in run.out_steps:
            provenance = {"bema_version": __version__, "bema_run": run.name, "bema_step": str(step)}
            writers[run.name, step] = ShardedWriter(
                tmp / run.name / f"checkpoint-{step}", plan.shards, provenance
            ).open()
    if opts.allow_nonfinite:
        output.warn("--allow-nonfinite: NaN/Inf in inputs are not checked and propagate to the outputs")
    total = sum(p.info.row_bytes * (p.stop - p.start) for u in plan.units for p in u)
    with output.progress() as bar:
        task = bar.add_task("stabilizing", total=total)
        ws = Workspace(max((p.hi for u in plan.units for p in u), default=0), acc, device)
        tau = plan.runs[0].schedule.tau  # shared by the grid: burn-in happens at the same steps for all runs
        tracks: dict[tuple, list[Run]] = {}  # runs that share one state (e.g. ema and bema at one kappa)
        for run in plan.runs:
            tracks.setdefault(state_key(run.schedule), []).append(run)
        for unit in plan.units:
            size = max((p.hi for p in unit), default=0)
            theta0, theta = ws.view("theta0", size), ws.view("theta", size)
            with ChunkReader(plan.base_index) as reader:
                _load(reader, unit, theta0, not opts.allow_nonfinite)
            stabs = {key: Stabilizer(runs[0].schedule.method, theta0) for key, runs in tracks.items()}
            for step in plan.read_steps:
                with ChunkReader(plan.indexes[step]) as reader:
                    raw = _load(reader, unit, theta, not opts.allow_nonfinite)
                if step <= tau:
                    theta0.copy_(theta)  # burn-in: theta0 = theta_s, held in its own buffer
                for key, runs in tracks.items():  # one state update per distinct state, not per run
                    if step <= max(r.last_needed for r in runs):
                        event = runs[0].events[step]
                        stabs[key].advance(event, theta0 if event.action == "burnin" else theta)
                drift = None  # theta_s - theta0, computed once per step for every bema output
                for run in plan.runs:
                    if (run.name, step) not in writers:
                        continue  # the output is only computed where it is written
                    event = run.events[step]
                    if run.schedule.method == "bema" and drift is None and event.action == "update":
                        drift = torch.sub(theta, theta0, out=ws.view("drift", size))
                    out = ws.view("out", size) if run.schedule.method in ("bema", "dema") else None
                    result = stabs[state_key(run.schedule)].estimate(
                        event, theta, drift=drift, out=out, method=run.schedule.method
                    )
                    _write(writers[run.name, step], unit, result, raw, out_dtypes, ws)
                del raw
            del stabs
            bar.advance(task, sum(p.info.row_bytes * (p.stop - p.start) for p in unit))
    written = 0
    for (name, step), writer in writers.items():
        writer.close()
        run = next(r for r in plan.runs if r.name == name)
        record = meta.record(run, step, ckpt[step], plan.base_source, opts, out_dtype)
        meta.finish_folder(writer.folder, ckpt[step], plan.base_index.folder, record, opts)
        written += writer.nbytes
    return written
