"""Nothing lost, round two: messages that name the right file, side files, eval/report edge cases, LoRA
config checks, SIGTERM under Ray. Real files and real `bema` subprocesses, like tests/test_reliability.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import BEMA, one_line_error, run_bema
from trajectory import write_trajectory

STEPS = [10, 20, 30]
RUN = "bema-k0.5-e0.2"


def _small(root: Path, **kw) -> tuple[Path, Path]:
    return write_trajectory(root, STEPS, with_int=False, **kw)


# --- side files: only the checkpoint's own ------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json", "chat_template.jinja"])
@pytest.mark.parametrize("where", ["checkpoint", "base"])
def test_side_file_linking_outside_is_refused(tmp_path, name, where):
    """A side file that is a symlink out of its folder (a secret, say) is never copied into OUT."""
    base, run = _small(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy me\n")
    folder = run / "checkpoint-30" if where == "checkpoint" else base
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(secret)
    out = tmp_path / "out"
    r = run_bema("stabilize", run, "--base", base, "--out", out)
    line = one_line_error(r, 3)
    assert f"{folder / name}: a symbolic link to {secret}" in line, line
    assert not out.exists()


def test_side_file_linking_inside_is_copied_as_a_file(tmp_path):
    """A link to a file inside the same checkpoint is fine: its bytes land in OUT as a regular file."""
    base, run = _small(tmp_path)
    ckpt = run / "checkpoint-30"
    (ckpt / "tok.json").write_text('{"x": 1}')
    (ckpt / "tokenizer.json").symlink_to("tok.json")
    out = tmp_path / "out"
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--steps", "30")
    assert r.returncode == 0, r.stderr
    copied = out / RUN / "checkpoint-30" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == '{"x": 1}'
