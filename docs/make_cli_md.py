"""Write docs/cli.md: every command's usage and flags, from the CLI itself (so it cannot drift;
tests/test_readme.py checks that the file equals this script's output).

    .venv/bin/python docs/make_cli_md.py > docs/cli.md
"""

from __future__ import annotations

from bema_cli.cli import command

HEADER = """# bema command reference

Every command and flag, generated from the CLI (`python docs/make_cli_md.py > docs/cli.md`).
Global flags (`--debug`, `-q/--quiet`, `-v/--verbose`) go anywhere on the line. Exit codes
are listed at the end. For what the commands are for, start with the [README](../README.md).
"""


def flag_row(param) -> str:
    names = ", ".join(f"`{n}`" for n in [*param.opts, *param.secondary_opts])
    kind = getattr(getattr(param, "type", None), "name", "") or "value"
    kind = "flag" if getattr(param, "is_flag", False) else kind
    default = param.default
    shown = "" if default in (None, False, (), []) or callable(default) else f"`{default}`"
    text = " ".join((getattr(param, "help", None) or "").split()).replace("|", "\\|")
    if getattr(param, "required", False):
        text = "**required.** " + text
    return f"| {names} | {kind} | {shown} | {text} |"


def main() -> None:
    root = command()
    print(HEADER)
    for name, cmd in root.commands.items():
        print(f"\n## bema {name}\n")
        print((cmd.help or "").strip() + "\n")
        args = [p for p in cmd.params if p.param_type_name == "argument"]
        usage = " ".join(p.name.upper() + ("..." if p.nargs != 1 else "") for p in args)
        print(f"```\nbema {name} [OPTIONS] {usage}\n```\n")
        print("| flag | type | default | what it does |\n|---|---|---|---|")
        for p in cmd.params:
            if p.param_type_name == "option" and p.name != "help":
                print(flag_row(p))
    print("\n## Exit codes\n")
    print(" ".join((root.epilog or "").split()))


if __name__ == "__main__":
    main()
