"""Files of `bema eval`: results.jsonl (one record per (checkpoint, run, task)) and samples.jsonl.

Both are appended line by line and flushed, so an error or interrupt keeps every result
already computed; that is also what makes `bema eval` resumable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bema_cli.errors import InputError, OutputError
from bema_cli.eval.data import jsonl_rows
from bema_cli.io import modes
from bema_cli.io.commit import write_synced
from bema_cli.output import to_json, warn

RESULTS = "results.jsonl"
SAMPLES = "samples.jsonl"


def read_jsonl(path: Path, skip_torn: bool = False) -> list[dict]:
    """Every object of a jsonl file; a bad line is an error naming file:line.

    With `skip_torn`, a torn final line (see `torn_tail`) is skipped with a warning instead.
    """
    torn = torn_tail(path) if skip_torn else None
    if torn is not None:
        warn(f"{path}:{torn[0]}: skipped a torn final line (a crash in the middle of a write)")
    rows = jsonl_rows(path, end=None if torn is None else torn[0])
    for number, row in rows:
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number}: expected a JSON object")
    return [row for _, row in rows]


def torn_tail(path: Path) -> tuple[int, int] | None:
    """(line number, byte offset) of a torn final line: no newline at the end and not valid JSON.

    That is what a crash in the middle of an append leaves; every other bad line stays an error.
    """
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if not data or data.endswith(b"\n"):
        return None
    start = data.rfind(b"\n") + 1
    try:
        json.loads(data[start:])
        return None
    except (ValueError, RecursionError):
        return data.count(b"\n") + 1, start


def cut_torn_tail(path: Path) -> None:
    """Before appending to a file again: cut off a torn final line (with a warning), end it with a newline."""
    torn = torn_tail(path)
    try:
        if torn is not None:
            warn(f"{path}:{torn[0]}: cut off a torn final line (a crash in the middle of a write)")
            os.truncate(path, torn[1])
        elif path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n")
    except OSError as exc:
        raise OutputError(f"{path}: cannot repair ({exc.strerror})") from None


def record_key(record: dict) -> tuple:
    return (record.get("model_path"), record.get("run"), record.get("task"))


def _append(path: Path, objects: list[dict]) -> bytes:
    data = "".join(to_json(obj, indent=None) + "\n" for obj in objects).encode()
    write_synced(path, data, mode="ab")
    return data


# The results files this process reads and writes, with a running digest of the bytes it knows them
# to hold: a line another process appends meanwhile is caught before the records are sealed
# (`unchanged`), never sealed as bema's.
_KNOWN: dict[Path, object] = {}


def _know(path: Path, data: bytes, reset: bool = False) -> None:
    import xxhash

    key = path.resolve()
    if reset or key not in _KNOWN:
        _KNOWN[key] = xxhash.xxh3_128()
    _KNOWN[key].update(data)


def unchanged(path: Path) -> bool | None:
    """Whether `path` holds exactly the bytes this process read there and wrote (None: not one of its
    results files)."""
    from bema_cli.io.fingerprint import file_digest

    known = _KNOWN.get(Path(path).resolve())
    return None if known is None else file_digest(path) == known.hexdigest()


def write_jsonl_atomic(path: Path, objects: list[dict]) -> None:
    """Replace `path` in one rename: readers never see half a file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = modes.mkstemp(path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for obj in objects:
                f.write(to_json(obj, indent=None) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror})") from None


def _named(record: dict, out_dir) -> dict:
    """A record of an older bema named its model by an absolute path: read under today's name for it
    (provenance.input_name), so that it still counts when the run resumes."""
    from bema_cli.io.provenance import input_name

    path = record.get("model_path")
    if isinstance(path, str) and Path(path).is_absolute():
        return {**record, "model_path": input_name(path, out_dir)}
    return record


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
                cut_torn_tail(self.path)
                _know(self.path, self.path.read_bytes(), reset=True)
                self.records = [_named(r, out_dir) for r in read_jsonl(self.path)]
            else:
                _know(self.path, b"", reset=True)

    def rehome(self, name: str, weights: str) -> None:
        """Records of the model `name` made while OUT (or the model) sat elsewhere name it by a longer or
        shorter tail of its path (provenance.input_name is relative to the folder both share): with
        the same weights, they are this model's, renamed in place (the file rewritten at once)."""
        from bema_cli.io.provenance import same_tail

        moved = [
            i
            for i, r in enumerate(self.records)
            if r.get("model_path") != name
            and same_tail(r.get("model_path"), name)
            and (r.get("resume_key") or {}).get("weights") == weights
        ]
        for i in moved:
            self.records[i] = {**self.records[i], "model_path": name}
        if moved and self.path is not None:
            write_jsonl_atomic(self.path, self.records)
            _know(self.path, self.path.read_bytes(), reset=True)

    def find(self, key: tuple) -> dict | None:
        return next((r for r in reversed(self.records) if record_key(r) == key), None)

    def write(self, records: list[dict], replace: bool = False) -> None:
        """Append records; with `replace` (--force) older records with the same keys are dropped."""
        keys = {record_key(r) for r in records}
        if replace and any(record_key(r) in keys for r in self.records):
            self.records = [r for r in self.records if record_key(r) not in keys] + records
            if self.path is not None:
                write_jsonl_atomic(self.path, self.records)
                _know(self.path, self.path.read_bytes(), reset=True)
            return
        self.records += records
        if self.path is not None:
            _know(self.path, _append(self.path, records))


class SamplesLog:
    """OUT/samples.jsonl (--log-samples): one line per prompt with its responses, answers and gold."""

    def __init__(self, out_dir: str | Path | None, enabled: bool):
        self.path = Path(out_dir) / SAMPLES if (enabled and out_dir is not None) else None
        if self.path is not None and self.path.is_file():
            cut_torn_tail(self.path)

    def write(self, lines: list[dict]) -> None:
        if self.path is not None and lines:
            _append(self.path, lines)


def records_table(records: list[dict], title: str = "bema eval"):
    """A rich Table: one row per record; accuracies strict and flexible (± stderr, unparsed share), or loss."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("run", "step", "task", "metric", "value", "stderr", "unparsed", "n", "s"):
        table.add_column(
            column, justify="left" if column in ("run", "task", "metric") else "right", no_wrap=True
        )
    for r in sorted(records, key=lambda r: (str(r.get("run")), r.get("step") or 0, str(r.get("task")))):
        m = r.get("metrics", {})
        run = "base" if r.get("is_base") and r.get("run") is None else str(r.get("run"))
        for metric in [k for k in m if f"{k}_stderr" in m] or list(m)[:1]:
            fail = m.get(metric.replace("accuracy", "parse_failure_rate")) if "accuracy" in metric else None
            table.add_row(
                run,
                _fmt(r.get("step")),
                str(r.get("task")),
                metric,
                _fmt(m.get(metric)),
                _fmt(m.get(f"{metric}_stderr")),
                _fmt(fail, 3),
                str(r.get("n_prompts", "")),
                _fmt(r.get("seconds"), 1),
            )
    return table


def _fmt(value, digits: int = 4) -> str:
    return "" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))
