"""Build a `bema stabilize` Plan from the disk: the checkpoints, theta0, OUT's state, the layout.

plan.py holds what a plan is (and the pure planning rules); this module reads what it needs to
fill one (checkpoint indexes, LoRA adapters, OUT's persistent state through state.py) before
any tensor data is read. engine.py executes the result.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from bema_cli import output
from bema_cli.errors import InputError, UsageError
from bema_cli.io.aux_files import aux_files
from bema_cli.io.checkpoints import Checkpoint, find_checkpoints, is_adapter, resolve_base
from bema_cli.io.fingerprint import weight_files
from bema_cli.io.lora import lora_index, read_adapter, same_targets
from bema_cli.io.read_ahead import ahead_blocks, default_readers
from bema_cli.io.reader import ModelIndex, TensorInfo, has_weights, open_checkpoint
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF
from bema_cli.io.write_behind import DEPTH
from bema_cli.io.writer import MAX_SHARD_SIZE, plan_shards
from bema_cli.schedule import WINDOW_METHODS, last_members, run_name
from bema_cli.stabilize import plan as planning
from bema_cli.stabilize import state
from bema_cli.stabilize.plan import ACCUM_DTYPES, LORA_OUTPUTS, OUT_DTYPES, Options, Plan, Run

TIED_HEAD = "lm_head.weight"  # HF name of the output embedding, tied to the input one by tie_word_embeddings


def resolve_state(opts: Options) -> Options:
    """Decide whether this call keeps a persistent state when the user did not say (--state/--no-state).

    A full trajectory is what a later call continues, so it keeps one; a --final-only result is
    a one-off (a grid sweep, say) whose state would double the bytes written, so it keeps none,
    unless OUT already has a state: then its runs are continued from it as before.
    """
    if opts.write is None or opts.write.no_state is not None:  # a plan that writes nothing keeps nothing
        return opts
    kept = (Path(opts.out).expanduser() / state.STATE_DIR).exists()
    return replace(opts, write=replace(opts.write, no_state=opts.final_only and not kept))


def _stored(opts: Options) -> tuple[Path | None, dict | None]:
    """(where a writing plan writes, what OUT's persistent state holds); (None, None) for a plan that
    writes nothing (`Options.write` None): it reads no state."""
    write = opts.write
    if write is None:
        return None, None
    if opts.out is None or write.no_state is None:
        raise ValueError("a plan that writes names OUT, and resolve_state decides its no_state first")
    out = Path(opts.out).expanduser().resolve()
    stored = state.read(out, write.recompute)
    if write.no_state and stored is not None:
        raise UsageError(
            f"--no-state: {out / state.STATE_DIR} exists (these runs are continued from it); "
            "drop --no-state or choose another --out"
        )
    return out, stored


def thin(checkpoints: list[Checkpoint], interval: int) -> list[Checkpoint]:
    """Megatron-LM's merge selection: from the target (the last) step back, each checkpoint kept is at
    least `interval` steps before the one kept after it."""
    kept = checkpoints[-1:]
    for c in reversed(checkpoints[:-1]):
        if kept[-1].step - c.step >= interval:
            kept.append(c)
    return kept[::-1]


def select_inputs(checkpoints: list[Checkpoint], opts: Options) -> list[Checkpoint]:
    """--min-interval (the run as saved is checked for gaps first) and --min-checkpoints."""
    for flag, value in (("--min-interval", opts.min_interval), ("--min-checkpoints", opts.min_checkpoints)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: must be >= 1, got {value}")
    if opts.min_interval:
        from bema_cli.stabilize import gaps

        gaps.check_gaps(checkpoints, [], opts.allow_gaps)  # a gap in the run is not a thinning
        checkpoints = thin(checkpoints, opts.min_interval)
    if opts.min_checkpoints and len(checkpoints) < opts.min_checkpoints:
        where = "the listed checkpoints" if opts.checkpoint_dir == "-" else opts.checkpoint_dir
        thinned = f" after thinning to every {opts.min_interval} steps" if opts.min_interval else ""
        raise InputError(
            f"{where}: {len(checkpoints)} checkpoint(s){thinned}, fewer than --min-checkpoints {opts.min_checkpoints}"
        )
    return checkpoints


def prepare(opts: Options) -> Plan:
    """Everything decided before a byte of tensor data is read: files, plan, layout, work units."""
    if opts.accum_dtype not in ACCUM_DTYPES:
        raise UsageError(f"--accum-dtype: choose from {', '.join(ACCUM_DTYPES)}, got {opts.accum_dtype!r}")
    if opts.out_dtype is not None and opts.out_dtype not in OUT_DTYPES:
        raise UsageError(f"--out-dtype: choose from {', '.join(OUT_DTYPES)}, got {opts.out_dtype!r}")
    write = opts.write
    if opts.max_memory <= 0 or (write is not None and write.max_shard_size <= 0):
        raise UsageError("--max-memory and --max-shard-size must be positive")
    if len({s.tau for s in opts.schedules}) > 1:
        raise UsageError("--tau: every config of one run must share the burn-in (theta0 is shared)")
    checkpoints = opts.checkpoints or find_checkpoints(opts.checkpoint_dir)
    if opts.ready_steps is not None:
        checkpoints = [c for c in checkpoints if c.step in set(opts.ready_steps)]
    checkpoints = select_inputs(checkpoints, opts)
    if opts.base == "first" and is_adapter(checkpoints[0].path):
        raise UsageError("--base first: a LoRA run starts from the base model it adapts; pass --base DIR")
    out, stored = _stored(opts)
    base = resolve_base(
        opts.base or (stored and stored["theta0"].get("source")), checkpoints, check=has_weights
    )
    if not opts.base and not stored and base.path != checkpoints[0].path:  # say what was inferred
        named_by = "adapter_config.json" if is_adapter(checkpoints[0].path) else "config.json"
        output.log(
            f"base model (theta0): {base.source}, as {checkpoints[0].path / named_by} names it (--base to choose)"
        )
    _check_tokenizer(base.path, checkpoints[-1].path)
    resume = state.resume(opts, out, stored, checkpoints, base.source, weight_files(base.path))
    steps = resume.steps
    tau = opts.schedules[0].tau if opts.schedules else 0
    if tau > 0 and tau >= steps[-1] and opts.ready_steps is None:  # --follow: later steps will come
        raise UsageError(
            f"--tau {tau}: at or beyond the last checkpoint step ({steps[-1]}); every output would be a "
            "plain copy of a checkpoint (steps <= tau restart the average)"
        )
    for s in opts.schedules:
        if s.method == "swa" and s.swa_start is not None and s.swa_start > steps[-1]:
            raise UsageError(
                f"--swa-start {s.swa_start}: after the last checkpoint step ({steps[-1]}); swa would average nothing"
            )
    runs = []
    for s in opts.schedules:
        events = s.plan(steps)
        start = resume.start(run_name(s))
        runs.append(
            Run(s, run_name(s), {e.step: e for e in events}, planning.out_steps(events, opts, start), start)
        )
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
    # a continued window re-reads the members its ring holds from the run where they still are
    ring = {
        st
        for r in runs
        if r.out_steps and r.schedule.method in WINDOW_METHODS
        for st in last_members(r.events, r.start, r.schedule.window - 1)
    } - set(read_steps)
    reading = [c for c in checkpoints if c.step in read_steps or c.step in ring]
    lora_output, lora_rank = (write.lora_output, write.lora_rank) if write is not None else ("merged", None)
    lora = (
        _lora_sources(reading, base_index, lora_output, lora_rank, opts.out_dtype)
        if is_adapter(checkpoints[0].path)
        else None
    )
    if lora:
        layout, base_index, indexes = lora
    else:
        layout = None
        for c in checkpoints:
            if is_adapter(c.path):
                raise InputError(f"{c.path}: a LoRA adapter among full-weight checkpoints")
        if lora_output != "merged" or lora_rank is not None:
            raise UsageError("--lora-output/--lora-rank: the checkpoints are not LoRA adapters")
        indexes = {c.step: open_checkpoint(c.path, like=set(base_index.tensors)) for c in reading}
    for index in indexes.values():
        drop_tied_head(index, base_index)
        check_same(index, base_index, "base model", opts.cast_base)
    if not opts.out_dtype:
        _check_one_dtype(indexes)
    out_tag = TAG_OF[opts.out_dtype] if opts.out_dtype else None
    # outputs default to the checkpoints' dtypes (== theta0's unless --cast-base)
    like = indexes[read_steps[0]] if read_steps else base_index
    out_tensors = [
        TensorInfo(t.name, Path(), out_tag if out_tag and t.dtype in FLOATING else t.dtype, t.shape)
        for t in sorted(like.tensors.values(), key=lambda t: t.name)
    ]
    shards = plan_shards(out_tensors, write.max_shard_size if write is not None else MAX_SHARD_SIZE)
    order = [like.tensors[t.name] for s in shards for t in s.tensors]
    plan = Plan(checkpoints, base.source, base_index, indexes, runs, read_steps, out_tensors, shards)
    # reserved beside the units: the write-behind pool (DEPTH blocks of the widest dtype a block is
    # written in) and the blocks read ahead (in the widest dtype the inputs hold)
    acc = DTYPES[TAG_OF[opts.accum_dtype]][1]
    widest = max([acc] + [DTYPES[t.dtype][1] for t in plan.out_tensors if t.dtype in FLOATING])
    widest_read = max([DTYPES[t.dtype][1] for t in order if t.dtype in FLOATING], default=0)
    plan.block = planning.block_size(opts.max_memory, widest)
    plan.readers = opts.readers or default_readers()
    reserved = DEPTH * plan.block * widest + ahead_blocks(plan.readers) * plan.block * widest_read
    plan.units = planning.cut_units(order, runs, opts, like.read_itemsize, reserved=reserved)
    if layout is not None:
        plan.lora = layout
        plan.lora_rank = (lora_rank or layout.config["r"]) if lora_output == "adapter" else None
    state.attach(plan, resume, out)
    return plan


def _check_tokenizer(base: Path, checkpoint: Path) -> None:
    """A base of the run's shape but another tokenizer is not the model the run started from: warned
    (a run that added tokens differs too, and may be fine). Compared by what makes a token's id (the
    model's vocabulary, merges and settings, the added tokens), not as text: the HF Trainer saves the
    tokenizer again through transformers, which writes "" where `tokenizers` wrote null."""
    import json

    mine, theirs = base / "tokenizer.json", checkpoint / "tokenizer.json"
    try:
        same = _token_ids(json.loads(mine.read_text())) == _token_ids(json.loads(theirs.read_text()))
    except (OSError, ValueError, AttributeError, TypeError):
        return  # none, or not one to compare: nothing said
    if not same:
        output.warn_once(
            f"{base}: its tokenizer differs from the run's ({theirs}): theta0 may not be the model "
            "this run started from (or the run added tokens); --base names the right one"
        )


def _token_ids(doc: dict) -> tuple:
    """What decides a tokenizer.json's token ids: its model's vocabulary, merges (a "a b" string or an
    [a, b] pair alike) and other settings (null, "" and false alike: each means none), and its added
    tokens' ids and texts."""
    model = dict(doc.get("model") or {})
    merges = [
        tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.pop("merges", None) or []
    ]
    vocab = model.pop("vocab", None)
    settings = {k: v for k, v in model.items() if v not in (None, "", False)}
    added = sorted((t.get("id"), t.get("content")) for t in doc.get("added_tokens") or [])
    return vocab, merges, settings, added


def drop_tied_head(index: ModelIndex, base: ModelIndex) -> None:
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


def check_same(index: ModelIndex, base: ModelIndex, what: str, cast_base: bool = False) -> None:
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


def _lora_sources(
    reading: list[Checkpoint],
    base: ModelIndex,
    lora_output: str,
    lora_rank: int | None,
    out_dtype: str | None,
):
    """A LoRA run: (first adapter, theta0 index, {step: index}) in the view --lora-output needs."""
    if lora_output not in LORA_OUTPUTS:
        raise UsageError(f"--lora-output: choose merged or adapter, got {lora_output!r}")
    if lora_rank is not None and (lora_output != "adapter" or lora_rank <= 0):
        raise UsageError("--lora-rank: a positive rank, with --lora-output adapter")
    if lora_output == "adapter" and out_dtype:
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
    mode = "merged" if lora_output == "merged" else "delta"
    indexes = {c.step: lora_index(a, adapters[0], base, mode) for c, a in zip(reading, adapters, strict=True)}
    return adapters[0], lora_index(None, adapters[0], base, mode), indexes
