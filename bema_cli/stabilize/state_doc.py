"""The state.json document: one up-front check of everything state.py reads, and the checksums of the state files.

state.json is read back by a later call and trusted to name folders bema deletes and tensors it
continues from, so the whole document is checked before any field is used (a hand edit, a torn
copy, another program's file): types, required keys, and names that stay inside OUT. Every
state file's bytes are summed (xxh3_128, io/fingerprint.file_digest) when staged and verified before a call continues from
it: a bit flip or a rewrite in another dtype would otherwise go on silently into every later output.
"""

from __future__ import annotations

import re
from pathlib import Path

from bema_cli.errors import InputError, OutputError
from bema_cli.io.checkpoints import model_weight_files
from bema_cli.io.fingerprint import DIGEST, file_digest
from bema_cli.io.safetensors import ModelIndex, index_model

DELETE_RE = re.compile(r"checkpoint-[0-9]+")  # ASCII digits only, like every step bema reads
FINGERPRINT_KEYS = {"name": str, "size": int, "header_sha256": str}


class _Bad(Exception):
    """One problem with the document, as words; turned into an InputError naming state.json."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _plain_name(x, what: str) -> str:
    """A single folder or file name: no separator, not '.' or '..' (it must stay inside OUT)."""
    if not isinstance(x, str) or not x or x in (".", "..") or "/" in x or "\\" in x or "\0" in x:
        raise _Bad(f"{what} {x!r} is not a plain name inside OUT")
    return x


def _field(d, key: str, kind, where: str):
    if not isinstance(d, dict) or key not in d:
        raise _Bad(f"{where}: missing {key!r}")
    value = d[key]
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise _Bad(f"{where}.{key} is {value!r}, expected {getattr(kind, '__name__', kind)}")
    return value


def _fingerprints(files, where: str) -> None:
    if not isinstance(files, list):
        raise _Bad(f"{where}.files is not a list")
    for i, f in enumerate(files):
        for key, kind in FINGERPRINT_KEYS.items():
            _field(f, key, kind, f"{where}.files[{i}]")
        _plain_name(f["name"], f"{where}.files[{i}].name")
        for key in ("sample_sha256", DIGEST):
            if key in f and not isinstance(f[key], str):
                raise _Bad(f"{where}.files[{i}].{key} is not a string")


def _check(doc, checked: tuple[str, ...]) -> None:
    """Raise _Bad on the first field state.py could not use as it is."""
    if not isinstance(doc, dict):
        raise _Bad("not a JSON object")
    theta0 = _field(doc, "theta0", dict, "state")
    _field(theta0, "source", str, "theta0")
    _fingerprints(theta0.get("files", []), "theta0")
    burnin = theta0.get("burnin")
    if burnin is not None:
        _field(burnin, "step", int, "theta0.burnin")
        _plain_name(_field(burnin, "folder", str, "theta0.burnin"), "theta0.burnin.folder")
    for i, s in enumerate(_field(doc, "steps", list, "state")):
        _field(s, "step", int, f"steps[{i}]")
        _field(s, "path", str, f"steps[{i}]")
        _fingerprints(_field(s, "files", list, f"steps[{i}]"), f"steps[{i}]")
    history = {s["step"] for s in doc["steps"]}
    for i, r in enumerate(_field(doc, "runs", list, "state")):
        where = f"runs[{i}]"
        _plain_name(_field(r, "run", str, where), f"{where}.run")
        last = _field(r, "last_step", int, where)
        if last not in history:  # a run ends at a step the history holds (the seal aside: no key needed)
            ends = f"ends at {max(history)}" if history else "is empty"
            raise _Bad(f"{where}.last_step {last} is not a step of the history (which {ends})")
        if r.get("state") is not None:
            _plain_name(r["state"], f"{where}.state")
        outputs = _field(r, "outputs", list, where)
        if not all(_is_int(x) and 0 <= x <= r["last_step"] for x in outputs):
            raise _Bad(f"{where}.outputs holds a step that is not an integer in [0, last_step]")
        for key in checked:
            if key not in r:
                raise _Bad(f"{where}: missing {key!r}")
    for rel in doc.get("delete", []):
        parts = rel.split("/") if isinstance(rel, str) else []
        if len(parts) != 2 or not DELETE_RE.fullmatch(parts[1]):
            raise _Bad(f"delete entry {rel!r} is not <run>/checkpoint-<step>")
        _plain_name(parts[0], "delete entry")
    sums = _field(doc, "checksums", dict, "state")
    named = {r.get("state") for r in doc["runs"]} | {(burnin or {}).get("folder")}
    for folder in sorted(f for f in named if f and f not in sums):
        raise _Bad(f"checksums has no entry for the state folder {folder!r}")
    for folder, files in sums.items():
        _plain_name(folder, "checksums folder")
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise _Bad(f"checksums[{folder!r}] is not a map of file -> digest")
        for name in files:
            _plain_name(name, f"checksums[{folder!r}] file")


def seal(doc: dict) -> str:
    """The digest of a state document's canonical JSON (every key but "seal" itself), state-file
    checksums included: state.json names what bema deletes and continues from, so any edit of
    the right type but the wrong content (a last_step, a swapped state folder, a removed checksum,
    a delete entry) is caught here, in one place no key can switch off. It guards against edits
    and accidents, not a forger who recomputes it (xxh3 is not keyed): beside it stand the checks
    that need no key (`_check`'s last_step in the history, state.check_folder's folder names)."""
    import json

    import xxhash

    body = {k: v for k, v in doc.items() if k != "seal"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(text.encode())


def validate(doc, path: Path, fmt: int, checked: tuple[str, ...]) -> dict:
    """The document, checked whole and against its seal; InputError naming `path` and the first
    problem otherwise."""
    fix = "pass --restart to recompute from scratch"
    if isinstance(doc, dict) and _is_int(doc.get("format")) and 0 < doc["format"] < fmt:
        raise InputError(f"{path}: a state of an older bema (format {doc['format']}, unsealed); {fix}")
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise InputError(f"{path}: not a bema state (format {fmt}); {fix}")
    try:
        _check(doc, checked)
    except _Bad as exc:
        raise InputError(f"{path}: malformed bema state ({exc}); {fix}") from None
    if doc.get("seal") != seal(doc):
        raise InputError(f"{path}: edited since bema wrote it (its seal does not match its content); {fix}")
    return doc


def checksums(folder: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """The digest of every file of a staged state folder, by name: `known` ones (summed as they were
    written: io/writer.py) taken as they are, the others read back."""
    known = known or {}
    return {p.name: known.get(p.name) or file_digest(p) for p in sorted(folder.iterdir()) if p.is_file()}


def verify(folder: Path, expected: dict[str, str]) -> None:
    """The state folder holds exactly the files summed when it was written, byte for byte."""
    fix = "pass --restart to recompute from scratch"
    for name, digest in sorted(expected.items()):
        path = folder / name
        try:
            if path.is_symlink() or not path.is_file():
                raise InputError(f"{path}: the state file is missing; {fix}")
            ok = file_digest(path) == digest
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror or exc}); {fix}") from None
        if not ok:
            raise InputError(
                f"{path}: the state file changed since it was written (checksum mismatch); {fix}"
            )


# -- the state folders: no links, verified contents, the expected tensors ------------------------
def check_no_links(folder: Path) -> None:
    """OUT/.bema-state (`folder`) and what lies directly in it are real files and folders, never symbolic links.

    bema deletes state folders no run needs and renames new ones in: through a link planted
    there (to the training run, to a shared folder) that would delete or overwrite what it points at.
    """
    if folder.exists() and not folder.is_dir() and not folder.is_symlink():
        raise OutputError(f"{folder}: is not a folder; bema keeps its state there (remove it)")
    links = [folder] if folder.is_symlink() else []
    if not links and folder.is_dir():
        links = sorted(p for p in folder.iterdir() if p.is_symlink())
    if links:
        raise OutputError(
            f"{links[0]}: is a symbolic link; bema never writes or deletes through links in OUT (remove it)"
        )


def index_state(folder: Path, stored: dict) -> ModelIndex:
    """A state folder, its files verified against the checksums state.json keeps for them."""
    if not folder.is_dir():
        raise InputError(f"{folder}: the state folder is missing; pass --restart to recompute from scratch")
    verify(folder, stored["checksums"][folder.name])  # _check: every named folder has its checksums
    return index_model(folder, model_weight_files(folder))


def check_layout(index: ModelIndex, shards) -> None:
    """A state folder holds the tensors this run continues, in the accumulation dtype and the model's shapes."""
    expected = {t.name: t for shard in shards for t in shard.tensors}
    for name, want in expected.items():
        got = index.tensors.get(name)
        if got is None or got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            found = f"{got.dtype} {list(got.shape)}" if got else "missing"
            raise InputError(
                f"{index.folder}: state tensor {name} is {found}, expected {want.dtype} {list(want.shape)}; "
                "pass --restart to recompute from scratch"
            )
