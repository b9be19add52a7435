"""What a `bema stabilize` call will do, decided before any tensor data is read.

Options (the flags), Run (one config of the grid and the steps it writes), Piece and
work units (row ranges of tensors whose working set fits --max-memory), Resume and Track
(what OUT's persistent state says, the recurrence states a call walks) and Plan (the
checkpoints, theta0, the output layout), with the pure rules that shape them. prepare.py
fills a Plan from the disk; engine.py executes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from bema_cli import output
from bema_cli.errors import UsageError
from bema_cli.io.checkpoints import Checkpoint
from bema_cli.io.lora import Adapter
from bema_cli.io.reader import ModelIndex, TensorInfo
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF
from bema_cli.io.write_behind import DEPTH
from bema_cli.io.writer import Shard
from bema_cli.recurrence import (
    EMA_FAMILY,
    STATE_TENSORS,
    WINDOW_METHODS,
    PlannedStep,
    Schedule,
    last_members,
    run_name,
    state_key,
)

OUT_DTYPES = ("float32", "bfloat16", "float16", "float64")
ACCUM_DTYPES = ("float32", "float64")
LORA_OUTPUTS = ("merged", "adapter")


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
    lora: Adapter | None = None  # a LoRA run: the first adapter (modules, config)
    lora_rank: int | None = None  # set for --lora-output adapter
    resume: Resume | None = None  # OUT's persistent state as this call finds it
    tracks: list[Track] = field(default_factory=list)  # the recurrence states this call walks
    theta0_index: ModelIndex | None = None  # where theta0 is read from (None: not needed)
    theta0_folder: str | None = None  # state folder this call saves theta0 to (after a burn-in)
    state_writers: dict = field(default_factory=dict)  # state folder -> its ShardedWriter (pre-created)
    fingerprints: dict[int, list[dict]] = field(default_factory=dict)  # step -> its files as read (state.py)


def grid(
    methods: list[str],
    kappas: list[float] | None = None,
    etas: list[float] | None = None,
    *,
    windows: list[int] | None = None,
    schedules: list[str] | None = None,
    swa_starts: list[int] | None = None,
    sigma_rels: list[float] | None = None,
    power_gammas: list[float] | None = None,
    **common,
) -> list[Schedule]:
    """Every combination of each method with the lists of the parameters it uses, validated, one per
    output run name. A list given for a parameter that no method of the grid uses is an error
    (None: not given, the default).

    Methods without bias correction (ema, dema, vanilla) record eta = inf, and BEMA with eta = inf
    (alpha = 0) is the EMA itself, so `--method bema,ema --eta 0.2,inf` writes that EMA once.
    """
    if not methods:
        raise UsageError("--method: no method given")
    for flag, values, users in (
        ("--kappa", kappas, EMA_FAMILY),
        ("--eta", etas, ("bema", "ouema")),
        ("--window", windows, WINDOW_METHODS),
        ("--schedule", schedules, ("wsm",)),
        ("--swa-start", swa_starts, ("swa",)),
        ("--sigma-rel", sigma_rels, ("power",)),
        ("--power-gamma", power_gammas, ("power",)),
    ):
        if values is not None and not set(methods) & set(users):
            raise UsageError(
                f"{flag}: applies to {', '.join(users)}, and the grid's methods ({', '.join(methods)}) include none"
            )
    kappas, etas = kappas or [0.5], etas or [0.2]
    ema_like = set(methods) & set(EMA_FAMILY)
    for kappa in set(kappas) & ({0.0} | {k for k in kappas if k > 1}) if ema_like else ():
        output.warn(
            f"--kappa {kappa:g}: beta = 1 at every step, so the EMA is the current iterate (no averaging)"
            if kappa == 0
            else f"--kappa {kappa:g} > 1: the betas sum to a finite total, so the EMA never forgets theta0"
        )
    check_grid_size(
        grid_size(methods, kappas, etas, windows, schedules, swa_starts, sigma_rels, power_gammas)
    )
    powers = [{"sigma_rel": x} for x in sigma_rels or ()] + [{"power_gamma": g} for g in power_gammas or ()]
    own = {  # the runs of each method that is not of the EMA family
        "lawa": [{"window": k} for k in windows or [None]],
        "wsm": [{"window": k, "merge_schedule": g} for k in windows or [None] for g in schedules or [None]],
        "swa": [{"swa_start": st} for st in swa_starts or [None]],
        "power": powers or [{}],
    }
    out: dict[str, Schedule] = {}
    for method in methods:
        if method in own:
            for params in own[method]:
                s = Schedule(method=method, **params, **common).resolved()
                out.setdefault(run_name(s), s)
            continue
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


GRID_LIMIT = 4096  # configs in one grid: a sweep holds each one's state, stabilize writes each one


def grid_size(methods, kappas=None, etas=None, windows=None, schedules=None, swa_starts=None,
              sigma_rels=None, power_gammas=None) -> int:  # fmt: skip
    """How many configs `grid` would build (before duplicates merge), counted without building them."""

    def n(values) -> int:
        return len(values) if values else 1

    own = {"lawa": n(windows), "wsm": n(windows) * n(schedules), "swa": n(swa_starts),
           "power": max(1, len(sigma_rels or ()) + len(power_gammas or ()))}  # fmt: skip
    return sum(own.get(m, n(kappas) * n(etas)) for m in methods)


def check_grid_size(count: int, where: str = "the grid") -> None:
    if count > GRID_LIMIT:
        raise UsageError(f"{where}: {count:,} configs, over the limit of {GRID_LIMIT:,}; split the grid")


# --config FILE: each method with its own parameter lists (mergekit-style), keys as on the command line
CONFIG_KEYS = {
    **{m: ("kappa", "eta") for m in ("bema", "ouema")},
    **{m: ("kappa",) for m in ("ema", "dema")},
    "vanilla": (), "lawa": ("window",), "wsm": ("window", "schedule"), "swa": ("swa_start",),
    "power": ("sigma_rel", "power_gamma"),
}  # fmt: skip
CONFIG_COMMON = ("preset", "gamma", "rho", "tau", "phi", "beta_min")
GRID_ARGS = {"kappa": "kappas", "eta": "etas", "window": "windows", "schedule": "schedules",
             "swa_start": "swa_starts", "sigma_rel": "sigma_rels", "power_gamma": "power_gammas"}  # fmt: skip


def grid_from_config(path: str, **common) -> list[Schedule]:
    """The grid a YAML file describes: `methods:` maps each method to its own parameter lists
    (a scalar is a list of one), beside optional shared settings (`gamma`, `rho`, `tau`, `phi`,
    `beta_min`, `preset`) that override `common`. Unlike the flags, lists do not cross methods:

        methods:
          bema: {kappa: [0.5], eta: [0.2, 0.5]}
          ema: {kappa: 0.5}
          wsm: {window: [4, 8], schedule: [minus-sqrt, linear]}
    """
    import yaml

    from bema_cli.errors import InputError

    try:
        doc = yaml.load(Path(path).expanduser().read_text(), Loader=_strict_loader(yaml))  # noqa: S506 (a SafeLoader)
    except OSError as exc:
        raise InputError(f"{path}: cannot read the grid config ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deeply for a grid config") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("methods"), dict) or not doc["methods"]:
        raise InputError(f"{path}: expected a mapping with a non-empty 'methods:' mapping")
    unknown = sorted(set(doc) - {"methods", *CONFIG_COMMON})
    if unknown:
        raise InputError(f"{path}: unknown key {unknown[0]!r} (allowed: methods, {', '.join(CONFIG_COMMON)})")
    common = {**common, **{k: _config_value(path, k, doc[k]) for k in CONFIG_COMMON if k in doc}}
    per_method = {}
    for method, params in doc["methods"].items():
        if method not in CONFIG_KEYS:
            raise InputError(f"{path}: unknown method {method!r} (choose from {', '.join(CONFIG_KEYS)})")
        params = params or {}
        if not isinstance(params, dict):
            raise InputError(f"{path}: methods.{method} must map parameter names to values or lists")
        bad = sorted(set(params) - set(CONFIG_KEYS[method]))
        if bad:
            allowed = ", ".join(CONFIG_KEYS[method]) or "none"
            raise InputError(
                f"{path}: methods.{method}.{bad[0]} is not a {method} parameter (allowed: {allowed})"
            )
        per_method[method] = {
            GRID_ARGS[k]: [
                _config_value(path, f"methods.{method}.{k}", x) for x in (v if isinstance(v, list) else [v])
            ]
            for k, v in params.items()
        }
    # counted before anything is built: the grid's size over every method
    check_grid_size(sum(grid_size([m], **lists) for m, lists in per_method.items()), path)
    out: dict[str, Schedule] = {}
    for method, lists in per_method.items():
        try:  # the flags' own range checks, said of the file
            built = grid([method], **lists, **common)
        except UsageError as exc:
            raise InputError(f"{path}: methods.{method}: {str(exc).lstrip('-')}") from None
        for s in built:
            out.setdefault(run_name(s), s)
    return list(out.values())


def _strict_loader(yaml):
    """yaml's SafeLoader, refusing a key given twice in one mapping (PyYAML keeps the last silently,
    which drops a grid member)."""

    class Strict(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (line {key_node.start_mark.line + 1})",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Strict


WHOLE_KEYS = ("window", "swa_start", "tau", "phi")  # the flags that take whole numbers


def _config_value(path: str, where: str, value):
    """A YAML value as the flag would parse it: windows, steps, tau and phi whole numbers, schedule
    and preset names, the rest numbers ('inf' and .inf alike); its range is checked as the flag's."""
    from bema_cli.errors import InputError

    key = where.rsplit(".", 1)[-1]
    if key in ("schedule", "preset"):
        if not isinstance(value, str):
            raise InputError(f"{path}: {where}: a {key} name, got {value!r}")
        return value
    try:
        if isinstance(value, bool):
            raise ValueError
        if key in WHOLE_KEYS:
            if isinstance(value, float) or int(value) != float(value):
                raise ValueError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        kind = "a whole number" if key in WHOLE_KEYS else "a number"
        raise InputError(f"{path}: {where}: {kind}, got {value!r}") from None


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
    """Accum-dtype buffers per element that `_walk` holds: theta0, theta_s, one set of state per
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
    return 2 + sum(distinct.values()) + scratch


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
