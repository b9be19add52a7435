"""What makes two `bema eval` records comparable: the resume key, and a fingerprint of the weights.

A record in results.jsonl is reused on a re-run only when its `resume_key` equals the key
the re-run would write: the whole task protocol (prompt version, shots, CoT, subset, sampling,
token limits, data files and their content), the seeds, the chat template, the backend, the
requested dtype, the batch size for lm-eval tasks on transformers, and the model folder's fingerprint.
Anything else is refused with the differences named (see `differences`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from bema_cli.io.reader import safetensors_files

SAMPLE_CHUNKS, CHUNK_BYTES = 16, 1 << 16  # 1 MiB read per weight file, spread over its whole length
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_of_files(paths: list[Path]) -> str:
    """One digest over several files' contents (a task's data files)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{Path(path).name}:{file_sha256(Path(path))}\n".encode())
    return digest.hexdigest()


def folder_sha256(folder: str | Path) -> str:
    """The contents of every file below `folder` (a folder of lm-eval task YAMLs and their data)."""
    root = Path(folder)
    return sha256_of_files(sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts))


def weights_fingerprint(folder: str | Path) -> str:
    """A sha256 over the model's small files (config, tokenizer, template) in full and, per weight
    file, its size, its safetensors header and 16 chunks of 64 KiB spread evenly over its length.

    Cheap (about 1 MiB read per shard) and sensitive to any training: fine-tuning changes nearly
    every byte of the weights, so two different checkpoints share no sampled chunk. It does not
    prove two files identical byte for byte (a hash of everything would; a read of every checkpoint).
    """
    folder = Path(folder)
    digest = hashlib.sha256()
    for name in MODEL_FILES:
        if (folder / name).is_file():
            digest.update(f"{name}:{file_sha256(folder / name)}\n".encode())
    for path in safetensors_files(folder):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}\n".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            digest.update(head + f.read(min(header_len, size)))
            for i in range(SAMPLE_CHUNKS):
                f.seek(max(0, (size - CHUNK_BYTES) * i // max(1, SAMPLE_CHUNKS - 1)))
                digest.update(f.read(CHUNK_BYTES))
    return digest.hexdigest()[:32]


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def differences(old: dict | None, new: dict) -> list[str]:
    """['seeds.sampling 13337 -> 1', ...]: the fields of two resume keys that differ."""
    if old is None:
        return ["no resume key (a record of an older bema)"]
    a, b = _flat(old), _flat(new)
    return [
        f"{k} {_short(a.get(k))} -> {_short(b.get(k))}"
        for k in sorted(a.keys() | b.keys())
        if not _same(a.get(k), b.get(k)) and not (k in RETIRED and k not in b)
    ]


def _same(old, new) -> bool:
    """Equal, or the same files named by longer or shorter tails of their paths: records name a file
    inside the folder it shares with OUT (provenance.input_name), so a moved OUT, or an older bema's
    absolute path, names it by another tail. Its content is the key's digest (data_sha256)."""
    from bema_cli.io.provenance import same_tail

    if old == new:
        return True
    if not (isinstance(old, str) and isinstance(new, str)):
        return False
    olds, news = old.removeprefix("file:").split(", "), new.removeprefix("file:").split(", ")
    return len(olds) == len(news) and all(same_tail(a, b) for a, b in zip(olds, news, strict=True))


# fields older keys held that no longer change results: a record carrying them still resumes
RETIRED = {"batch_size"}  # bema's own tasks: samples do not depend on the batch (base.prompt_seed)


def _short(value) -> str:
    text = "none" if value is None else str(value)
    return text if len(text) <= 40 else f"{text[:16]}...{text[-16:]}"
