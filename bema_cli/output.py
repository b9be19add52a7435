"""The one place that writes to the terminal.

Data goes to stdout (so `--json` output stays parseable); logs, warnings and
progress go to stderr. Progress bars only appear when stderr is a terminal.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

# Markup off: paths, run names and messages are data ("o[/x]y" is a valid folder name); style goes
# through rich.text.Text or style= instead.
stdout = Console(soft_wrap=True, markup=False)
stderr = Console(stderr=True, soft_wrap=True, markup=False)
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def log(message: str) -> None:
    """An informational line on stderr (suppressed by --quiet)."""
    if not _quiet:
        stderr.print(message, highlight=False)


def warn(message: str) -> None:
    stderr.print(Text("warning:", style="yellow"), message, highlight=False)


def error(message: str) -> None:
    """The one line of a failure (cli.main); newlines in the message are flattened to keep it one line."""
    stderr.print(Text("error:", style="bold red"), " ".join(str(message).split("\n")), highlight=False)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def to_json(obj: Any, indent: int | None = 2) -> str:
    """Strict JSON (no NaN/Infinity literals): inf becomes the string "inf", NaN null."""
    return json.dumps(_jsonable(obj), indent=indent, allow_nan=False, default=str)


def print_json(obj: Any, indent: int | None = 2) -> None:
    """The single machine-readable document of a `--json` run (indent=None: one line), on stdout."""
    sys.stdout.write(to_json(obj, indent) + "\n")
    sys.stdout.flush()


def progress_enabled() -> bool:
    return stderr.is_terminal and not _quiet


@contextmanager
def progress() -> Iterator[Progress]:
    """A rich Progress on stderr, disabled (no output at all) when stderr is not a terminal."""
    bar = Progress(
        TextColumn("{task.description}", style="progress.description", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        disable=not progress_enabled(),
        transient=False,
    )
    with bar:
        yield bar


def track(items: Iterable[Any], description: str, total: int | None = None) -> Iterator[Any]:
    """Iterate with a progress bar on a terminal, silently otherwise."""
    with progress() as bar:
        yield from bar.track(items, description=description, total=total)
