"""Provenance that travels inside the weights: every safetensors file bema writes carries, in its
header's `__metadata__["bema"]`, the record of how it was made (as Megatron-LM's merge tool stores
its inputs and weights inside the checkpoint). A copy or an upload of the weight files alone keeps
it; `bema verify DIR` rebuilds the model from it and says bitwise which tensors differ.

The record: bema.json's content (the version, the method and its settings, the steps averaged,
theta0's source, each named as the model card names it and never by an absolute local path: a push
publishes the header with the weights), the coefficient vector over (theta0, each input step) where the run computed it
from theta0 (stabilize/vectors.coefficient_vectors; a fitted average's are its definition), and a
fingerprint per input (io/fingerprint.py's cheap one: header and sampled bytes of each weight file).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from bema_cli.errors import InputError
from bema_cli.schedule import NUMBER_KEYS

KEY = "bema"


def input_name(folder: str | Path, out: str | Path | None = None) -> str:
    """How a record names an input: a Hub id as it is; a local folder by its path inside the folder
    it shares with the output `out` (runs/sft/checkpoint-40 for a run at ~/proj/runs/sft and an
    output under ~/proj), else by its last two parts (sft/checkpoint-40). Never the absolute path:
    the user's home and project would go to the Hub inside the weights. `find_input` finds the
    folder again from that name (under the output's ancestors) and the recorded fingerprint."""
    path = Path(folder)
    if not path.is_absolute():
        return str(folder)  # a Hub id (or a name already)
    if out is not None:
        common = Path(os.path.commonpath([path, Path(out).expanduser().resolve()]))
        if common != Path(common.anchor) and path != common:
            return path.relative_to(common).as_posix()
    return "/".join(path.parts[-2:])


def record_name(path: str | Path, out: str | Path | None) -> str:
    """How a result names a local input (a model folder, a data file): `input_name` against the
    output `out` (the working folder without one), resolved first so that a relative and an absolute
    spelling name the same file. A Hub id or a `sweep:` name, no local path, is kept as it is."""
    local = Path(path).expanduser()
    if not local.exists():
        return str(path)
    return input_name(local.resolve(), out if out is not None else Path.cwd())


def same_tail(a, b) -> bool:
    """Two names of one local input made against different outputs (or an older bema's absolute path
    and today's name): equal, or one the other's tail. A record read from a moved OUT names its
    inputs so (input_name is relative to the folder the input shares with OUT)."""
    return (
        isinstance(a, str) and isinstance(b, str) and (a == b or a.endswith("/" + b) or b.endswith("/" + a))
    )


def find_input(name: str, near: list[Path], fingerprint: str | None) -> Path | None:
    """The local folder a record names, found again: the path itself where the record holds one (an
    older bema's), else `name` under a folder of `near` or one of its ancestors (a ship's DIR sits
    beside its run, a stabilize output under the project that holds the run): the first whose
    fingerprint is the recorded one, failing that the first of that name (then reported as changed).
    Copied elsewhere: one level below those ancestors, the fingerprint's match only. None: not found."""
    path = Path(name)
    if path.is_absolute():
        return path if path.is_dir() else None
    roots = list(dict.fromkeys(r for p in near for r in (Path(p).resolve(), *Path(p).resolve().parents)))
    found = [root / path for root in roots if (root / path).is_dir()]
    match = _printed(found, fingerprint)
    if match is not None or found:
        return match or found[0]
    # copied elsewhere: one level down from the ancestors too, where only the fingerprint may choose
    below = [c / path for root in roots for c in _children(root) if (c / path).is_dir()]
    return _printed(below, fingerprint) if fingerprint else None


def _printed(folders: list[Path], fingerprint: str | None) -> Path | None:
    """The first of `folders` whose fingerprint is `fingerprint` (any, when it is None)."""
    for folder in folders:
        try:
            if fingerprint is None or input_print(folder) == fingerprint:
                return folder
        except (OSError, InputError):
            continue
    return None


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(c for c in folder.iterdir() if not c.name.startswith(".") and c.is_dir())
    except OSError:
        return []


CHEAP = ("name", "size", "header_sha256", "sample_sha256")  # fingerprint's keys that need no full read


def print_of(files: list[dict]) -> str:
    """A short fingerprint from io/fingerprint.fingerprint's list (full or cheap: the cheap keys only,
    so a state's recorded fingerprint of a checkpoint gone since gives the same as one read now)."""
    cheap = [{k: f.get(k) for k in CHEAP} for f in sorted(files, key=lambda f: f["name"])]
    return hashlib.sha256(json.dumps(cheap, sort_keys=True).encode()).hexdigest()[:32]


def input_print(folder: Path) -> str:
    """A short fingerprint of one input model folder (its weight files' sizes, headers, samples)."""
    from bema_cli.io.fingerprint import fingerprint, weight_files

    return print_of(fingerprint(weight_files(Path(folder))))


def metadata(record: dict, inputs: dict[str, str], coefficients: dict[str, float] | None) -> dict[str, str]:
    """The header entry: {"bema": compact JSON of record, inputs and coefficients}."""
    from bema_cli import output

    doc = {"record": json.loads(output.to_json(record)), "inputs": inputs, "coefficients": coefficients}
    return {KEY: json.dumps(doc, separators=(",", ":"))}  # insertion order: theta0 first, steps in order


def adapter_header(deltas: Path, lora: dict) -> dict[str, str]:
    """The provenance of a LoRA adapter output: its stabilized deltas' (the file it is made from), the
    record saying how to make it again (`lora`: its output kind and rank)."""
    from safetensors import safe_open

    with safe_open(str(deltas), framework="pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k != "format"}
    if KEY in meta:
        doc = json.loads(meta[KEY])
        meta[KEY] = json.dumps({**doc, "record": {**doc["record"], "lora": lora}}, separators=(",", ":"))
    return meta


def read(folder: Path) -> dict:
    """The provenance of a model folder, from its first safetensors file's header."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise InputError(f"{folder}: no safetensors weights to verify")
    from safetensors import safe_open

    try:
        with safe_open(str(files[0]), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - a foreign or broken file: one line naming it
        raise InputError(f"{files[0]}: not a readable safetensors file ({exc})") from None
    if KEY not in meta:
        raise InputError(f"{files[0]}: carries no bema provenance (written by another tool or an older bema)")
    try:
        doc = json.loads(meta[KEY])
    except (ValueError, RecursionError):
        raise InputError(f"{files[0]}: its bema provenance is not JSON (edited?)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("record"), dict):
        raise InputError(f"{files[0]}: its bema provenance has no record (edited?)")
    problem = _malformed(doc)
    if problem:
        raise InputError(f"{files[0]}: its bema provenance {problem} (edited?)")
    return doc


NUMBERS = NUMBER_KEYS  # a stabilizer's numeric parameters (schedule.py's fields)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _vector(v) -> bool:
    """A coefficient vector keyed by name, or (a window's merge weights in an older stabilize's
    record) a list."""
    if isinstance(v, list):
        return all(_number(c) for c in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _number(c) for k, c in v.items())


def written_from(record: dict) -> str:
    """How a model was made: "walk" (stabilize's fused pass: verify walks the run again) or
    "vector" (ship, select --write: one float64 sum of its coefficients). Records say it; an older
    bema's said it by the type under `coefficients` (a vector dict: written from it; a window's
    merge weights, a list, or none: stabilize)."""
    said = record.get("written_from")
    if said in ("walk", "vector"):
        return said
    return "vector" if isinstance(record.get("coefficients"), dict) else "walk"


def _malformed(doc: dict) -> str | None:
    """What is wrong with a provenance document, said in words (None: its shape is sound)."""
    record = doc["record"]
    step = record.get("step")
    if not isinstance(record.get("source_checkpoint"), str):
        return "names no source checkpoint"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"has step {step!r}, not a step number"
    if not isinstance(record.get("run", ""), str) or not isinstance(record.get("method", ""), str):
        return "has a run or method that is not a name"
    if not isinstance(doc.get("inputs", {}), dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in doc.get("inputs", {}).items()
    ):
        return "has inputs that are not fingerprints by name"
    for where, vector in (("header", doc.get("coefficients")), ("record", record.get("coefficients"))):
        if vector is not None and not _vector(vector):
            return f"has a coefficient in its {where} that is not a finite number"
    for key in NUMBERS:
        value = record.get(key)
        if value is not None and not _number(value) and value not in ("inf", "-inf"):
            return f"has {key} {value!r}, not a finite number"
    lora = record.get("lora", {})
    rank = lora.get("rank") if isinstance(lora, dict) else None
    if (
        not isinstance(lora, dict)
        or lora.get("output", "merged") not in ("merged", "adapter")
        or not (rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0))
    ):
        return f"has a LoRA output {lora!r} that is not one stabilize writes"
    coefficients = record.get("coefficients")
    theta0 = "theta0" in doc.get("inputs", {}) or (
        isinstance(coefficients, dict) and "theta0" in coefficients
    )
    if theta0 and not isinstance(record.get("theta0_source"), str):
        return "reads theta0 but names no theta0 source"
    return None
