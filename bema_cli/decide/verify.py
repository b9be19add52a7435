"""`bema verify DIR`: rebuild a model bema wrote from the provenance inside its weights
(io/provenance.py) and the inputs it names, and say bitwise which tensors differ.

The rebuild runs the writer that made it: the streaming stabilize engine for an average of the
run (its settings, step and theta0 from the record; a one-shot run is bitwise an incremental one),
fit.combine for a fitted average (its coefficients over its input folders). The inputs' fingerprints
are compared first, so a difference is laid at the right door: an input changed since, or the weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bema_cli.decide.write import rebuild_average
from bema_cli.errors import InputError
from bema_cli.io import provenance
from bema_cli.io.checkpoints import find_checkpoints, run_of, step_of


def _input_folders(record: dict, doc: dict) -> dict[str, Path]:
    """The input folders the provenance names, by its `inputs` keys."""
    if isinstance(record.get("coefficients"), dict):  # a fitted average: keyed by folder
        return {k: Path(k) for k in doc.get("inputs", {})}
    run = run_of(record["source_checkpoint"])
    try:  # any layout find_checkpoints reads (Megatron-Bridge's: iter_<N>/hf/)
        by_step = {str(c.step): c.path for c in find_checkpoints(run)}
    except InputError:
        by_step = {}
    folders = {k: by_step.get(k, run / f"checkpoint-{k}") for k in doc.get("inputs", {}) if k != "theta0"}
    if "theta0" in doc.get("inputs", {}):
        folders["theta0"] = Path(record["theta0_source"])
    return folders


def changed_inputs(record: dict, doc: dict) -> list[str]:
    """Inputs whose fingerprint differs from the one recorded (or that are gone)."""
    out = []
    for key, folder in sorted(_input_folders(record, doc).items()):
        try:
            now = provenance.input_print(folder) if folder.is_dir() else None
        except (OSError, InputError):
            now = None
        if now != doc["inputs"][key]:
            out.append(f"{key} ({folder}: {'changed' if now else 'gone'})")
    return out


def _step(folder: str) -> int:
    try:
        step = step_of(Path(folder))
    except InputError:
        step = None
    return -1 if step is None else step


def rebuild(record: dict, tmp: Path) -> Path:
    """The model folder the record describes, written again under `tmp`."""
    from bema_cli.decide import fit

    if isinstance(record.get("coefficients"), dict):  # a fitted average
        # summed in the order it was: theta0, then the checkpoints by step (float64 sums depend on it)
        keys = sorted(record["coefficients"], key=lambda k: (k != "theta0", _step(k), k))
        terms = [(Path(record["theta0_source"]) if k == "theta0" else Path(k), float(record["coefficients"][k]))
                 for k in keys]  # fmt: skip
        for folder, _ in terms:
            if not folder.is_dir():
                raise InputError(f"{folder}: an input of this fitted average is not a local folder (gone?)")
        return fit.combine(terms, Path(record["source_checkpoint"]), tmp / "m", record)
    return rebuild_average(record, tmp)


def verify(folder: Path) -> dict:
    """The --json document: which tensors of `folder` differ bitwise from its rebuild, and which
    inputs changed since it was written."""
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    doc = provenance.read(folder)
    record = doc["record"]
    changed = changed_inputs(record, doc)
    tmp = folder.parent / f".bema-tmp-verify-{folder.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        again = rebuild(record, tmp)
        mine = {n: f for f in sorted(folder.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()}
        theirs = {n: f for f in sorted(again.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()}
        differ = sorted(set(mine) ^ set(theirs))
        for name in sorted(set(mine) & set(theirs)):
            with safe_open(str(mine[name]), "pt") as a, safe_open(str(theirs[name]), "pt") as b:
                x, y = a.get_tensor(name), b.get_tensor(name)
            same = x.dtype == y.dtype and x.shape == y.shape
            if not same or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                differ.append(name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"folder": str(folder), "identical": not differ, "tensors": len(mine), "differ": differ,
            "changed_inputs": changed, "record": record, "coefficients": doc.get("coefficients"),
            "bema_version": record.get("bema_version")}  # fmt: skip
