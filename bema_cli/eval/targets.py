"""What `bema eval` evaluates: model folders, each with its run, step and stabilizer.

Inputs are any mix of raw `checkpoint-<s>` folders (run "vanilla"), `bema stabilize`
checkpoint folders (run and hyperparameters from bema.json), `bema stabilize` output
directories (expanded through manifest.json) and training directories (their checkpoint-*
children). `--base` is evaluated once and stands in as step 0 of every run. A model folder
with no step (not `checkpoint-<s>`, no bema.json or trainer_state.json step) is labelled by
its folder name: `bema report` shows it as a reference line, not a point on a curve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.eval.chat import has_tokenizer
from bema_cli.io.checkpoints import (
    find_checkpoints,
    is_run_dir,
    resolve_model,
    step_of,
)
from bema_cli.io.provenance import find_input
from bema_cli.io.reader import safetensors_files
from bema_cli.schedule import RECORD_KEYS
from bema_cli.stabilize.meta import read_manifest, read_record

# bema.json keys that describe the stabilizer (per-step alpha/beta and paths are not hyperparameters)
STABILIZER_KEYS = (*RECORD_KEYS, "accum_dtype", "out_dtype", "theta0_source")
VANILLA = {"method": "vanilla"}
SWEEP_SCHEME = "sweep:"  # model_path of a `bema sweep` config's record: evaluated in memory, never on disk


@dataclass
class Target:
    """One model folder to evaluate and where its results go."""

    path: Path
    run: str
    step: int | None
    stabilizer: dict
    is_base: bool = False
    runs: list = field(default_factory=list)  # base only: every (run, stabilizer) it stands in for

    @property
    def label(self) -> str:
        """How logs and step-less records name the model: `run@step`, or the folder's name."""
        return self.path.name if self.step is None else f"{'base' if self.is_base else self.run}@{self.step}"

    def record_runs(self) -> list[tuple[str, dict]]:
        """The (run, stabilizer) pairs a result of this model is recorded under."""
        return self.runs if self.is_base else [(self.run, self.stabilizer)]


def check_model_dir(path: Path) -> None:
    """Fail early, before any engine starts, on folders that cannot be evaluated."""
    if not path.is_dir():
        raise InputError(f"{path}: not a directory")
    if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
        raise InputError(
            f"{path}: a PEFT LoRA adapter, not a model folder; evaluate the merged outputs of "
            "bema stabilize (--lora-output merged, the default), or --method vanilla for merged copies of the run"
        )
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: no config.json (not a model folder)")
    safetensors_files(path)  # the rule the vLLM weight swap uses (safetensors only): validated once
    if not has_tokenizer(path):
        raise InputError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")


def _model_target(path: Path) -> Target:
    bema = path / "bema.json"
    if bema.is_file():
        meta = read_record(bema)
        stabilizer = {k: meta[k] for k in STABILIZER_KEYS if k in meta}
        step = meta["step"] if isinstance(meta.get("step"), int) else step_of(path)
        return Target(path, str(meta.get("run", "vanilla")), step, stabilizer or dict(VANILLA))
    return Target(path, "vanilla", step_of(path), dict(VANILLA))


def expand_inputs(inputs: list[str]) -> list[Target]:
    """Model folders, stabilize outputs (manifest.json) and training dirs (checkpoint folders of any
    layout bema stabilize reads: checkpoint-N, step_N, step-N, global_stepN, iter_N)."""
    targets = []
    for text in inputs:
        path = Path(text).resolve()
        if not path.exists():
            raise InputError(f"{text}: no such file or directory")
        if (path / "manifest.json").is_file():
            manifest = read_manifest(path)
            for run in manifest.get("runs", []):
                for out in run.get("outputs", []):
                    target = _model_target((path / out["path"]).resolve())
                    target.run, target.step = run.get("run", target.run), out.get("step", target.step)
                    targets.append(target)
        elif not (path / "config.json").is_file() and path.is_dir():
            if not is_run_dir(path):
                raise InputError(
                    f"{path}: no config.json, manifest.json or checkpoint folders (checkpoint-N, step_N, ...)"
                )
            targets += [_model_target(c.path) for c in find_checkpoints(path)]
        else:
            targets.append(_model_target(path))
    seen, unique = set(), []
    for t in targets:
        if (t.path, t.run) not in seen:
            seen.add((t.path, t.run))
            unique.append(t)
    return unique


def vanilla_of(inputs: list[str]) -> list[str]:
    """The run's own checkpoint at every output step of each stabilize OUT among `inputs` (its
    manifest names them): `bema eval --with-vanilla`, so the report's "vs vanilla" has its pair."""
    found = []
    for text in inputs:
        path = Path(text).resolve()
        if not (path / "manifest.json").is_file():
            continue
        manifest = read_manifest(path)
        steps = {o.get("step") for run in manifest.get("runs", []) for o in run.get("outputs", [])}
        for c in manifest.get("checkpoints", []):
            if c.get("step") in steps and isinstance(c.get("path"), str):
                folder = find_input(c["path"], [path], None)  # named as bema.json names it
                if folder is None:
                    raise InputError(
                        f"{path}: its checkpoint of step {c['step']} is gone ({c['path']}); --with-vanilla needs it"
                    )
                found.append(str(folder))
    return found


def base_target(base: str, targets: list[Target]) -> Target:
    """The base model (a folder or Hub repo id), standing in as step 0 of every run among the targets."""
    path = resolve_model(base, check=safetensors_files).path
    runs = {}
    for t in targets:
        runs.setdefault(t.run, t.stabilizer)
    return Target(
        path, "base", 0, dict(VANILLA), is_base=True, runs=list(runs.items()) or [("vanilla", VANILLA)]
    )


def check_out(out: Path, targets: list[Target]) -> None:
    """results.jsonl never lands in a model folder it evaluates, nor in the training run itself."""
    from bema_cli.errors import OutputError
    from bema_cli.io.checkpoints import layout_of, run_of
    from bema_cli.io.commit import check_apart

    check_apart(out, [t.path for t in targets], may_contain=True)
    for run in {run_of(t.path) for t in targets if not t.is_base}:
        if is_run_dir(run) and out.resolve() == run.resolve():
            raise OutputError(f"--out {out.resolve()}: is the training run {run.resolve()}; choose another")
        inside = (
            out.resolve().relative_to(run.resolve()).parts
            if out.resolve().is_relative_to(run.resolve())
            else ()
        )
        if is_run_dir(run) and inside and layout_of(inside[0]) is not None:  # RUN/checkpoint-90: read as a
            raise OutputError(  # checkpoint without weights by the next ship or stabilize of RUN
                f"--out {out.resolve()}: lies inside the training run {run.resolve()}, where {inside[0]} reads "
                "as a checkpoint of it; choose a folder beside the run"
            )
