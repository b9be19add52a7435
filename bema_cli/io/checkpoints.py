"""Find a training run's checkpoints and its base model (theta0); no tensor math here.

A trajectory is the `checkpoint-<s>` folders an HF Trainer writes, ordered by global
step s. Only model weights and the files needed to load a model (config, generation
config, tokenizer, chat template) matter; optimizer/scheduler/rng state is ignored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from bema_cli.errors import InputError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files copied next to every output so it loads like the checkpoint it came from.
AUX_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",
    "*.tiktoken",
    "spiece.model",
    "preprocessor_config.json",
)
# What `--base REPO_ID` downloads: weights, configs, tokenizer, chat template; nothing else.
HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_STEP_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path  # absolute folder


@dataclass(frozen=True)
class BaseModel:
    path: Path  # local folder holding the weights
    source: str  # what the user asked for: an absolute path or a Hub repo id


def read_json(path: Path) -> dict:
    """A JSON file as a dict; InputError naming the file when it is missing or malformed."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read ({exc})") from None


def model_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files holding a model folder's weights (sharded index first, then single file).

    Raises InputError naming the folder when there are none (e.g. only pytorch_model.bin).
    """
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise InputError(f"{index}: lists {f.name}, which is missing")
        return files
    if (folder / SINGLE_NAME).is_file():
        return [folder / SINGLE_NAME]
    others = sorted(
        p
        for p in folder.glob("*.safetensors")
        if not p.name.startswith(("optimizer", "adapter", "scheduler"))
    )
    if others:
        return others
    hint = " (only safetensors checkpoints are supported)" if any(folder.glob("*.bin")) else ""
    raise InputError(f"{folder}: no model.safetensors or {INDEX_NAME}{hint}")


def step_of(folder: Path) -> int | None:
    """Step from the folder name `checkpoint-<s>`, else trainer_state.json `global_step`; None if neither."""
    m = _STEP_RE.match(folder.name)
    if m:
        return int(m.group(1))
    state = folder / "trainer_state.json"
    if not state.is_file():
        return None
    try:
        return int(json.loads(state.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{state}: no usable global_step ({exc})") from None


def _step_of(folder: Path) -> int:
    step = step_of(folder)
    if step is None:
        raise InputError(
            f"{folder}: cannot tell its step (name is not checkpoint-<step>, no trainer_state.json)"
        )
    return step


def find_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """The `checkpoint-*` folders of a training run, sorted by step; errors name the folder at fault."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.exists():
        raise InputError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: not a directory")
    folders = sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint-"))
    if not folders:
        what = "is empty" if not any(run_dir.iterdir()) else "has no checkpoint-<step> folders"
        raise InputError(f"{run_dir}: {what}")
    by_step: dict[int, Path] = {}
    for folder in folders:
        step = _step_of(folder)
        if step in by_step:
            raise InputError(f"{run_dir}: duplicate step {step} ({by_step[step].name} and {folder.name})")
        by_step[step] = folder.resolve()
    return [Checkpoint(s, by_step[s]) for s in sorted(by_step)]


def _looks_local(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or spec.count("/") != 1 or os.sep == "\\" and "\\" in spec


def _from_hub(repo_id: str) -> Path:
    """Download (or find in the HF cache) a repo's weights + configs + tokenizer; InputError on failure."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, network, auth: all the same to the user
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = " (HF_HUB_OFFLINE is set and it is not in the cache)" if offline else ""
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"--base {repo_id}: not a local directory and not downloadable from the Hub{why}: {first_line}"
        ) from None


def resolve_model(spec: str) -> BaseModel:
    """A model given as a local folder or a Hub repo id (downloaded/cached by huggingface_hub)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        model_weight_files(path)  # fail early when it holds no weights
        return BaseModel(path.resolve(), str(path.resolve()))
    if _looks_local(spec):
        raise InputError(f"--base {spec}: no such directory")
    snapshot = _from_hub(spec)
    model_weight_files(snapshot)
    return BaseModel(snapshot, spec)


def _name_or_path(checkpoint: Checkpoint) -> str | None:
    try:
        value = json.loads((checkpoint.path / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return value or None


def resolve_base(base: str | None, checkpoints: list[Checkpoint]) -> BaseModel:
    """theta0: `--base DIR|REPO_ID|first`, else checkpoint-0, else config.json `_name_or_path` if it resolves."""
    if base == "first":
        return BaseModel(checkpoints[0].path, str(checkpoints[0].path))
    if base:
        return resolve_model(base)
    if checkpoints[0].step == 0:
        return BaseModel(checkpoints[0].path, str(checkpoints[0].path))
    name = _name_or_path(checkpoints[0])
    if name:
        try:
            return resolve_model(name)
        except InputError:
            pass
    found = f" (config.json names {name!r}, which does not resolve)" if name else ""
    raise InputError(
        f"{checkpoints[0].path.parent}: cannot tell the base model theta0{found}; pass --base DIR or "
        "--base HUB_REPO_ID (the model fine-tuning started from), or --base first to use the first checkpoint"
    )


def copy_aux_files(dst: Path, sources: list[Path]) -> list[str]:
    """Copy config/tokenizer/chat-template files into dst, each from the first source that has it."""
    copied: list[str] = []
    for src in sources:
        for pattern in AUX_PATTERNS:
            for f in sorted(src.glob(pattern)):
                if f.is_file() and f.name not in copied and not f.name.endswith(".safetensors"):
                    shutil.copy2(f, dst / f.name)
                    copied.append(f.name)
    return copied
