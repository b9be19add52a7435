"""`bema env`: what a bug report needs, as `accelerate env` and `hf env` print it."""

from __future__ import annotations

from bema_cli import output
from bema_cli.machine import environment
from bema_cli.options import JsonOpt


def env(json: JsonOpt = False) -> None:
    """Print bema's, Python's and the libraries' versions, the device and the memory (for bug reports)."""
    doc = environment()
    if json:
        output.print_json(doc)
        return
    for key, value in doc.items():
        if key in ("memory_total", "memory_available"):
            value = output.size(value)
        elif key == "gpus":
            value = ", ".join(f"{g['name']} ({output.size(g['memory'])})" for g in value) or "none"
        output.stdout.print(
            f"- {key}: {value if value is not None else 'not installed'}", highlight=False, markup=False
        )


def version(json: JsonOpt = False) -> None:
    """Print bema's version (as `bema --version`; `bema env` gives the libraries' too)."""
    from bema_cli import __version__

    if json:
        output.print_json({"bema": __version__})
    else:
        output.stdout.print(f"bema {__version__}", highlight=False, markup=False)
