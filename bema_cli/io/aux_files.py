"""The side files of a checkpoint (config, tokenizer, chat template) copied next to every output
so it loads like the checkpoint it came from: plain files only, none reached through a link
that leads out of its own folder."""

from __future__ import annotations

import re
from pathlib import Path

from bema_cli.errors import InputError, OutputError
from bema_cli.io.checkpoints import is_regular

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


# What bema writes into a checkpoint folder besides the side files: the weights (a model's or an
# adapter's) and their index, the record, the card
OUTPUT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "adapter_config.json",
    "bema.json",
    "README.md",
)


def written_by_bema(path: Path) -> bool:
    """A file bema writes into an output folder: its folder holds bema.json, and its name is one an
    output has (OUTPUT_PATTERNS, AUX_PATTERNS). Anything else there is the user's (--overwrite keeps it)."""
    return (path.parent / "bema.json").is_file() and any(
        path.match(p) for p in (*OUTPUT_PATTERNS, *AUX_PATTERNS)
    )


def users_files(folder: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """The files under `folder` bema did not write (written_by_bema), relative to it, sorted; the
    top-level entries named in `skip` (bema's own work folders) are not looked into."""
    found = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if rel.parts[0] in skip or (p.is_dir() and not p.is_symlink()) or written_by_bema(p):
            continue
        found.append(rel.as_posix())
    return found


def carry(old: Path, new: Path, names: list[str]) -> None:
    """The user's files of an output about to be replaced into its replacement, before the swap: hard
    links (no copy; the originals stay until the old output is gone), else copies."""
    import os
    import shutil

    for name in names:
        dst = new / name
        if dst.exists() or dst.is_symlink():
            continue  # the new output writes this name itself
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(old / name, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(old / name, dst, follow_symlinks=False)


# Fields where trainers (older transformers, TRL, Megatron exports) write the folder a model was
# loaded from: an absolute path there names the training machine's disk. Written as its last part.
PATH_FIELDS = {"config.json": "_name_or_path", "tokenizer_config.json": "name_or_path"}


def copy_aux_files(dst: Path, sources: list[Path], inside: list[Path] | None = None) -> list[str]:
    """Copy config/tokenizer/chat-template files into dst, each from the first source that has it;
    links may lead into the `inside` folders (default: the sources) and nowhere else (aux_files). A
    local path in PATH_FIELDS is written as a name (the folder's), so no output carries one."""
    copied: list[str] = []
    for src in sources:
        for f in aux_files(src, inside or sources):
            if f.name not in copied:
                _copy_bytes(f, dst / f.name)
                copied.append(f.name)
                if f.name in PATH_FIELDS:
                    _as_name(dst / f.name, PATH_FIELDS[f.name])
    return copied


def local_path(value: object) -> bool:
    """A string that names a place on a disk (absolute, home-relative, or a Windows drive), not a Hub id."""
    return isinstance(value, str) and (
        value.startswith(("/", "~", "\\\\", "./", "../")) or bool(re.match(r"[A-Za-z]:[\\/]", value))
    )


def _as_name(path: Path, key: str) -> None:
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # not JSON: copied as it is (push still refuses a file holding an absolute path)
    if isinstance(doc, dict) and local_path(doc.get(key)):
        doc[key] = Path(doc[key].replace("\\", "/").rstrip("/")).name
        path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def digests(folder: Path, names: list[str]) -> dict[str, str]:
    """{name: xxh3_128 of its bytes} of the side files written into `folder` (verify checks them)."""
    from bema_cli.io.fingerprint import file_digest

    return {name: file_digest(folder / name) for name in sorted(names)}


def _copy_bytes(src: Path, dst: Path) -> None:
    """src's bytes (through a link: its target's) into a new regular file dst; a failure names the file
    at fault and says whether reading or writing failed."""
    try:
        source = open(src.resolve(), "rb")
    except OSError as exc:
        raise InputError(f"{src}: cannot read ({exc.strerror or exc})") from None
    with source:
        try:
            target = open(dst, "wb", buffering=0)  # unbuffered: a full disk fails in write(), named
        except OSError as exc:
            raise OutputError(f"{dst}: cannot write ({exc.strerror or exc})") from None
        with target:
            while True:
                try:
                    chunk = source.read(1 << 20)
                except OSError as exc:
                    raise InputError(f"{src}: cannot read ({exc.strerror or exc})") from None
                if not chunk:
                    break
                try:
                    view = memoryview(chunk)
                    while view:
                        view = view[target.write(view) :]
                except OSError as exc:
                    raise OutputError(f"{dst}: cannot write ({exc.strerror or exc})") from None


def aux_files(src: Path, inside: list[Path]) -> list[Path]:
    """The side files of model folder `src` that copy_aux_files would copy; InputError naming a link
    whose target lies outside the `inside` folders (the checkpoint and the base: a hostile checkpoint
    would otherwise have any readable file, ~/.ssh/id_rsa say, copied into OUT). A Hub cache
    snapshot's links into its repo's blobs/ stay inside it."""
    roots = [_hub_repo(p) or p.resolve() for p in inside]
    files = []
    for pattern in AUX_PATTERNS:
        for f in sorted(src.glob(pattern)):
            if f.name.endswith(".safetensors") or f.is_dir() or not is_regular(f):
                continue  # a FIFO, socket or device is refused by is_regular, naming it
            if f.is_symlink() and not any(f.resolve().is_relative_to(r) for r in roots):
                raise InputError(
                    f"{f}: a symbolic link to {f.resolve()}, outside the checkpoint and base folders; "
                    "not copied into the output (copy the file there instead of linking it)"
                )
            files.append(f)
    return files


HUB_REPO = re.compile(r"models--[^/]+")  # the HF cache's folder of one model repo: models--<org>--<name>


def _hub_repo(folder: Path) -> Path | None:
    """The blobs/ folder of an HF cache snapshot, recognised by the cache's whole layout
    (`models--<org>--<name>/snapshots/<rev>` beside `blobs/`): a snapshot's files link there. A run
    folder merely named `snapshots` beside a `blobs/` is not a cache, and its links stay refused."""
    repo = folder.parent.parent
    if (
        folder.parent.name != "snapshots"
        or not HUB_REPO.fullmatch(repo.name)
        or not (repo / "blobs").is_dir()
    ):
        return None
    return (repo / "blobs").resolve()
