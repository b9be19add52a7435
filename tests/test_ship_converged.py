"""`bema ship` on runs where a fitted vector equals a menu config's: a fine-tune that converged early
(its last checkpoints are equal, so the simplex search's uniform start is LAWA-w4's vector) and a
run of two checkpoints. A candidate is its coefficient vector: equal vectors are one candidate,
scored once, whatever their names (it crashed with KeyError 'simplex-...' before)."""

from __future__ import annotations

import json

import pytest
from conftest import run_bema
from ship_runs import converged_run, heldout, optimum


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("converged")
    data = heldout(root / "heldout.jsonl")
    star = optimum(tiny_model_dir, data, root / "star")
    return {"root": root, "base": tiny_model_dir, "data": data, "star": star}


def _ship(world, run, out, *extra):
    return run_bema("ship", run, "--base", world["base"], "--out", out, "--tasks", "loss",
                    "--loss-data", world["data"], "--backend", "transformers", "--json", *extra)  # fmt: skip


def _results(out):
    rows = []
    for line in (out / ".bema-ship" / "race" / "loss" / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "items" in rec:
            rows.append(rec)
    return rows


def test_a_run_that_converged_early_ships_and_scores_each_vector_once(world, tmp_path):
    run = converged_run(world["base"], world["star"], tmp_path / "run")
    out = tmp_path / "model"
    r = _ship(world, run, out)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # the last 10 checkpoints are theta*: vanilla and every window over them are the same model
    assert doc["decision"]["step"] == 1200
    assert doc["decision"]["run"] == "vanilla", doc["verdict"]
    # no (vector, item) pair is evaluated twice, whatever name asked for it
    seen: dict = {}
    for rec in _results(out):
        key = rec["model_path"]
        ids = set(rec["items"]["ids"])
        assert not (seen.get(key, set()) & ids), f"{key} evaluated twice on {sorted(seen[key] & ids)[:3]}"
        seen.setdefault(key, set()).update(ids)
    # ship's own rebuild of what it wrote
    v = run_bema("verify", out)
    assert v.returncode == 0, v.stderr


def test_a_run_of_two_checkpoints_ships(world, tmp_path):
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200), reach_at=2)
    out = tmp_path / "model"
    r = _ship(world, run, out)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["decision"]["step"] == 200
