"""`bema ship --out` and `bema select --write` are never an input: not the base, not a checkpoint, not
inside the run, with or without --overwrite. Refused once and up front (before any evaluation),
one line, and nothing of the inputs changes."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import one_line_error, run_bema
from test_sweep import make_run


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def world(tiny_model_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    (base / "bema.json").write_text(json.dumps({"run": "ema-k0.5", "step": 40}))  # a model bema shipped
    make_run(base, tmp_path / "run")
    return {"base": base, "run": tmp_path / "run", "root": tmp_path}


@pytest.mark.parametrize(
    "where,what",
    [
        ("base", "is the input"),  # continuing from a shipped model: --out B --overwrite replaced B
        ("run/checkpoint-40", "lies inside the input"),  # an input checkpoint of the run being shipped
        ("run/ship", "lies inside the input"),  # inside the training run
    ],
)
def test_ship_out_is_refused_where_it_would_touch_an_input(world, where, what):
    out = world["root"] / where
    before = _tree(world["root"])
    r = run_bema("ship", world["run"], "--base", world["base"], "--out", out, "--overwrite",
                 "--tasks", "loss", "--loss-data", world["root"] / "missing.jsonl",
                 "--backend", "transformers")  # fmt: skip
    line = one_line_error(r)
    assert f"--out {out.resolve()}: {what}" in line, line
    assert _tree(world["root"]) == before  # no work folder, no staging sibling, no record


def test_a_second_writer_of_one_out_is_refused(world, tmp_path):
    """eval, sweep and ship lock their OUT (ship: DIR) as stabilize does: a second writer is refused
    with one line, and the holder's files are untouched."""
    from bema_cli.io.commit import locked

    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": f"count {i} and {i + 1}"}) + "\n" for i in range(6)))
    loss = ["--tasks", "loss", "--loss-data", data, "--backend", "transformers"]
    out = tmp_path / "res"
    with locked(out):
        for cmd in (
            ["eval", world["run"] / "checkpoint-10"],
            ["sweep", world["run"], "--base", world["base"], "--method", "ema"],
        ):
            line = one_line_error(run_bema(*cmd, "--out", out, *loss))
            assert f"{out}: another bema process" in line and "is writing here" in line, line
        assert sorted(p.name for p in out.iterdir()) == [".bema-lock"]
    model = tmp_path / "model"
    with locked(tmp_path, ".model.bema-lock", label=model):
        line = one_line_error(run_bema("ship", world["run"], "--base", world["base"], "--out", model, *loss))
        assert f"{model}: another bema process" in line, line
    assert not model.exists() and not (tmp_path / ".model.bema-ship").exists()
