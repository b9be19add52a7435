"""The `bema` command line: thin typer commands that parse, delegate and print.

Each command group lives in `bema_cli/commands/<group>.py`; this file only wires
them into one app and maps errors to one-line messages and exit codes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import re
import signal
import sys
import traceback

import typer
import typer._click.exceptions as click  # typer's own copy of click's exception classes

from bema_cli import __version__, output, signals
from bema_cli.commands import (
    demo,
    env,
    evaluate,
    push,
    report,
    select,
    ship,
    simulate,
    stabilize,
    sweep,
    verify,
)
from bema_cli.errors import BemaError
from bema_cli.options import option

app = typer.Typer(
    name="bema",
    help="Make fine-tuned language models better after training: BEMA/EMA-stabilize checkpoints, evaluate, report.",
    epilog=(
        "Exit codes: 0 ok; 1 other failure; 2 bad flags; 3 bad input file; 4 output exists, overlaps an input, "
        "is locked by another bema process or cannot be written; 5 backend failure; 70 internal error (a bug); "
        "130/143/129 interrupted by SIGINT/SIGTERM/SIGHUP; 141 stdout closed by its reader."
    ),
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # -h as hf, lm-eval and vLLM take it
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
    version: option(
        bool, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ) = False,
    debug: option(bool, "--debug", help="Show Python tracebacks on errors.") = False,
    quiet: option(bool, "--quiet", "-q", help="Only errors on stderr.") = False,
    verbose: option(
        bool,
        "--verbose",
        "-v",
        help="Also show the libraries' own output (vLLM, transformers, lm-eval) on stderr.",
    ) = False,
) -> None:
    global _debug
    _debug = _debug or debug
    output.set_quiet(quiet)
    output.set_verbose(verbose or _debug)
    output.set_debug(_debug)


# in the order a user meets them: try it, average, judge, pick, ship, then the tools around them
COMMANDS = {
    "demo": demo.demo,
    "stabilize": stabilize.stabilize,
    "eval": evaluate.evaluate,
    "sweep": sweep.sweep,
    "select": select.select,
    "ship": ship.ship,
    "push": push.push,
    "report": report.report,
    "rescore": evaluate.rescore,
    "simulate": simulate.simulate,
    "env": env.env,
    "version": env.version,
    "verify": verify.verify,
}
for _name, _command in COMMANDS.items():
    app.command(_name)(_command)


_KINDS = {"int_parsing": "an integer", "float_parsing": "a number", "bool_parsing": "true or false"}


def _flag(param) -> str:
    if param.param_type_name == "argument" or not param.opts:
        return (param.name or "").upper()
    return param.opts[0]


def _usage_line(exc: click.UsageError) -> str:
    """A typer usage error as one line: 'FLAG: problem (see bema CMD --help)'."""
    message = exc.message
    cause = exc.__cause__
    if hasattr(cause, "errors"):  # typer coerces values with pydantic: name the value and the kind
        first = cause.errors()[0]
        kind = _KINDS.get(first.get("type"))
        message = (
            f"{first.get('input')!r} is not {kind}" if kind else f"{first.get('input')!r}: {first.get('msg')}"
        )
    hint = OTHER_TOOLS_FLAGS.get(getattr(exc, "option_name", None) or "")
    if isinstance(exc, click.MissingParameter) and exc.param is not None:
        message = f"missing {exc.param.param_type_name} {_flag(exc.param)}"
    elif not isinstance(exc, click.BadParameter):
        message = exc.format_message()
        message = message[:1].lower() + message[1:]  # "No such option: --x" -> "no such option: --x"
    elif exc.param is not None:
        message = f"{_flag(exc.param)}: {message}"
    message = " ".join(line.strip() for line in message.splitlines() if line.strip()).rstrip(".")
    command = exc.ctx.command_path if exc.ctx is not None else "bema"
    if command == "bema":  # some parse errors carry the group's context: name the subcommand if one was given
        given = [a for a in sys.argv[1:] if a in {c.name for c in app.registered_commands}]
        command = f"bema {given[0]}" if given else command
    if hint:
        message += f" ({hint})"
    return f"{message} (see {command} --help)"


# flags of the tools a user comes from (the HF Trainer's --output_dir, lm-eval's --output_path)
OTHER_TOOLS_FLAGS = {
    flag: "bema's flag for the output folder is --out"
    for flag in ("--output_dir", "--output-dir", "--output_path", "--output-path")
}


def _skip_final_collection() -> None:
    """torch's ~10^5 objects make the interpreter's final garbage collection cost ~0.4 s at every exit;
    frozen objects are skipped by it (atexit handlers run first-registered last, i.e. after all others).
    Not after vLLM or triton (which torch imports for training): their nanobind extensions then
    report every object left alive as a leak on stderr, after bema's own last line."""
    if not any(name in sys.modules for name in ("vllm", "triton")):
        gc.freeze()


def reflow(text: str | None) -> str | None:
    """A docstring's paragraphs as single lines (rich keeps a docstring's line breaks, which then fall
    mid-sentence in the terminal); blank lines still separate paragraphs."""
    if not text:
        return text
    out = []
    for paragraph in text.strip().split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            line = line.strip()
            if lines and not LIST_ITEM.match(line):  # a list item keeps its own line
                lines[-1] += " " + line
            elif line:
                lines.append(line)
        out.append("\n".join(lines))
    return "\n\n".join(p for p in out if p)


LIST_ITEM = re.compile(r"^(?:[-*]|\d+(?:-\d+)?[.)])\s")


def command():
    """The click command typer builds from `app`, with help that reads as the usage: a flag shows no
    `<bool>` value, an argument is named in capitals (CHECKPOINT_DIR, not {checkpoint_dir})."""
    built = typer.main.get_command(app)
    for sub in [built, *getattr(built, "commands", {}).values()]:
        sub.help = reflow(sub.help)
        for param in sub.params:
            if getattr(param, "is_flag", False):
                param.metavar = ""
            elif param.param_type_name == "argument":
                param.metavar = (param.name or "").upper()
    return built


GLOBAL_FLAGS = ("--debug", "--quiet", "-q", "--verbose", "-v")  # no command has a flag of these names


def hoist_global_flags(args: list[str]) -> list[str]:
    """`bema stabilize ... --debug` as `bema --debug stabilize ...`: the global flags (which take no
    value) are accepted after the subcommand too, up to a `--`."""
    end = args.index("--") if "--" in args else len(args)
    command = next((i for i, a in enumerate(args[:end]) if not a.startswith("-")), end)
    moved = [a for a in args[command:end] if a in GLOBAL_FLAGS]
    kept = [a for a in args[command:end] if a not in GLOBAL_FLAGS]
    return args[:command] + moved + kept + args[end:]


def _closed_pipe_is_sigpipe() -> None:
    """rich ends the process with exit 1 when stdout's reader goes away (`bema --help | head`, typer's
    help is printed by rich): raise BrokenPipeError instead, which main turns into 141, as for data."""
    import rich.console

    def closed(self) -> None:
        raise BrokenPipeError

    rich.console.Console.on_broken_pipe = closed


def main() -> None:
    """Console-script entry point: run the app, turn failures into one line + exit code (docs: README)."""
    signals.install()
    atexit.register(_skip_final_collection)
    sys.argv[1:] = hoist_global_flags(sys.argv[1:])
    _closed_pipe_is_sigpipe()
    if not sys.argv[1:]:  # bare `bema`: the usage goes to stderr (stdout is for data), exit 2
        with contextlib.redirect_stdout(sys.stderr):
            command()(["--help"], standalone_mode=False, prog_name="bema")
        sys.exit(2)
    try:
        code = command()(standalone_mode=False, prog_name="bema")
    except click.NoArgsIsHelpError:  # its help text was printed while it was raised
        sys.exit(2)
    except click.UsageError as exc:
        if _debug:
            traceback.print_exc()
        _fail(_usage_line(exc), exc.exit_code)
    except typer.Abort:
        output.error("aborted")
        sys.exit(1)
    except (output.ClosedPipe, BrokenPipeError):  # `bema ... | head`: end quietly as a SIGPIPE'd tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        sys.exit(128 + signal.SIGPIPE)
    except (signals.Terminated, KeyboardInterrupt) as exc:
        if _debug:
            traceback.print_exc()
        _exit_interrupted(exc.signum if isinstance(exc, signals.Terminated) else signal.SIGINT)
    except Exception as exc:
        if _debug:
            traceback.print_exc()
        if signals.received() is not None:  # the signal's exception surfaced as another type
            _exit_interrupted(signals.received())
        if isinstance(exc, BemaError):
            _fail(str(exc), exc.exit_code, getattr(exc, "document", None))
        if isinstance(exc, OSError):  # unwritable output, full disk, ...: still one line
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            _fail(f"{exc.strerror or exc}{where}", 1)
        # a bug: say so briefly, keep the traceback behind --debug
        _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 70)
    sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int, document: dict | None = None) -> None:
    """The one error line on stderr, and under --json also one JSON document on stdout, so a
    pipeline into `jq` sees the failure (and its exit code) instead of an empty input; with the
    work's own document when the failure came after it (a ship whose push was refused)."""
    output.error(message)
    output.drop_empty_library_log()
    from bema_cli.io.commit import remove_empty_made

    remove_empty_made()  # an OUT made for a command that wrote nothing there
    if "--json" in sys.argv[1:]:
        try:
            print(
                output.to_json({**(document or {}), "error": message, "exit_code": code}, indent=None),
                flush=True,
            )
        except (BrokenPipeError, OSError):
            pass
    sys.exit(code)


def _exit_interrupted(signum: int) -> None:
    """Exit 128 + signum with the one error line, and under --json its JSON document, as any error."""
    _fail(f"interrupted by {signal.Signals(signum).name}; nothing half-written was kept", 128 + signum)


if __name__ == "__main__":
    main()
