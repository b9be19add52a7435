"""Find a training run's checkpoints and its base model (theta0); no tensor math here.

A trajectory is the checkpoint folders a trainer writes, ordered by global step s:
`checkpoint-<s>` (HF Trainer), `step_<s>`/`step-<s>`, `global_step<s>` (DeepSpeed),
`iter_<s>` (Megatron; its `hf/` export when there is one), zero-padded or not; or `STEP PATH` lines from stdin. Only model weights and the files needed to load a model (config, generation
config, tokenizer, chat template) matter; optimizer/scheduler/rng state is ignored.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from bema_cli.errors import InputError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# What `--base REPO_ID` downloads: weights, configs, tokenizer, chat template; nothing else.
HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# Folder naming schemes (prefix of `<prefix><step>`), one per trainer family; a run uses exactly one.
# A folder with the prefix but no number (checkpoint-final) takes its step from trainer_state.json.
LAYOUTS = ("checkpoint-", "step_", "step-", "global_step", "iter_")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path  # absolute folder


@dataclass(frozen=True)
class BaseModel:
    path: Path  # local folder holding the weights
    source: str  # what the user asked for: an absolute path or a Hub repo id


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def is_regular(path: str | Path) -> bool:
    """Whether `path` is a regular file (symbolic links followed); False when nothing is there.

    Anything else under a name bema reads (a FIFO, socket, device or directory named
    model.safetensors, config.json, ...) is an InputError naming it, checked with stat before any
    open: opening a FIFO blocks until a writer comes, i.e. forever, and a device never ends.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISREG(mode):
        return True
    kind = next((what for test, what in _KINDS if test(mode)), "a device or other special file")
    raise InputError(f"{path}: is {kind}, not a regular file; refusing to read it")


def read_json(path: Path) -> dict:
    """A JSON file as a dict; InputError naming the file when it is missing or malformed."""
    try:
        if not is_regular(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read ({exc})") from None
    except RecursionError:  # JSON nested thousands deep: no file bema reads is like that
        raise InputError(f"{path}: cannot read (JSON nested too deeply)") from None


def read_weight_map(index: Path, kind: str = "safetensors") -> dict[str, str]:
    """The weight_map of an HF `*.index.json`: tensor name -> shard file in the index's folder.

    A shard path that is absolute or climbs out with '..' is refused: an index must not make us read
    (and copy into every output) a file outside the checkpoint folder.
    """
    doc = read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(f"{index}: not a valid {kind} index (no 'weight_map' of tensor name -> file name)")
    for name, shard in weight_map.items():
        if not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise InputError(f"{index}: tensor {name!r} is mapped to {shard!r}, a path outside the folder")
    return weight_map


def indexed_files(index: Path, kind: str) -> list[Path]:
    """The shard files an HF `*.index.json` weight_map lists, each checked to exist."""
    names = sorted(set(read_weight_map(index, kind).values()))
    files = [index.parent / n for n in names]
    for f in files:
        if not is_regular(f):
            raise InputError(f"{index}: lists {f.name}, which is missing")
    return files


def check_weight_map(index: Path, found: dict[str, Path]) -> None:
    """Every tensor an `*.index.json` names must be in the shard it names (`found`: tensor -> file read)."""
    if not is_regular(index):
        return
    for name, shard in read_weight_map(index).items():
        if name not in found:
            raise InputError(f"{index}: lists tensor {name!r} in {shard}, which does not hold it")
        if found[name] != index.parent / shard:
            raise InputError(f"{index}: lists tensor {name!r} in {shard}, but it is in {found[name].name}")


def model_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files holding a model folder's weights (sharded index first, then single file).

    Raises InputError naming the folder when there are none (e.g. only pytorch_model.bin).
    """
    folder = Path(folder)
    index = folder / INDEX_NAME
    if is_regular(index):
        return indexed_files(index, "safetensors")
    if is_regular(folder / SINGLE_NAME):
        return [folder / SINGLE_NAME]
    others = sorted(
        p
        for p in folder.glob("*.safetensors")
        if not p.name.startswith(("optimizer", "adapter", "scheduler")) and is_regular(p)
    )
    if others:
        return others
    hint = " (only safetensors model folders can be used here)" if any(folder.glob("*.bin")) else ""
    raise InputError(f"{folder}: no model.safetensors or {INDEX_NAME}{hint}")


def layout_of(name: str) -> str | None:
    """The naming scheme (prefix) of a checkpoint folder name such as `checkpoint-400` or `iter_0000400`."""
    return next((p for p in LAYOUTS if name.startswith(p)), None)


def ascii_step(text) -> int | None:
    """A step written with ASCII digits 0-9 only (an int, or a string such as '0400'), else None.

    Python's int() and str.isdigit() also take Arabic-Indic, fullwidth or superscript digits
    ('checkpoint-١٢', 'checkpoint-²'); no trainer writes those, so such a name is not a step:
    the folder is treated like `checkpoint-final` (its step comes from trainer_state.json or it
    is refused by name), the same in discovery, stdin lists, `bema eval` targets and follow mode.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text if text >= 0 else None
    if isinstance(text, str) and text.isascii() and text.isdigit():
        return int(text)
    return None


def step_of(folder: Path) -> int | None:
    """Step from the folder name (any layout, zero-padded or not), else trainer_state.json `global_step`."""
    scheme = layout_of(folder.name)
    step = ascii_step(folder.name[len(scheme) :]) if scheme else None
    if step is not None:
        return step
    state = folder / "trainer_state.json"
    if not is_regular(state):
        return None
    doc = read_json(state)
    step = ascii_step(doc.get("global_step")) if isinstance(doc, dict) else None
    if step is None:
        got = repr(doc.get("global_step")) if isinstance(doc, dict) else "not an object"
        raise InputError(f"{state}: no usable global_step (a whole number >= 0 expected, got {got})")
    return step


def _step_of(folder: Path) -> int:
    step = step_of(folder)
    if step is None:
        raise InputError(
            f"{folder}: cannot tell its step (name is not <prefix><step> with digits 0-9, no trainer_state.json)"
        )
    return step


def is_run_dir(path: Path) -> bool:
    """Whether a folder holds checkpoint folders of any layout (a training output dir)."""
    return path.is_dir() and any(p.is_dir() and layout_of(p.name) for p in path.iterdir())


def _ordered(found: list[tuple[int, Path, str]], where: str) -> list[Checkpoint]:
    by_step: dict[int, tuple[Path, str]] = {}
    for step, path, label in found:
        if step in by_step:
            raise InputError(f"{where}: duplicate step {step} ({by_step[step][1]} and {label})")
        by_step[step] = (path, label)
    return [Checkpoint(s, by_step[s][0]) for s in sorted(by_step)]


def run_of(checkpoint: str | Path) -> Path:
    """The run folder a checkpoint folder belongs to: its parent, or for Megatron-Bridge's
    iter_<N>/hf/ export the iter folder's parent (records name the hf/ folder as the source)."""
    checkpoint = Path(checkpoint)
    if checkpoint.name == "hf" and layout_of(checkpoint.parent.name) == "iter_":
        return checkpoint.parent.parent
    return checkpoint.parent


def find_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """The checkpoint folders of a training run (one naming scheme), sorted by step; errors name the folder."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.exists():
        raise InputError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: not a directory")
    found: dict[str, list[tuple[int, Path, str]]] = {}
    for p in sorted(run_dir.iterdir()):
        scheme = layout_of(p.name)
        if scheme and p.is_symlink() and not p.is_dir():
            _broken_link(p)
        if scheme and p.is_dir():
            # Megatron-Bridge's HF export beside its native checkpoint: iter_<N>/hf/ is step N's model
            model = p / "hf" if scheme == "iter_" and (p / "hf" / "config.json").is_file() else p
            found.setdefault(scheme, []).append((_step_of(p), model.resolve(), p.name))
    if not found:
        others = ", ".join(f"{p}<step>" for p in LAYOUTS[1:])
        what = (
            "is empty" if not any(run_dir.iterdir()) else f"has no checkpoint-<step> folders (nor {others})"
        )
        if layout_of(run_dir.name) and (run_dir / "config.json").is_file():
            what = f"looks like a checkpoint, not a run: pass its parent folder ({run_dir.parent})"
        raise InputError(f"{run_dir}: {what}")
    if len(found) > 1:
        examples = " and ".join(v[0][2] for v in found.values())
        raise InputError(
            f"{run_dir}: mixes checkpoint naming schemes: {examples}; keep one or pipe a list to `-`"
        )
    return _ordered(next(iter(found.values())), str(run_dir))


def _broken_link(p: Path) -> None:
    """A symlinked checkpoint that leads nowhere is an error, not a silently shorter run."""
    try:
        p.resolve(strict=True)
        why = "is a symbolic link to something that is not a folder"
    except (RuntimeError, OSError) as exc:  # Python < 3.13 reports a loop as RuntimeError
        loop = isinstance(exc, RuntimeError) or exc.errno == errno.ELOOP
        why = "is a symbolic link loop" if loop else f"is a dangling symbolic link (to {os.readlink(p)})"
    raise InputError(f"{p}: {why}")


def read_checkpoint_list(text: str, origin: str = "<stdin>") -> list[Checkpoint]:
    """`STEP PATH` lines (whitespace-separated, any order; blank lines and # comments skipped), sorted by step."""
    found = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2 or ascii_step(parts[0]) is None:
            raise InputError(f"{origin} line {n}: expected 'STEP PATH', got {line!r}")
        path = Path(parts[1].strip()).expanduser()
        if not path.is_dir():
            raise InputError(f"{origin} line {n}: {path}: no such directory")
        found.append((ascii_step(parts[0]), path.resolve(), f"line {n}"))
    if not found:
        raise InputError(f"{origin}: no 'STEP PATH' lines")
    return _ordered(found, origin)


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


def resolve_model(spec: str, check=model_weight_files) -> BaseModel:
    """A model given as a local folder or a Hub repo id (downloaded/cached by huggingface_hub).

    `check(folder)` fails early when the folder holds no weights (default: safetensors ones).
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        check(path)
        return BaseModel(path.resolve(), str(path.resolve()))
    if _looks_local(spec):
        raise InputError(f"--base {spec}: no such directory")
    snapshot = _from_hub(spec)
    check(snapshot)
    return BaseModel(snapshot, spec)


def is_adapter(folder: Path) -> bool:
    """A PEFT adapter checkpoint (adapter_config.json), whose base is not itself."""
    return is_regular(folder / "adapter_config.json")


def _name_or_path(checkpoint: Checkpoint) -> str | None:
    """The model a checkpoint was fine-tuned from, as its config says (an adapter's own key first)."""
    for name, key in (("adapter_config.json", "base_model_name_or_path"), ("config.json", "_name_or_path")):
        if not is_regular(checkpoint.path / name):  # a FIFO is refused by name, never opened
            continue
        try:
            value = read_json(checkpoint.path / name).get(key)
        except (InputError, AttributeError):
            continue
        if value:
            return value
    return None


def resolve_base(base: str | None, checkpoints: list[Checkpoint], check=model_weight_files) -> BaseModel:
    """theta0: `--base DIR|REPO_ID|first`, else checkpoint-0, else the config's base model if it resolves
    (adapter_config.json `base_model_name_or_path`, config.json `_name_or_path`)."""
    if base == "first":
        return BaseModel(checkpoints[0].path, str(checkpoints[0].path))
    if base:
        return resolve_model(base, check)
    if checkpoints[0].step == 0 and not is_adapter(checkpoints[0].path):
        return BaseModel(checkpoints[0].path, str(checkpoints[0].path))
    name = _name_or_path(checkpoints[0])
    if name:
        try:
            return resolve_model(name, check)
        except InputError:
            pass
    found = f" (its config names {name!r}, which does not resolve)" if name else ""
    raise InputError(
        f"{checkpoints[0].path.parent}: cannot tell the base model theta0{found}; pass --base DIR or "
        "--base HUB_REPO_ID (the model fine-tuning started from), or --base first to use the first checkpoint"
    )
