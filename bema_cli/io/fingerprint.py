"""Fingerprints of weight files: cheap evidence that a file is still what was read earlier.

A fingerprint is [{name, size, header_sha256, sample_sha256}] per weight file: the size and
the header change with the layout, a 128 KiB sample of the data with a rewrite of the same
layout. `bema stabilize` records one per consumed checkpoint in its persistent state.

A full fingerprint (`--fingerprint full`, the default) adds the xxh3_128 digest of the whole file and its
stat (inode, mtime_ns, ctime_ns), so a change anywhere is caught, also in the middle the sample
skips. It is taken from the held files just before the engine reads them (the hash pass brings
them into the page cache the walk then reads from: docs/performance.md has the cost). A later
call re-hashes a consumed file only when its stat changed (like git's index): a write changes
mtime and ctime, and ctime cannot be set back by a user.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from bema_cli.errors import InputError

HEAD_BYTES = 1 << 20  # fingerprint of a non-safetensors weight file: its first MiB
SAMPLE_BYTES = 64 << 10  # and of the data: its first and last 64 KiB
# The whole-file digest of a full fingerprint, and of the state files (stabilize/state_doc.py).
DIGEST = "xxh3_128"


def head_hash(path: Path) -> tuple[str, str]:
    """sha256 of a weight file's header, and of a sample of its data (first and last 64 KiB).

    The header (safetensors: length prefix + JSON; else the first MiB) changes with the layout;
    the sample catches a rewrite with the same layout (a retrained checkpoint differs everywhere).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
        n = struct.unpack("<Q", head[:8])[0] if len(head) == 9 else 0
        if (
            head[8:] == b"{" and 8 + n <= size
        ):  # a safetensors header (checked by content: paths may be aliases)
            head += f.read(n - 1)
        else:
            head += f.read(HEAD_BYTES - len(head))
        sample = f.read(SAMPLE_BYTES)
        f.seek(max(f.tell(), size - SAMPLE_BYTES))
        sample += f.read(SAMPLE_BYTES)
    return hashlib.sha256(head).hexdigest(), hashlib.sha256(sample).hexdigest()


def _stat_key(st) -> list[int]:
    return [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def fingerprint(files: list[Path], full: bool = False, known: list[dict] | None = None) -> list[dict]:
    """[{name, size, header_sha256, sample_sha256}] of a model's weight files: cheap, changes with a rewrite.

    `full` adds {xxh3_128, stat}; the digest of a file in `known` (an earlier full fingerprint) whose
    stat is unchanged is taken from it instead of reading the file again.
    """
    before = {f["name"]: f for f in known or [] if DIGEST in f and "stat" in f}
    out = []
    try:
        for p in files:
            st = os.stat(p)
            header, sample = head_hash(p)
            entry = {"name": p.name, "size": st.st_size, "header_sha256": header, "sample_sha256": sample}
            if full:
                old = before.get(p.name)
                same = old is not None and old["stat"] == _stat_key(st) and old["size"] == st.st_size
                entry[DIGEST] = old[DIGEST] if same else file_digest(p)
                entry["stat"] = _stat_key(st)
            out.append(entry)
    except OSError as exc:
        raise InputError(f"{exc.filename}: cannot read ({exc.strerror or exc})") from None
    return out


def file_digest(path: Path) -> str:
    """xxh3_128 of a whole file: a non-cryptographic digest that catches any accidental change, at ~9 GB/s
    (sha256 ran at ~1.1 GB/s on the dev machine, >5% of a run: docs/performance.md)."""
    import xxhash

    with open(path, "rb") as f:
        return hashlib.file_digest(f, xxhash.xxh3_128).hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The files holding a model folder's weights, in any format the readers take (its record)."""
    from bema_cli.io.reader import describe

    return list(describe(folder).files)


def fingerprint_if_present(folder: Path, known: list[dict] | None = None) -> list[dict] | None:
    """A checkpoint's fingerprint, or None when it vanished meanwhile (a trainer's rotation).

    Full (whole-file digest) when `known`, the fingerprint recorded earlier, is full: it is compared with it.
    """
    full = any(DIGEST in f for f in known or [])
    try:
        return fingerprint(weight_files(folder), full, known)
    except InputError:
        if folder.exists():
            raise
        return None


def changed(old: list[dict], new: list[dict]) -> str | None:
    """How a fingerprint differs, in words, or None."""
    old_by, new_by = {f["name"]: f for f in old}, {f["name"]: f for f in new}
    if set(old_by) != set(new_by):
        return f"weight files were {sorted(old_by)}, now {sorted(new_by)}"
    for name, f in new_by.items():
        if f["size"] != old_by[name]["size"]:
            return f"{name} was {old_by[name]['size']} bytes, now {f['size']}"
        if f["header_sha256"] != old_by[name]["header_sha256"]:
            return f"{name} has a different header"
        if f["sample_sha256"] != old_by[name].get("sample_sha256"):
            return f"{name} holds different values"
        if DIGEST in f and DIGEST in old_by[name] and f[DIGEST] != old_by[name][DIGEST]:
            return f"{name} holds different values (digest of the whole file)"
    return None
