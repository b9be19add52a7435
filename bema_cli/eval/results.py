"""Files of `bema eval`: results.jsonl (one record per (checkpoint, run, task)) and samples.jsonl.

Both are appended line by line and flushed, so an error or interrupt keeps every result
already computed; that is also what makes `bema eval` resumable.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bema_cli.errors import InputError, OutputError
from bema_cli.eval.data import jsonl_rows
from bema_cli.output import to_json

RESULTS = "results.jsonl"
SAMPLES = "samples.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    """Every object of a jsonl file; a bad line is an error naming file:line."""
    rows = jsonl_rows(path)
    for number, row in rows:
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number}: expected a JSON object")
    return [row for _, row in rows]


def record_key(record: dict) -> tuple:
    return (record.get("model_path"), record.get("run"), record.get("task"))


def _append(path: Path, objects: list[dict]) -> None:
    try:
        with open(path, "a", encoding="utf-8") as f:
            for obj in objects:
                f.write(to_json(obj, indent=None) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror})") from None


def write_jsonl_atomic(path: Path, objects: list[dict]) -> None:
    """Replace `path` in one rename: readers never see half a file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for obj in objects:
                f.write(to_json(obj, indent=None) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror})") from None


class ResultsFile:
    """OUT/results.jsonl: existing records (for resuming) and appends of new ones."""

    def __init__(self, out_dir: str | Path | None):
        self.path = Path(out_dir) / RESULTS if out_dir is not None else None
        self.records: list[dict] = []
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputError(f"{self.path.parent}: cannot create ({exc.strerror})") from None
            if self.path.is_file():
                self.records = read_jsonl(self.path)

    def find(self, key: tuple) -> dict | None:
        return next((r for r in reversed(self.records) if record_key(r) == key), None)

    def write(self, records: list[dict], replace: bool = False) -> None:
        """Append records; with `replace` (--force) older records with the same keys are dropped."""
        keys = {record_key(r) for r in records}
        if replace and any(record_key(r) in keys for r in self.records):
            self.records = [r for r in self.records if record_key(r) not in keys] + records
            if self.path is not None:
                write_jsonl_atomic(self.path, self.records)
            return
        self.records += records
        if self.path is not None:
            _append(self.path, records)


class SamplesLog:
    """OUT/samples.jsonl (--log-samples): one line per prompt with its responses, answers and gold."""

    def __init__(self, out_dir: str | Path | None, enabled: bool):
        self.path = Path(out_dir) / SAMPLES if (enabled and out_dir is not None) else None

    def write(self, lines: list[dict]) -> None:
        if self.path is not None and lines:
            _append(self.path, lines)


def records_table(records: list[dict], title: str = "bema eval"):
    """A rich Table: one row per record, headline metric with its standard error."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("run", "step", "task", "metric", "value", "stderr", "unparsed", "n", "s"):
        table.add_column(
            column, justify="left" if column in ("run", "task", "metric") else "right", no_wrap=True
        )
    for r in sorted(records, key=lambda r: (str(r.get("run")), r.get("step") or 0, str(r.get("task")))):
        m = r.get("metrics", {})
        metric = "loss" if "loss" in m else "accuracy"
        value, err = m.get(metric), m.get(f"{metric}_stderr")
        run = "base" if r.get("is_base") and r.get("run") is None else str(r.get("run"))
        fail = m.get("parse_failure_rate")
        table.add_row(
            run, str(r.get("step")), str(r.get("task")), metric, _fmt(value), _fmt(err),
            _fmt(fail, 3), str(r.get("n_prompts", "")), _fmt(r.get("seconds"), 1),
        )  # fmt: skip
    return table


def _fmt(value, digits: int = 4) -> str:
    return "" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))
