"""PEFT LoRA adapter checkpoints, read as the full weights they stand for (see docs/math.md, LoRA).

A LoRA checkpoint at step s holds, per adapted module, factors A_s (r x in) and B_s (out x r);
the model it stands for is theta_s = W_base + scale * B_s @ A_s, scale = lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)). B @ A is bilinear, so averaging A and B separately is not
an average of the weights: we stabilize theta_s itself. `LoraIndex` presents each checkpoint
as ordinary tensors whose rows [a, b) are W_base[a:b] + scale * B[a:b] @ A, one row block at
a time, so the engine and its memory budget see a full model and never a whole delta.

Two views of the same trajectory (`mode`):
- "merged": every base tensor; adapted ones as above, `modules_to_save` tensors from the adapter.
- "delta": only what the adapter holds, adapted modules as scale * B @ A (theta0 = 0). Every
  stabilizer is affine (weights summing to 1, plus alpha * (theta_s - theta0)), so stabilizing
  deltas and adding W_base gives the merged result; the adapter output factorizes these deltas.
With `adapter=None` the index is the model at initialization (B = 0): theta0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import is_regular
from bema_cli.io.safetensors import DTYPES, ModelIndex, TensorInfo, index_model

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."
# key suffix -> (factor, delta is (B @ A).T): nn.Linear LoRA and nn.Embedding LoRA
FACTORS = {
    ".lora_A.weight": ("A", False),
    ".lora_B.weight": ("B", False),
    ".lora_embedding_A": ("A", True),
    ".lora_embedding_B": ("B", True),
}
# model_types whose layers are transformers' Conv1D (weight in x out), where PEFT sets fan_in_fan_out
CONV1D_MODEL_TYPES = ("gpt2", "openai-gpt", "decision_transformer", "imagegpt", "clvp")
ZERO_INITS = (True, "gaussian", "eva", "mica")  # B @ A = 0 and W_base untouched at initialization
# adapter_config keys whose (truthy) use makes theta_s something other than W_base + scale * B @ A
UNSUPPORTED = {
    "use_dora": "DoRA (a magnitude vector rescales W_base + B A)",
    "lora_bias": "lora_bias",
    "alpha_pattern": "alpha_pattern",
    "use_qalora": "QALoRA",
    "use_bdlora": "BD-LoRA",
    "alora_invocation_tokens": "aLoRA",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "arrow_config": "Arrow routing",
    "megatron_config": "Megatron-parallel LoRA layers",
}


@dataclass(frozen=True)
class Module:
    """One adapted weight: base tensor `name`, factor keys in the adapter file, its scale."""

    name: str
    a_key: str
    b_key: str
    rank: int
    scale: float
    transpose: bool  # delta = scale * (B @ A).T (embeddings, fan_in_fan_out Conv1D)


@dataclass
class Adapter:
    """What one adapter checkpoint adapts, validated against the base model."""

    folder: Path
    config: dict
    index: ModelIndex  # the adapter file's own tensors
    modules: dict[str, Module]  # base tensor name -> module
    full: dict[str, str]  # base tensor name -> adapter key (modules_to_save, trained biases)


def read_config(folder: Path) -> dict:
    """adapter_config.json, refusing what cannot be stabilized exactly in weight space."""
    path = folder / CONFIG_NAME
    try:
        if not is_regular(path):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read ({exc})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{path}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise InputError(f"{path}: no valid LoRA rank r (got {r!r})")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise InputError(f"{path}: lora_alpha must be a number (got {alpha!r})")
    if not (math.isfinite(alpha) and alpha > 0):  # JSON as Python reads it allows NaN and Infinity
        raise InputError(f"{path}: lora_alpha must be a positive finite number (got {alpha!r})")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise InputError(
                f"{path}: {what} is not supported (bema stabilizes W_base + scale * B @ A exactly)"
            )
    init = config.get("init_lora_weights", True)
    if init not in ZERO_INITS:
        raise InputError(
            f"{path}: init_lora_weights={init!r} changes the base or starts B A away from zero "
            "(PiSSA/OLoRA/LoftQ/CorDA style), so theta0 is not the base model: not supported"
        )
    return config


def scale_of(config: dict, rank: int) -> float:
    alpha = float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def adapter_files(folder: Path) -> list[Path]:
    for name in WEIGHT_NAMES:
        if is_regular(folder / name):
            return [folder / name]
    raise InputError(f"{folder}: {CONFIG_NAME} but no {' or '.join(WEIGHT_NAMES)}")


def _index_adapter(folder: Path) -> ModelIndex:
    file = adapter_files(folder)[0]
    if file.suffix == ".bin":
        from bema_cli.io.torchbin import index_bin

        return index_bin(folder, [file])
    return index_model(folder, [file])


def read_adapter(folder: Path, base: ModelIndex) -> Adapter:
    """Parse one adapter checkpoint: module factors, full tensors, shapes checked against the base."""
    config = read_config(folder)
    index = _index_adapter(folder)
    factors: dict[str, dict] = {}
    full: dict[str, str] = {}
    for key, info in index.tensors.items():
        if not key.startswith(PREFIX):
            raise InputError(
                f"{info.file}: tensor {key!r} does not start with {PREFIX!r} (not a PEFT adapter)"
            )
        rest = key[len(PREFIX) :]
        suffix = next((s for s in FACTORS if rest.endswith(s)), None)
        if suffix:
            factor, transpose = FACTORS[suffix]
            entry = factors.setdefault(rest[: -len(suffix)] + ".weight", {"transpose": transpose})
            entry[factor] = info
        elif ".base_layer." in rest:
            continue  # a frozen copy of the base layer (PEFT saves it for adapted embeddings)
        elif ".lora_" in rest:
            raise InputError(f"{info.file}: tensor {key!r} is a LoRA variant bema cannot merge exactly")
        else:
            b = base.tensors.get(rest)
            if b is None:
                raise InputError(f"{info.file}: tensor {key!r} has no counterpart {rest!r} in the base model")
            if info.shape != b.shape:
                raise InputError(
                    f"{info.file}: tensor {key!r} has shape {list(info.shape)}, the base has {list(b.shape)}"
                )
            full[rest] = key
    linear = _linear_layers(base, factors)
    if linear is None:
        linear = _linear_model(base.folder)
    modules = {}
    for name, f in sorted(factors.items()):
        modules[name] = _module(folder, config, base, name, f, linear)
    if not modules:
        raise InputError(f"{adapter_files(folder)[0]}: no LoRA factors (lora_A/lora_B) in the adapter")
    return Adapter(folder, config, index, modules, full)


def _layout(w: TensorInfo | None, a: TensorInfo | None, b: TensorInfo | None) -> bool | None:
    """True for an nn.Linear weight (out x in), False for GPT-2's Conv1D (in x out), None when the
    shapes cannot tell (square, or not fitting: _module reports those)."""
    if w is None or a is None or b is None or len(w.shape) != 2 or len(a.shape) != 2 or len(b.shape) != 2:
        return None
    out_in, in_out = (b.shape[0], a.shape[1]), (a.shape[1], b.shape[0])
    return None if out_in == in_out or w.shape not in (out_in, in_out) else w.shape == out_in


def _linear_layers(base: ModelIndex, factors: dict[str, dict]) -> bool | None:
    """Whether the adapted layers are nn.Linear rather than Conv1D, as every non-square one shows;
    None when none tells or they disagree.

    PEFT decides fan_in_fan_out by the layer's type, not by adapter_config.json: True on an
    nn.Linear is warned about and forced off, False on a Conv1D forced on. bema sees only
    tensors, so a non-square weight's shape stands for its type, and a square one follows its
    non-square siblings (one architecture's attention/MLP layers share a type); only when none
    tells does the base model_type (_linear_model), then the config's fan_in_fan_out, decide.
    """
    kinds = {
        _layout(base.tensors.get(name), f.get("A"), f.get("B"))
        for name, f in factors.items()
        if not f["transpose"]
    } - {None}
    return kinds.pop() if len(kinds) == 1 else None


def _linear_model(folder: Path) -> bool | None:
    """From the base's config.json: False for the architectures built of Conv1D layers (the ones
    transformers has), True for any other model_type, None without one."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return None if not isinstance(model_type, str) else model_type not in CONV1D_MODEL_TYPES


def _module(folder: Path, config: dict, base: ModelIndex, name: str, f: dict, linear: bool | None) -> Module:
    a, b = f.get("A"), f.get("B")
    if a is None or b is None:
        some = (a or b).name
        raise InputError(f"{(a or b).file}: tensor {some!r} has no matching lora_{'B' if a else 'A'}")
    w = base.tensors.get(name)
    if w is None:
        raise InputError(f"{a.file}: tensor {a.name!r} adapts {name!r}, which is not in the base model")
    if len(a.shape) != 2 or len(b.shape) != 2 or len(w.shape) != 2:
        raise InputError(f"{a.file}: tensor {a.name!r}: only 2-D (linear/embedding) LoRA is supported")
    own = _layout(w, a, b)
    if own is not None:
        linear = own
    transpose = f["transpose"] or (bool(config.get("fan_in_fan_out")) if linear is None else not linear)
    out_dim, in_dim = (w.shape[1], w.shape[0]) if transpose else w.shape
    rank = a.shape[0]
    if b.shape != (out_dim, rank) or a.shape != (rank, in_dim):
        raise InputError(
            f"{a.file}: tensors {a.name!r} {list(a.shape)} and {b.name!r} {list(b.shape)} do not fit "
            f"base tensor {name!r} of shape {list(w.shape)}"
        )
    if rank != config["r"] and not config.get("rank_pattern"):
        raise InputError(f"{a.file}: tensor {a.name!r} has rank {rank}, {CONFIG_NAME} says r={config['r']}")
    return Module(name, a.name, b.name, rank, scale_of(config, rank), transpose)


def same_targets(first: Adapter, other: Adapter) -> None:
    """Adapters of one run must adapt the same modules and save the same full tensors."""
    for what, mine, theirs in (
        ("adapted module", set(first.modules), set(other.modules)),
        ("saved module", set(first.full), set(other.full)),
    ):
        diff = sorted(mine ^ theirs)
        if diff:
            where = other.folder if diff[0] in mine else first.folder
            raise InputError(
                f"{other.folder}: target modules differ from {first.folder.name}: "
                f"{what} {diff[0]!r} is {'missing' if diff[0] in mine else 'only'} in {where.name}"
            )


def compute_tag(base_tag: str) -> str:
    """Deltas are formed in float32 (float64 for a float64 base), never in a 16-bit base dtype."""
    return "F64" if base_tag == "F64" else "F32"


class LoraIndex(ModelIndex):
    """One adapter checkpoint (or, with adapter None, the initialization B = 0) as full tensors."""

    base: ModelIndex
    adapter: Adapter | None
    layout: Adapter  # the run's first adapter: which tensors exist in "delta" mode
    mode: str

    def open(self) -> LoraReader:
        return LoraReader(self)

    @property
    def nbytes(self) -> int:
        """Bytes this checkpoint adds to a run's reads: its adapter file (theta0: the base tensors read)."""
        if self.adapter is not None:
            return self.adapter.index.nbytes
        return sum(
            self.base.tensors[n].nbytes
            for n in self.tensors
            if self.mode == "merged" or n in self.layout.full
        )

    def read_itemsize(self, info: TensorInfo) -> int:
        module = self.layout.modules.get(info.name)
        if module is None:
            return info.itemsize
        size = DTYPES[compute_tag(self.base.tensors[info.name].dtype)][1]
        return self.base.tensors[info.name].itemsize + 2 * size  # W rows as read, cast, result


def lora_index(adapter: Adapter | None, layout: Adapter, base: ModelIndex, mode: str) -> LoraIndex:
    """The tensors `mode` presents (see the module docstring); names and shapes are the base's."""
    tensors = {}
    if mode == "merged":
        names = sorted(base.tensors)
    else:
        names = sorted(set(layout.modules) | set(layout.full))
    for name in names:
        b = base.tensors[name]
        if name in layout.modules:
            dtype = b.dtype if mode == "merged" else compute_tag(b.dtype)
            file = adapter.index.tensors[adapter.modules[name].a_key].file if adapter else b.file
        elif name in layout.full and adapter is not None:
            info = adapter.index.tensors[adapter.full[name]]
            dtype, file = (b.dtype if mode == "merged" else info.dtype), info.file
        else:
            info = layout.index.tensors[layout.full[name]] if name in layout.full else b
            dtype, file = (b.dtype if mode == "merged" else info.dtype), b.file
        tensors[name] = TensorInfo(name, file, dtype, b.shape)
    index = LoraIndex(adapter.folder if adapter else base.folder, tensors)
    index.base, index.adapter, index.layout, index.mode = base, adapter, layout, mode
    return index


class LoraReader:
    """Rows of a LoRA checkpoint's full weights: W_base[a:b] + scale * B[a:b] @ A (or its delta alone)."""

    def __init__(self, index: LoraIndex):
        self.index = index
        self._base = index.base.open()
        self._adapter = index.adapter.index.open() if index.adapter else None

    def __enter__(self) -> LoraReader:
        return self

    def __exit__(self, *exc) -> None:
        self._base.__exit__(*exc)
        if self._adapter:
            self._adapter.__exit__(*exc)

    def read(self, name: str, start: int, stop: int):
        import torch

        ix = self.index
        module = ix.layout.modules.get(name)
        if module is not None:
            dtype = getattr(torch, DTYPES[compute_tag(ix.base.tensors[name].dtype)][0])
            w = self._base.read(name, start, stop).to(dtype) if ix.mode == "merged" else None
            if ix.adapter is None:  # B = 0 at initialization
                return (
                    w
                    if w is not None
                    else torch.zeros((stop - start, *ix.tensors[name].shape[1:]), dtype=dtype)
                )
            m = ix.adapter.modules[name]
            a = self._adapter.read(m.a_key, 0, m.rank).to(dtype)  # r x in (small)
            b = self._adapter.read(m.b_key, 0, ix.adapter.index.tensors[m.b_key].shape[0]).to(dtype)
            if m.transpose:  # rows [start, stop) of (B @ A).T = A[:, start:stop].T @ B.T
                left, right = a[:, start:stop].T, b.T
            else:
                left, right = b[start:stop], a
            if w is None:
                return torch.mm(left, right).mul_(m.scale)
            return torch.addmm(w, left, right, alpha=m.scale)
        if ix.adapter is not None and name in ix.adapter.full:
            return self._adapter.read(ix.adapter.full[name], start, stop)
        return self._base.read(name, start, stop)
