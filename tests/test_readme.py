"""The README's commands are real: every `bema` flag it shows exists, its make targets exist, its
Python compiles, and the CPU block runs for real against a quick demo's outputs. The same marked
blocks in docs/*.md (the reference moved there) are checked the same way; every relative link of
the README and docs resolves.

Blocks are marked in the README with an HTML comment just above the fence:
`<!-- readme-test: run -->` (executed, slow), `help` (flags checked against `--help`; GPU/Hub/SLURM
commands), `make` (each `make X` checked with `make -n X`), `compile` (Python, compiled).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from conftest import BEMA, run_bema

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- readme-test: (\w+) -->\s*\n```(\w*)\n(.*?)\n```", re.S)


def blocks(kind: str) -> list[str]:
    """The blocks marked `kind`, in the README then docs/*.md."""
    return [body for page in PAGES for k, _, body in BLOCK.findall(page.read_text()) if k == kind]


def commands(body: str) -> list[str]:
    """Logical shell lines of a block: continuations joined, comments and blanks dropped."""
    text = body.replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def bema_invocations(line: str) -> list[list[str]]:
    """Every `bema ...` inside a shell line (also inside `--wrap "..."`, after `&&`, `|`, `;`, `do`)."""
    found = []
    for segment in re.split(r"&&|\|\||[|;\"]|\$\(|\)|\bdo\b", line):
        segment = segment.strip()
        if segment.startswith("bema "):
            found.append(shlex.split(segment.split(" #")[0]))
    return found


@cache
def help_text(subcommand: str | None) -> str:
    args = [subcommand, "--help"] if subcommand else ["--help"]
    result = run_bema(*args, env={"COLUMNS": "250", "TERM": "dumb"})
    assert result.returncode == 0, f"bema {subcommand} --help failed: {result.stderr}"
    return result.stdout


def has_flag(help_output: str, flag: str) -> bool:
    """`flag` appears whole: "--out" is not found in "--out-dtype" (nor "--dtype" in "--out-dtype")."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_output) is not None


def check_flags(tokens: list[str]) -> None:
    """`bema [global flags] SUB [args/flags]`: the subcommand and every --flag exist."""
    i = 1
    while i < len(tokens) and tokens[i].startswith("-"):
        assert has_flag(help_text(None), tokens[i]), f"global flag {tokens[i]} not in `bema --help`"
        i += 1
    sub = tokens[i]
    assert re.search(rf"^\W*{sub}\s", help_text(None), re.M), f"no command `bema {sub}`"
    for token in tokens[i + 1 :]:
        if token.startswith("--"):
            flag = token.split("=")[0]
            assert has_flag(help_text(sub), flag), f"`bema {sub}` has no flag {flag}"


def all_bema_lines() -> list[list[str]]:
    found = []
    for kind in ("run", "help"):
        for body in blocks(kind):
            for line in commands(body):
                found += bema_invocations(line)
    return found


def test_readme_has_the_marked_blocks():
    assert blocks("run") and blocks("help") and blocks("make") and blocks("compile")
    subs = {tokens[1] for tokens in all_bema_lines()}
    assert {"stabilize", "eval", "report"} <= subs  # the pipeline is documented end to end


@pytest.mark.parametrize("tokens", all_bema_lines(), ids=lambda t: " ".join(t[:2]))
def test_every_bema_flag_in_the_readme_exists(tokens):
    check_flags(tokens)


def test_flags_in_the_flag_tables_exist():
    """Every --flag named in docs/usage.md's "Commands and their main flags" section is a real flag."""
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text[text.index("## Commands and their main flags") :]
    end = section.find("\n## ", 1)
    section = section[:end] if end != -1 else section
    helps = "".join(
        help_text(sub)
        for sub in (
            "stabilize",
            "eval",
            "sweep",
            "ship",
            "select",
            "push",
            "env",
            "rescore",
            "report",
            "simulate",
            "demo",
        )
    )
    helps += help_text(None)
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", section))
    assert len(flags) > 30
    missing = sorted(f for f in flags if not has_flag(helps, f))
    assert not missing, f"README flag tables name flags no command has: {missing}"


def test_flag_matching_is_exact():
    helps = "  --out-dtype  TEXT  output dtype\n  --max-model-len  INT\n"
    assert has_flag(helps, "--out-dtype") and has_flag(helps, "--max-model-len")
    assert (
        not has_flag(helps, "--out") and not has_flag(helps, "--dtype") and not has_flag(helps, "--max-model")
    )


def test_make_targets_exist():
    targets = [line.split()[1] for body in blocks("make") for line in commands(body)]
    assert {"demo", "test"} <= set(targets)
    for target in targets:
        result = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, f"make -n {target}: {result.stderr}"
    demo = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "bema demo" in demo


def test_python_blocks_compile():
    for i, body in enumerate(blocks("compile")):
        compile(body, f"README.md python block {i}", "exec")


@pytest.mark.slow
def test_cpu_commands_run_on_a_quick_demo(tmp_path):
    """Builds the demo's outputs (`bema demo --quick`), then runs the README's CPU block verbatim."""
    result = run_bema("demo", "--quick", "--out", tmp_path / "demo", timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    env = {**os.environ, "PATH": f"{BEMA.parent}{os.pathsep}{os.environ['PATH']}"}
    for body in blocks("run"):
        for line in commands(body):
            done = subprocess.run(
                ["bash", "-c", f"set -eo pipefail; {line}"], cwd=tmp_path, env=env,
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            assert done.returncode == 0, f"README command failed: {line}\n{done.stderr[-3000:]}"
    assert (tmp_path / "demo" / "grid" / "manifest.json").is_file()
    assert (tmp_path / "demo" / "grid-results" / "results.jsonl").is_file()
    assert (tmp_path / "demo" / "simulate.png").stat().st_size > 1000
    shipped = json.loads((tmp_path / "demo" / "ship" / ".bema-ship" / "ship.json").read_text())  # the demo's
    assert (
        json.loads((tmp_path / "demo" / "ship" / "bema.json").read_text())["run"]
        == shipped["decision"]["run"]
    )
    # the sweep -> select -> push loop: records only, then the winner alone written, with its card
    assert (tmp_path / "demo" / "sweep" / "results.jsonl").is_file()
    assert not list((tmp_path / "demo" / "sweep").rglob("*.safetensors"))
    assert (
        json.loads((tmp_path / "demo" / "sweep-ship" / "bema.json").read_text())["step"] > 0
    )  # DIR is the model


@pytest.mark.slow
def test_gpu_training_script_runs_on_a_tiny_model(tiny_model_dir, tmp_path):
    """The README's Qwen2.5-1.5B fine-tune (TRL's SFTTrainer), with the model swapped for the tiny one
    and 4 steps on CPU: it must write checkpoint-<s> folders that `bema stabilize --base` accepts."""
    import json

    script = blocks("compile")[0]
    swaps = {
        '"Qwen/Qwen2.5-1.5B"': repr(str(tiny_model_dir)),
        "max_steps=4000": "max_steps=4",
        "save_steps=400": "save_steps=2",
        "bf16=True": "bf16=False, use_cpu=True",
    }
    for old, new in swaps.items():
        assert old in script, old
        script = script.replace(old, new)
    rows = [{"messages": [{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(16)]  # fmt: skip
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sft.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "sft.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs" / "sft").glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    result = run_bema(
        "stabilize",
        tmp_path / "runs" / "sft",
        "--base",
        tiny_model_dir,
        "--out",
        tmp_path / "bema",
        "--final-only",
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "bema" / "bema-k0.5-e0.2" / "checkpoint-4" / "model.safetensors").is_file()


def test_cli_reference_is_the_cli_itself():
    """docs/cli.md lists every flag of every command: it is regenerated from the CLI and must match
    (run `python docs/make_cli_md.py > docs/cli.md` after changing a flag)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "docs" / "make_cli_md.py")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (root / "docs" / "cli.md").read_text(), "docs/cli.md is stale: regenerate it"
    assert "| `--readers` |" in proc.stdout and "## bema ship" in proc.stdout


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    """Links between the README and docs/ point at files that exist and at headings they have."""
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_readme_is_short_and_in_the_users_order():
    """The README is the entry, not the reference: at most ~250 lines, and in the order a newcomer
    needs it (what it is, the quick start, real use with `bema ship`, which average, the docs)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    order = [
        "## Quick start",
        "## Real use on a GPU: `bema ship`",
        "## Which average when",
        "## Documentation",
    ]
    assert [text.index(h) for h in order] == sorted(text.index(h) for h in order)
    assert "bema-cli[" not in text  # no unpublished package name: installs are from the checkout
