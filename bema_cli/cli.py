"""The `bema` command line: thin typer commands that parse, delegate and print.

Each command group lives in `bema_cli/commands/<group>.py`; this file only wires
them into one app and maps errors to one-line messages and exit codes.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated

import typer

from bema_cli import __version__, output
from bema_cli.commands import demo, evaluate, report, simulate, stabilize
from bema_cli.errors import BemaError

app = typer.Typer(
    name="bema",
    help="Make fine-tuned language models better after training: BEMA/EMA-stabilize checkpoints, evaluate, report.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_debug = os.environ.get("BEMA_DEBUG", "") not in ("", "0")


def _version(value: bool) -> None:
    if value:
        print(f"bema {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks on errors.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only errors on stderr.")] = False,
) -> None:
    global _debug
    _debug = _debug or debug
    output.set_quiet(quiet)


app.command("stabilize")(stabilize.stabilize)
app.command("simulate")(simulate.simulate)
app.command("eval")(evaluate.evaluate)
app.command("rescore")(evaluate.rescore)
app.command("report")(report.report)
app.command("demo")(demo.demo)


def main() -> None:
    """Console-script entry point: run the app, turn failures into one line + exit code."""
    try:
        app()
    except BemaError as exc:
        if _debug:
            traceback.print_exc()
        output.error(str(exc))
        sys.exit(exc.exit_code)
    except OSError as exc:  # unwritable output, full disk, ...: still one line
        if _debug:
            traceback.print_exc()
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        output.error(f"{exc.strerror or exc}{where}")
        sys.exit(1)
    except Exception as exc:  # a bug: say so briefly, keep the traceback behind --debug
        if _debug:
            traceback.print_exc()
        output.error(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)")
        sys.exit(70)


if __name__ == "__main__":
    main()
