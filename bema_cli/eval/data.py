"""Benchmark and loss data: Hub parquet files (cached by huggingface_hub) or local files.

`--data-dir DIR` holds DIR/<task>.jsonl or DIR/<task>.parquet in the Hub schema (and, for
`--num-fewshot`, DIR/<task>_shots.jsonl|parquet); a task without a local file is fetched from
the Hub (test split; few-shot examples from the train split, MMLU's dev split). Every row is checked, and a bad one is
reported with its file and line. The prompt subset is the paper's:
`sorted(RandomState(seed).choice(len(split), k, replace=False))`, per subject for MMLU.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from bema_cli.errors import InputError


def select(n: int, k: int, seed: int) -> list[int]:
    """The paper's fixed subset: k = min(limit, n) sorted indices drawn without replacement."""
    import numpy as np

    k = min(k, n)
    return sorted(int(i) for i in np.random.RandomState(seed).choice(n, k, replace=False))


def local_file(task: ModuleType, data_dir: str | Path | None, shots: bool = False) -> Path | None:
    if data_dir is None:
        return None
    stem = f"{task.NAME}_shots" if shots else task.NAME
    for ext in ("jsonl", "parquet"):
        path = Path(data_dir) / f"{stem}.{ext}"
        if path.is_file():
            return path
    return None


def needed_files(task: ModuleType, shots: bool = False) -> str:
    """What a user must provide for `task`, for the offline error message."""
    hub_source = task.SHOTS_HUB if shots else task.HUB
    stem = f"{task.NAME}_shots" if shots else task.NAME
    hub = f"{hub_source['repo']}:{','.join(hub_source['patterns'])}"
    return f"{stem}: --data-dir/{stem}.jsonl|parquet with fields {', '.join(task.FIELDS)}, or Hub {hub}"


def hub_files(source: dict) -> list[Path] | None:
    """A task's parquet files from the Hub cache (downloading them when online); None if unavailable."""
    try:
        from huggingface_hub import snapshot_download

        root = snapshot_download(source["repo"], repo_type="dataset", allow_patterns=source["patterns"])
    except Exception:  # offline, not cached, no network, gated: all mean "not available here"
        return None
    files = sorted(p for pattern in source["patterns"] for p in Path(root).glob(pattern))
    return files or None


def resolve_sources(
    tasks: list[ModuleType], data_dir: str | Path | None, shots: bool = False
) -> dict[str, list[Path]]:
    """Files for every task (its test split, or with `shots` its few-shot split), checked up front;
    one error listing everything missing."""
    sources, missing = {}, []
    for task in tasks:
        local = local_file(task, data_dir, shots)
        files = [local] if local else hub_files(task.SHOTS_HUB if shots else task.HUB)
        if files is None:
            missing.append(needed_files(task, shots))
        else:
            sources[task.NAME] = files
    if missing:
        raise InputError("no data (offline or not cached) for " + "; ".join(missing))
    return sources


def _check_row(row: object, task: ModuleType, where: str) -> dict:
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object with fields {', '.join(task.FIELDS)}")
    for field, kind in task.FIELDS.items():
        value = row.get(field)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise InputError(f"{where}: field {field!r} must be {kind.__name__}, got {type(value).__name__}")
    if task.NAME == "mmlu_hs":
        if len(row["choices"]) != 4 or not all(isinstance(c, str) for c in row["choices"]):
            raise InputError(f"{where}: 'choices' must be 4 strings")
        if not 0 <= row["answer"] < 4:
            raise InputError(f"{where}: 'answer' must be an index 0-3")
    if task.NAME == "gsm8k" and "####" not in row["answer"]:
        raise InputError(f"{where}: 'answer' has no '#### <number>'")
    return row


def read_rows(path: Path) -> list[tuple[str, object]]:
    """(location, row) pairs of a jsonl or parquet file; locations are 'file:line' / 'file row n'."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        except Exception as exc:
            raise InputError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0]})") from None
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(rows)]
    return [(f"{path}:{number}", row) for number, row in jsonl_rows(path)]


def jsonl_rows(path: Path, end: int | None = None) -> list[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line before line `end`; a bad line is an
    error naming file:line."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="strict" if end is None else "replace")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({exc})") from None
    lines = lines.splitlines()[: None if end is None else end - 1]
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise InputError(f"{path}:{number}: invalid JSON (nested too deeply)") from None
    return out


def _read_task_rows(task: ModuleType, files: list[Path]) -> list[dict]:
    rows = []
    for path in files:
        for where, row in read_rows(path):
            row = _check_row(row, task, where)
            if task.NAME == "mmlu_hs" and not row.get("subject"):
                row["subject"] = path.parent.name  # Hub layout: <subject>/test-*.parquet
            rows.append(row)
    if not rows:
        raise InputError(f"{', '.join(map(str, files))}: no rows for task {task.NAME}")
    return rows


def _by_subject(task: ModuleType, rows: list[dict]) -> dict[str, list[dict]]:
    if not getattr(task, "PER_SUBJECT", False):
        return {"": rows}
    return {s: [r for r in rows if r["subject"] == s] for s in sorted({r["subject"] for r in rows})}


def load_docs(task: ModuleType, files: list[Path], limit: int, seed: int) -> list[dict]:
    """The selected items of a task, each with `_id` (its index in the split, per subject for MMLU)."""
    docs = []
    for subject, group in _by_subject(task, _read_task_rows(task, files)).items():
        prefix = f"{subject}/" if subject else ""
        docs += [{**group[i], "_id": f"{prefix}{i}"} for i in select(len(group), limit, seed)]
    return docs


def load_shots(task: ModuleType, files: list[Path], k: int, seed: int) -> dict[str, list[dict]]:
    """Few-shot examples: k items of the few-shot split (per subject for MMLU), the paper's selection
    formula with `seed`, the same examples for every prompt (of that subject)."""
    groups = _by_subject(task, _read_task_rows(task, files))
    return {subject: [group[i] for i in select(len(group), k, seed)] for subject, group in groups.items()}


def read_loss_records(path: str | Path, limit: int, seed: int | None = None) -> list[dict]:
    """`limit` records of a loss jsonl (the first ones; with `seed`, a seeded sample in file order,
    so a file sorted by source or task is not judged on its head), in the formats TRL's SFTTrainer trains on:
    {"text": str}, {"messages": [{"role","content"}...]}, {"prompt": str, "completion": str}, or
    {"prompt": [messages], "completion": [messages]} (conversational prompt-completion)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: loss data file not found")
    records = []
    rows = read_rows(path)
    total = len(rows)
    if seed is not None and total > limit:
        import random

        rows = [rows[i] for i in sorted(random.Random(seed).sample(range(total), limit))]
    for where, row in rows:
        if len(records) >= limit:
            break
        record = _loss_record(row)
        if record is None:
            raise InputError(f"{where}: {_found(row)}; expected {LOSS_FORMATS}")
        if not _scored(record):  # nothing to score: a division by zero tokens 25 s later
            raise InputError(
                f"{where}: an empty {'completion' if 'completion' in record else 'text'}: nothing to score"
            )
        records.append(record)
    if not records:
        raise InputError(f"{path}: no records")
    if total > len(records):  # said: a verdict on 200 of 400 records is not one on the file
        from bema_cli import output

        which = "a seeded sample of" if seed is not None else "the first"
        output.warn(f"{path}: scoring {which} {len(records)} of its {total} records (--loss-samples)")
    return records


def _found(row: object) -> str:
    """What a row that is no loss record holds, in words."""
    if isinstance(row, list):
        return "a JSON array (bema reads JSON Lines: one object per line)"
    if isinstance(row, dict):
        return f"an object with keys {', '.join(map(repr, list(row)[:6])) or 'none'}"
    return f"a JSON {type(row).__name__}"


def _scored(record: dict) -> bool:
    """Whether a loss record has tokens to score (a completion, or a text, that is not empty)."""
    if "text" in record:
        return bool(record["text"].strip())
    if "completion" in record:
        c = record["completion"]
        return bool(c.strip()) if isinstance(c, str) else any(str(m.get("content", "")).strip() for m in c)
    return True


LOSS_FORMATS = (
    '{"text": str}, {"messages": [{"role", "content"}...]}, {"prompt": str, "completion": str} '
    "or prompt and completion as message lists"
)


def _loss_record(row: object) -> dict | None:
    """The fields a loss record keeps, or None when the row is in none of the formats."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("text"), str):
        return {"text": row["text"]}
    if _is_messages(row.get("messages")):
        return {"messages": row["messages"]}
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return {"prompt": prompt, "completion": completion}
    if _is_messages(prompt) and _is_messages(completion):
        return {"prompt": prompt, "completion": completion}
    return None


def _is_messages(messages: object) -> bool:
    return isinstance(messages, list) and bool(messages) and all(_is_message(m) for m in messages)


def _is_message(m: object) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
