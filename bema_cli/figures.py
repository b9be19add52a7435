"""Headless matplotlib figures, written atomically; shared by `bema simulate` and `bema report`.

Figures are built on `matplotlib.figure.Figure` with the Agg canvas directly (no pyplot, no
global backend switch), so plotting works without a display and never touches the caller's
matplotlib state. matplotlib is imported here only inside functions: `bema --help` stays instant.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from bema_cli.errors import OutputError, UsageError
from bema_cli.io import modes

DPI = 100  # pixels per inch: a figure of w x h inches is a PNG of (100 w) x (100 h) pixels

# One colour per run in every figure bema draws (report, simulate, demo): a run's method family
# picks the hue, and a run of that family with its own hyperparameters (bema-k0.5-e0.3) a shade
# fixed by its name. vanilla is black and dashed everywhere.
FAMILY_COLORS = {
    "vanilla": ("black", None),
    "ema": ("tab:blue", "Blues"),
    "bema": ("tab:red", "Reds"),
    "dema": ("tab:green", "Greens"),
    "ouema": ("tab:purple", "Purples"),
    "mle": ("tab:orange", "Oranges"),
    "power": ("darkgoldenrod", "YlOrBr"),
    # the window family (merges of saved checkpoints): dash-dot lines, square markers (run_style)
    "lawa": ("tab:brown", "copper"),
    "wsm": ("tab:olive", "YlGn"),
    "swa": ("tab:pink", "RdPu"),
}
WINDOW_FAMILY = ("lawa", "wsm", "swa")
OTHER_COLORS = "Greys"  # a run name of no known family: a shade of grey fixed by its name


def family(run: str) -> str:
    """'bema-k0.5-e0.2' / 'bema_k0.5' / 'bema' -> 'bema'."""
    return re.split(r"[-_@ ]", str(run), maxsplit=1)[0].lower()


SHADES = (0.95, 0.45, 0.8, 0.6, 0.7, 0.5, 0.88)  # well-separated levels of a family's colormap
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def _pick(run: str, salt: str, n: int) -> int:
    """A stable index in [0, n) from the run's name (sha256: the same in every process)."""
    return int.from_bytes(hashlib.sha256(f"{salt}:{run}".encode()).digest()[:4], "big") % n


def run_color(run: str):
    """The colour of `run` in every figure: its family's colour for the family's plain name, else a
    shade of the family's colormap picked from the full name (two runs of one family differ in
    shade or marker, run_style, unless 1 pair in 49 collides in both)."""
    from matplotlib import colormaps

    plain, shades = FAMILY_COLORS.get(family(run), (None, OTHER_COLORS))
    if run == family(run) and plain is not None or shades is None:
        return plain
    return colormaps[shades](SHADES[_pick(run, "shade", len(SHADES))])


def run_style(run: str) -> dict:
    """matplotlib keyword arguments of a run's line: its colour and marker, dashed for vanilla,
    dash-dot for the window family (lawa, wsm, swa) so it stands apart from the EMA family."""
    plain = run == family(run)
    ls = "--" if family(run) == "vanilla" else "-." if family(run) in WINDOW_FAMILY else "-"
    return {
        "color": run_color(run),
        "ls": ls,
        "marker": "o" if plain else MARKERS[_pick(run, "marker", len(MARKERS))],
    }


_LABELS = (  # run-name patterns of `bema stabilize` -> what a legend says about them
    (r"lawa-w(\d+)", "LAWA: mean of the last {0}"),
    (r"wsm-(\w+?)(_reverse)?-w(\d+)", "WSM {0}{1}: last {2}"),
    (r"swa-s(\d+)", "SWA from step {0}"),
    (r"swa", "SWA from the first step"),
    (r"power-sr(.+)", "power EMA, sigma_rel {0}"),
    (r"power-g(.+)", "power EMA, gamma {0}"),
)


def run_label(run: str) -> str:
    """A legend entry: the run's name, and for the window and power runs what the name means."""
    for pattern, text in _LABELS:
        m = re.fullmatch(pattern, str(run))
        if m:
            parts = [(g or "").replace("_reverse", " reversed").replace("_", "-") for g in m.groups()]
            return f"{run} ({text.format(*parts)})"
    return str(run)


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
    fd, tmp = modes.mkstemp(target.parent, prefix=f".{target.name}.", suffix=target.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, format=target.suffix[1:].lower(), dpi=DPI)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
