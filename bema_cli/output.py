"""The one place that writes to the terminal.

Data goes to stdout (so `--json` output stays parseable); logs, warnings and
progress go to stderr. Progress bars only appear when stderr is a terminal.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

# Markup off: paths, run names and messages are data ("o[/x]y" is a valid folder name); style goes
# through rich.text.Text or style= instead.
stdout = Console(soft_wrap=True, markup=False)


class ClosedPipe(Exception):
    """stdout's reader went away (`bema ... | head`). Not an OSError: click turns an EPIPE OSError
    into a silent exit 1, and rich does the same; cli.main ends as a tool killed by SIGPIPE (141)."""


def _closed_pipe() -> None:
    raise ClosedPipe()


stdout.on_broken_pipe = _closed_pipe


def _write_stdout(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise ClosedPipe() from None


stderr = Console(stderr=True, soft_wrap=True, markup=False)
_quiet = False
_verbose = False
_real_stderr: int | None = None  # the terminal's stderr, once send_library_output moved fd 2 away


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def set_verbose(verbose: bool) -> None:
    global _verbose
    _verbose = verbose


def verbose() -> bool:
    return _verbose


_debug = False  # `bema --debug`: tracebacks, and the engine's own log on stderr (cli.py sets it)


def set_debug(debug: bool) -> None:
    global _debug
    _debug = debug


def debug() -> bool:
    return _debug


def send_library_output(path: str | Path | None) -> None:
    """From now on, what libraries write to file descriptor 2 (C++ warnings, Python warnings, prints,
    their loggers, a nanobind leak report at exit) goes to `path` (appended; None: nowhere), while
    bema's own lines keep the real stderr. Left in place until the process ends, so nothing they
    print at interpreter teardown reaches the terminal either. With -v (or --debug) it does nothing.
    """
    global _real_stderr, _library_log
    if _verbose or _real_stderr is not None:
        return
    sys.stderr.flush()
    _real_stderr = os.dup(2)
    stderr.file = os.fdopen(_real_stderr, "w", encoding="utf-8", errors="replace", buffering=1)
    if path is not None:
        made = [p for p in reversed(Path(path).parents) if not p.exists()]  # the folders made for the log
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _library_log = (Path(path), made) if not Path(path).exists() else None
    target = os.open(os.devnull if path is None else path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 2)
    os.close(target)


_library_log: tuple[Path, list[Path]] | None = None  # a log send_library_output created, and its folders


def drop_empty_library_log() -> None:
    """A failed command leaves no trace of its library log when the libraries said nothing: the
    empty log it created goes, and the folders made for it if nothing else landed there."""
    if _library_log is None:
        return
    log, made = _library_log
    try:
        if log.is_file() and log.stat().st_size == 0:
            log.unlink()
        for folder in reversed(made):
            folder.rmdir()  # only when empty
    except OSError:
        pass


def size(n: int) -> str:
    """Bytes as people write a size, in binary units: 2147483648 -> '2 GiB' (--max-memory reads it back)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def log(message: str) -> None:
    """An informational line on stderr (suppressed by --quiet)."""
    if not _quiet and not _muted:
        stderr.print(message, highlight=False)


def warn(message: str) -> None:
    if not _muted:
        stderr.print(Text("warning:", style="yellow"), message, highlight=False)


_muted = False


@contextmanager
def muted() -> Iterator[None]:
    """No log line or warning from work done again to check it (verify's rebuild by stabilize in a
    temporary folder): they were said when the output was made, and would name the temporary folder."""
    global _muted
    before, _muted = _muted, True
    try:
        yield
    finally:
        _muted = before


_said: set[str] = set()


def warn_once(message: str) -> None:
    """A warning said once per command, however often the code that finds it runs (ship plans the
    run's inputs twice: for the menu and for the sweep)."""
    if message not in _said and not _muted:
        _said.add(message)
        warn(message)


def error(message: str) -> None:
    """The one line of a failure (cli.main); newlines in the message are flattened to keep it one line."""
    stderr.print(Text("error:", style="bold red"), " ".join(str(message).split("\n")), highlight=False)


def _jsonable(obj: Any, inf_as_text: bool = True) -> Any:
    """NaN -> null; inf -> "inf"/"-inf" (bema's files) or null (a --json document: numbers only)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return ("inf" if obj > 0 else "-inf") if inf_as_text and not math.isnan(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, inf_as_text) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, inf_as_text) for v in obj]
    return obj


def to_json(obj: Any, indent: int | None = 2) -> str:
    """Strict JSON (no NaN/Infinity literals) for bema's files: inf becomes the string "inf" (eta = inf
    names the EMA in bema.json and state.json), NaN null."""
    return json.dumps(_jsonable(obj), indent=indent, allow_nan=False, default=str)


def print_json(obj: Any, indent: int | None = 2) -> None:
    """The single machine-readable document of a `--json` run (indent=None: one line), on stdout.
    A number is a JSON number or null (inf and NaN: null), never a string."""
    _write_stdout(
        json.dumps(_jsonable(obj, inf_as_text=False), indent=indent, allow_nan=False, default=str) + "\n"
    )


# -- tables: a number, a run name or a path is never cut -----------------------------------------
MIN_TEXT_WIDTH = 12  # a left-aligned text column (run, path) folds onto more lines down to this width


def _cell_texts(table) -> list[list[str]]:
    """Each column's header and cells as plain strings."""
    return [
        [str(col.header), *(c.plain if isinstance(c, Text) else str(c) for c in col.cells)]
        for col in table.columns
    ]


def plain_table(table) -> str:
    """Complete aligned text (title, header, rows, caption): what a pipe gets, at any width."""
    texts = _cell_texts(table)
    widths = [max(map(len, col)) for col in texts]
    lines = [str(table.title)] if table.title else []
    for row in range(len(texts[0]) if texts else 0):
        cells = [
            texts[i][row].ljust(w) if table.columns[i].justify == "left" else texts[i][row].rjust(w)
            for i, w in enumerate(widths)
        ]
        lines.append("  ".join(cells).rstrip())
        if row == 0:
            lines.append("  ".join("-" * w for w in widths))
    if table.caption:
        lines.append(str(table.caption))
    return "\n".join(lines) + "\n\n"  # a blank line between tables


def _fit(table, width: int) -> None:
    """Make `table` fit `width` columns without cutting a value: right-aligned (number) columns keep
    their width, text columns fold onto more lines; where even that is too wide, the rightmost
    columns are left out and the caption says which (a pipe and --json have every column)."""
    texts = _cell_texts(table)
    natural = [max(len(x) for x in col) for col in texts]
    for col, w in zip(table.columns, natural, strict=True):
        col.no_wrap, col.overflow, col.width = True, "fold", w
    if sum(natural) + _frame(len(natural), table.show_edge) <= width:
        return
    table.show_edge = table.pad_edge = False  # the outer edges are the first room given back
    text = [i for i, col in enumerate(table.columns) if col.justify == "left"]
    floor = [min(w, MIN_TEXT_WIDTH) if i in text else w for i, w in enumerate(natural)]
    dropped = []
    while len(floor) > 1 and sum(floor) + _frame(len(floor), False) > width:
        dropped.insert(0, str(table.columns[-1].header))
        table.columns.pop()
        floor.pop()
        natural.pop()
        text = [i for i in text if i < len(floor)]
    spare = width - (sum(floor) + _frame(len(floor), False))
    for i in text:  # share the room left among the text columns, each up to its natural width
        grow = min(natural[i] - floor[i], spare)
        floor[i] += grow
        spare -= grow
    for i, col in enumerate(table.columns):
        col.width, col.no_wrap = floor[i], i not in text
    if dropped:
        note = f"not shown (terminal too narrow): {', '.join(dropped)}; a pipe or --json has every column"
        table.caption = f"{table.caption}; {note}" if table.caption else note


def _frame(columns: int, edges: bool) -> int:
    """A rich table's width beyond its cells: a padding of 1 on each side of every cell, a divider
    between columns, and with `edges` an edge at each side (else no outer edge nor outer padding)."""
    return 2 * columns + (columns - 1) + (2 if edges else -2)


def print_table(table) -> None:
    """A rich Table on stdout: fitted to a terminal (values folded, never cut), plain text in a pipe."""
    if stdout.is_terminal:
        _fit(table, stdout.width)
        stdout.print(table)
    else:
        _write_stdout(plain_table(table))


def progress_enabled() -> bool:
    return stderr.is_terminal and not _quiet


@contextmanager
def progress(unit: str = "") -> Iterator[Progress]:
    """A rich Progress on stderr, disabled (no output at all) when stderr is not a terminal.
    `unit` says what is counted: "bytes" shows sizes and a rate (12.3/250.0 MB, 80 MB/s), any
    other word follows the count ("3/40 modules")."""
    counted = (
        [DownloadColumn(), TransferSpeedColumn()]
        if unit == "bytes"
        else [MofNCompleteColumn(), TextColumn(unit, markup=False)]
    )
    bar = Progress(
        TextColumn("{task.description}", style="progress.description", markup=False),
        BarColumn(),
        *counted,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        disable=not progress_enabled(),
        transient=False,
    )
    with bar:
        yield bar


_countdown: list = []  # the countdown `step` lines belong to (innermost last)


@contextmanager
def countdown(total: int, unit: str) -> Iterator[None]:
    """Work of `total` units announced one by one with `step(line)`: on a terminal a rich bar (count,
    time left) under the lines; in a pipe each line starts with its count, and from the second on
    ends with the time left at the pace so far: `[37/61] gsm8k: ckpt (run@400)  ETA 9 min`."""
    with progress(unit) as bar:  # the pace counts from the first unit on (not an engine's start)
        state = {"done": 0, "total": total, "bar": bar, "task": bar.add_task(unit, total=total), "t0": None}
        _countdown.append(state)
        try:
            yield
        finally:
            bar.update(state["task"], completed=state["done"])
            _countdown.remove(state)


def step(line: str) -> None:
    """One unit of the innermost countdown starts: its line (counted, with the time left in a pipe)
    and a bar that moves on a terminal; a plain `log` line outside any countdown."""
    if not _countdown:
        return log(line)
    state = _countdown[-1]
    done, total = state["done"], state["total"]
    state["done"] = done + 1
    state["t0"] = state["t0"] or time.perf_counter()
    if progress_enabled():
        state["bar"].update(state["task"], completed=done)
        return log(line)
    left = ""
    if done:
        seconds = (time.perf_counter() - state["t0"]) / done * (total - done)
        left = f"  ETA {duration(seconds)}"
    log(f"[{done + 1}/{total}] {line}{left}")


def duration(seconds: float) -> str:
    """A time left as people say it: 42 s, 9 min, 1.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def track(items: Iterable[Any], description: str, total: int | None = None, unit: str = "") -> Iterator[Any]:
    """Iterate with a progress bar on a terminal, silently otherwise."""
    with progress(unit) as bar:
        yield from bar.track(items, description=description, total=total)
