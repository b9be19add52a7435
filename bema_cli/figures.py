"""Headless matplotlib figures, written atomically; shared by `bema simulate` and `bema report`.

Figures are built on `matplotlib.figure.Figure` with the Agg canvas directly (no pyplot, no
global backend switch), so plotting works without a display and never touches the caller's
matplotlib state. matplotlib is imported here only inside functions: `bema --help` stays instant.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from bema_cli.errors import OutputError, UsageError

DPI = 100  # pixels per inch: a figure of w x h inches is a PNG of (100 w) x (100 h) pixels
FORMATS = (".png", ".pdf", ".svg")


def new_figure(width_in: float, height_in: float) -> Any:
    """A constrained-layout Figure of a fixed size (no tight bbox, so the PNG size is predictable)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")


def check_target(path: str | Path, flag: str) -> Path:
    """Validate an output figure path before any work is done (suffix, existing folder)."""
    target = Path(path)
    if target.suffix.lower() not in FORMATS:
        raise UsageError(f"{flag}: {target} must end in one of {', '.join(FORMATS)}")
    if not target.parent.is_dir():
        raise OutputError(f"{flag}: folder {target.parent} does not exist")
    if target.is_dir():
        raise OutputError(f"{flag}: {target} is a directory")
    return target


def save(fig: Any, path: str | Path, flag: str) -> Path:
    """Write `fig` to `path` through a temp file + rename: never a half-written figure."""
    target = check_target(path, flag)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format=target.suffix[1:].lower(), dpi=DPI)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
