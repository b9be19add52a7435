"""What `bema stabilize` writes besides tensors: bema.json, manifest.json, the --json document, the plan.

These records are a contract with `bema eval` and `bema report` (the output layout:
docs/cli.md, "bema stabilize"): field names here must not change without telling their owners.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from bema_cli import __version__, card, output
from bema_cli.errors import InputError
from bema_cli.io import provenance
from bema_cli.io.aux_files import copy_aux_files
from bema_cli.io.checkpoints import read_json
from bema_cli.io.commit import MANIFEST
from bema_cli.io.safetensors import DTYPES, FLOATING
from bema_cli.io.writer import ShardedWriter
from bema_cli.schedule import WINDOW_METHODS, Schedule, last_members, merge_coefficients
from bema_cli.stabilize.vectors import coefficient_vectors

if TYPE_CHECKING:
    from bema_cli.stabilize.plan import Options, Plan, Run
    from bema_cli.stabilize.unit import Outputs


def hyper(s: Schedule, leave_out: tuple[str, ...] = ()) -> dict:
    """The run's hyperparameters as records name them (schedule.Schedule.params)."""
    return {k: v for k, v in s.params().items() if k not in leave_out}


def record(
    run: Run, step: int, source: Path, base_source: str, opts: Options, out_dtype: str, vector: dict | None
) -> dict:
    """The bema.json of one output (contract shared with eval/report). Its inputs are named, never by
    their absolute local paths (provenance.input_name); `bema verify` finds them again. `vector`:
    the output as its coefficients keyed by "theta0" and step (stabilize/vectors.py; None for a
    LoRA run), under `coefficients` as every record bema writes has it."""
    return {
        "bema_version": __version__,
        "run": run.name,
        "written_from": "walk",  # the fused pass's recurrences (verify walks it again), not a vector
        **hyper(run.schedule),
        "step": step,
        **weights(run, step),
        **({"coefficients": vector} if vector is not None else {}),
        "source_checkpoint": provenance.input_name(source, opts.out),
        "theta0_source": provenance.input_name(base_source, opts.out),
        "accum_dtype": opts.accum_dtype,
        "out_dtype": out_dtype,
        # the checkpoints this output's trajectory read (a gap passed over with --allow-gaps shows here)
        "averaged_steps": sorted(s for s, e in run.events.items() if s <= step and e.action != "skip"),
        "allow_gaps": opts.allow_gaps,
        **({"durations": opts.durations} if opts.durations else {}),
    }


def finish_lora(folder: Path, plan: Plan, shown: Path) -> dict:
    """The `lora` record of an output; for --lora-output adapter, first turn the folder's stabilized
    deltas into a PEFT adapter of rank plan.lora_rank (truncated SVD, errors recorded and warned about,
    naming the output as it will be, `shown`: `folder` is still the private temporary one)."""
    from bema_cli.io.checkpoints import model_weight_files
    from bema_cli.io.lora_out import WARN_ERROR, write_adapter
    from bema_cli.io.safetensors import index_model

    config = plan.lora.config
    info = {
        "output": "merged" if plan.lora_rank is None else "adapter",
        "r": config["r"],
        "lora_alpha": config.get("lora_alpha", 8),
        "use_rslora": bool(config.get("use_rslora")),
        "modules": len(plan.lora.modules),
        "modules_to_save": sorted(plan.lora.full),
    }
    if plan.lora_rank is None:
        return info
    files = model_weight_files(folder)
    header = provenance.adapter_header(files[0], {"output": "adapter", "rank": plan.lora_rank})
    with index_model(folder, files).open() as deltas:
        errors = write_adapter(folder, deltas, plan.lora, plan.lora_rank, plan.base_source, header)
    for f in [*files, folder / "model.safetensors.index.json"]:
        f.unlink(missing_ok=True)
    worst = max(errors.values(), default=0.0)
    if worst > WARN_ERROR:
        module = max(errors, key=errors.get)
        output.warn(
            f"{shown}: rank {plan.lora_rank} truncation loses {worst:.3g} of the stabilized delta of "
            f"{module} (relative Frobenius norm); a larger --lora-rank or --lora-output merged is exact"
        )
    return {**info, "rank": plan.lora_rank, "max_truncation_error": worst, "truncation_error": errors}


def out_dtype_name(plan: Plan, opts: Options) -> str:
    if opts.out_dtype:
        return opts.out_dtype
    tags = {t.dtype for t in plan.out_tensors if t.dtype in FLOATING}  # the checkpoints' (--cast-base)
    return DTYPES[tags.pop()][0] if len(tags) == 1 else "mixed"


def finish_folder(
    folder: Path,
    source: Path,
    base_dir: Path,
    base_source: str,
    record: dict,
    opts: Options,
    model: bool = True,
) -> None:
    """Config/tokenizer files (a model's from the checkpoint, else the base; an adapter's from its
    checkpoint only, so it is not mistaken for a model folder), bema.json and the model card."""
    copy_aux_files(folder, [source, base_dir] if model else [source], inside=[source, base_dir])
    if record["out_dtype"] != "mixed":
        _set_config_dtype(folder / "config.json", record["out_dtype"])
    (folder / "bema.json").write_text(output.to_json(record) + "\n")
    base_model = card.hub_base_model(base_source, base_dir)
    (folder / "README.md").write_text(
        card.card(json.loads(output.to_json(record)), base_model, adapter=not model)
    )


def _set_config_dtype(path: Path, dtype: str) -> None:
    """config.json names the dtype the tensors are written in (transformers and vLLM load by it)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # none, or not ours to repair: copied as it was
    if not isinstance(cfg, dict):
        return
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["dtype"]
    if any(cfg.get(k) != dtype for k in keys):
        cfg.update(dict.fromkeys(keys, dtype))
        path.write_text(json.dumps(cfg, indent=2) + "\n")


def output_folder(out: Path, run: str, step: int) -> Path:
    """Where an output lands: OUT/<run>/checkpoint-<step> (written first under OUT's temporary folder)."""
    return out / run / f"checkpoint-{step}"


def outputs_of(plan: Plan, out: Path) -> list[dict]:
    """The `outputs` list of the --json document (paths absolute)."""
    return [
        {
            "run": run.name,
            **hyper(run.schedule, leave_out=("preset", "beta_min")),
            "step": step,
            "path": str(output_folder(out, run.name, step)),
            **weights(run, step),
        }
        for run in plan.runs
        for step in run.out_steps
    ]


def weights(run: Run, step: int) -> dict:
    """The weights an output was made with: (alpha_s, beta_s); a window merge's members and
    merge weights (fewer than K while the window fills)."""
    event = run.events[step]
    out = {"alpha": event.alpha, "beta": event.beta}
    if run.schedule.method in WINDOW_METHODS and event.action == "update":
        steps = last_members(run.events, step, run.schedule.window)
        coefficients = merge_coefficients(run.schedule.merge_schedule, len(steps))
        out.update(members=len(steps), member_steps=steps, merge_weights=coefficients)
    return out


def read_manifest(out: Path) -> dict | None:
    """OUT/manifest.json if there is one, validated (InputError naming it when it is not a manifest)."""
    path = out / MANIFEST
    if not path.exists() and not path.is_symlink():
        return None
    doc = read_json(path)
    runs = doc.get("runs", []) if isinstance(doc, dict) else None
    ok = isinstance(runs, list) and all(
        isinstance(r, dict)
        and isinstance(r.get("run"), str)
        and isinstance(r.get("outputs", []), list)
        and all(isinstance(o, dict) and isinstance(o.get("path"), str) for o in r.get("outputs", []))
        for r in runs
    )
    if not ok:
        raise InputError(
            f"{path}: not a bema manifest (expected an object whose 'runs' lists runs with a name and outputs)"
        )
    return doc


def read_record(path: Path) -> dict:
    """A checkpoint folder's bema.json, validated: an object, 'run' a string, 'step' an integer if present."""
    record = read_json(path)
    if not isinstance(record, dict):
        raise InputError(f"{path}: not a bema.json record (not a JSON object)")
    if not isinstance(record.get("run", ""), str):
        raise InputError(f"{path}: 'run' is {record['run']!r}, not a name")
    step = record.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InputError(f"{path}: 'step' is {step!r}, not a step number")
    return record


def is_bema_run(folder: Path, old_manifest: dict | None) -> bool:
    """Whether `--overwrite` may replace this folder: a real folder that OUT's manifest lists as a run
    or whose checkpoint-*/bema.json names it. Anything else is never deleted."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    if old_manifest and any(r["run"] == folder.name for r in old_manifest["runs"]):
        return True
    for path in folder.glob("checkpoint-*/bema.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("run") == folder.name:
            return True
    return False


def manifest(
    plan: Plan,
    old_manifest: dict | None,
    with_new: bool = True,
    outputs: dict[str, list[int]] | None = None,
    out: Path | None = None,
) -> dict:
    """OUT/manifest.json: the old one's runs, minus same-named runs of this call, plus (with_new) this
    call's runs. Without them it is the interim manifest written while run folders are swapped.
    `outputs`: run -> every output step on disk after the commit (a continued run keeps earlier ones).
    theta0 and the checkpoints are named as bema.json names them (against OUT), never by a local path."""
    old_runs = old_manifest["runs"] if old_manifest else []
    runs = [
        {
            "run": run.name,
            **hyper(run.schedule),
            "outputs": [
                {"step": st, "path": f"{run.name}/checkpoint-{st}", **weights(run, st)}
                for st in (outputs[run.name] if outputs else run.out_steps)
            ],
        }
        for run in plan.runs
    ]
    names = {r["run"] for r in runs}
    kept = [r for r in old_runs if r["run"] not in names]
    if not with_new:
        return {**(old_manifest or {}), "runs": kept}
    return {
        "bema_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "theta0_source": provenance.input_name(plan.base_source, out),
        "checkpoints": [
            {"step": c.step, "path": provenance.input_name(c.path, out)} for c in plan.checkpoints
        ],
        "runs": kept + runs,
    }


def dry_run_plan(plan: Plan, opts: Options) -> dict:
    """What --dry-run shows: checkpoints and the action/alpha/beta of every run at each, shards, units."""
    return {
        "theta0_source": plan.base_source,
        "checkpoints": [
            {"step": c.step, "path": str(c.path), "read": c.step in plan.read_steps} for c in plan.checkpoints
        ],
        "runs": [
            {
                "run": r.name,
                "events": [
                    {
                        "step": e.step,
                        "action": e.action,
                        "alpha": e.alpha,
                        "beta": e.beta,
                        "output": e.step in r.out_steps,
                    }
                    for e in r.events.values()
                ],
            }
            for r in plan.runs
        ],
        "shards": [
            {"file": s.filename, "bytes": s.data_size, "tensors": len(s.tensors)} for s in plan.shards
        ],
        "work_units": len(plan.units),
        "max_memory": opts.max_memory,
        "accum_dtype": opts.accum_dtype,
        "device": opts.device,
    }


def input_prints(plan: Plan) -> dict[str, str]:
    """{"theta0": print, "<step>": print} of every input of the trajectory (io/provenance.print_of):
    read from disk, or for a step an earlier call consumed, from the state's record of it (the
    checkpoint may be gone), so a continued run's outputs name the same inputs as a one-shot run's."""
    from bema_cli.io import provenance

    stored = (plan.resume.stored or {}) if plan.resume is not None else {}
    consumed = {int(s["step"]): s.get("files", []) for s in stored.get("steps", [])}
    ckpt = {c.step: c.path for c in plan.checkpoints}
    prints = {"theta0": provenance.input_print(plan.base_index.folder)}
    for step in sorted(plan.runs[0].events):
        if step in ckpt:
            prints[str(step)] = provenance.input_print(ckpt[step])
        elif step in consumed:
            prints[str(step)] = provenance.print_of(consumed[step])
    return prints


def open_outputs(plan: Plan, opts: Options, tmp: Path) -> Outputs:
    """Pre-create every output's files at full size, headers included (the layout is planned up front),
    each header carrying the output's provenance (io/provenance.py: its record, the fingerprints of
    its inputs, its coefficients)."""
    outputs = {}
    ckpt = {c.step: c.path for c in plan.checkpoints}
    prints = input_prints(plan) if plan.lora is None else {}
    vectors = coefficient_vectors(plan) if plan.lora is None else None
    out_dtype = out_dtype_name(plan, opts)
    for run in plan.runs:
        for step in run.out_steps:
            coefficients = (vectors or {}).get((run.name, step))
            made = record(run, step, ckpt[step], plan.base_source, opts, out_dtype, coefficients)
            inputs = {k: v for k, v in prints.items() if k == "theta0" or int(k) in made["averaged_steps"]}
            provenance_doc = {
                "bema_version": __version__,
                "bema_run": run.name,
                "bema_step": str(step),
                **provenance.metadata(made, inputs, coefficients),
            }
            outputs[run.name, step] = ShardedWriter(
                tmp / run.name / f"checkpoint-{step}", plan.shards, provenance_doc
            ).open()
    return outputs


def finish_outputs(plan: Plan, opts: Options, outputs: Outputs) -> int:
    """After every unit is written: index files, bema.json (the record its header carries, as
    open_outputs made it), config/tokenizer copies; returns bytes written."""
    ckpt = {c.step: c.path for c in plan.checkpoints}
    out, written = Path(opts.out).expanduser().resolve(), 0
    for (name, step), writer in outputs.items():
        writer.close()
        made = json.loads(writer.metadata[provenance.KEY])["record"]
        if plan.lora is not None:
            made["lora"] = finish_lora(writer.folder, plan, output_folder(out, name, step))
        finish_folder(
            writer.folder,
            ckpt[step],
            plan.base_index.folder,
            plan.base_source,
            made,
            opts,
            plan.lora_rank is None,
        )
        written += writer.nbytes
    return written
