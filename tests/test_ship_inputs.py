"""`bema ship --out` and `bema select --write` are never an input: not the base, not a checkpoint, not
inside the run, with or without --overwrite. Refused once and up front (before any evaluation),
one line, and nothing of the inputs changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import one_line_error, run_bema
from test_eval import write_data
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


@pytest.mark.parametrize("inside", ["loss-data", "chat-template", "config"])
def test_ship_never_replaces_a_file_it_reads(world, inside):
    """A held-out file, a chat template or a grid config inside DIR: `ship --out DIR --overwrite`
    would replace DIR and lose it. Refused up front, one line, DIR untouched."""
    out = world["root"] / "model"
    out.mkdir()
    (out / "bema.json").write_text(json.dumps({"run": "vanilla", "step": 80}))  # a model bema shipped
    data = out / "heldout.jsonl" if inside == "loss-data" else world["root"] / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": f"count {i} and {i + 1}"}) + "\n" for i in range(12)))
    extra = []
    if inside == "chat-template":
        (out / "chat.jinja").write_text("{{ messages }}")
        extra = ["--chat-template", out / "chat.jinja"]
    elif inside == "config":
        (out / "grid.yaml").write_text("methods: {ema: {}}\n")
        extra = ["--config", out / "grid.yaml"]
    before = _tree(world["root"])
    r = run_bema("ship", world["run"], "--base", world["base"], "--out", out, "--overwrite", "--tasks", "loss",
                 "--loss-data", data, "--backend", "transformers", *extra)  # fmt: skip
    line = one_line_error(r)
    assert f"--out {out.resolve()}: contains the input" in line, line
    assert _tree(world["root"]) == before


@pytest.mark.parametrize("where", ["run", "run/sub", "."])
def test_sweep_never_writes_into_the_training_run(world, where):
    """`bema sweep RUN --out RUN` (or inside it, or around it) is refused before anything is written."""
    data = world["root"] / "data" / "heldout.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"text": f"count {i} and {i + 1}"}) + "\n" for i in range(6)))
    out = world["root"] / where
    before = _tree(world["run"])
    r = run_bema("sweep", world["run"], "--base", world["base"], "--method", "ema", "--out", out,
                 "--tasks", "loss", "--loss-data", data, "--backend", "transformers")  # fmt: skip
    line = one_line_error(r)
    assert f"--out {out.resolve()}: " in line and "the input" in line, line
    assert _tree(world["run"]) == before


def test_eval_never_writes_into_the_training_run(world):
    data = world["root"] / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": f"count {i} and {i + 1}"}) + "\n" for i in range(6)))
    before = _tree(world["run"])
    r = run_bema("eval", world["run"] / "checkpoint-10", "--out", world["run"], "--tasks", "loss",
                 "--loss-data", data, "--backend", "transformers")  # fmt: skip
    line = one_line_error(r)
    assert "is the training run" in line, line
    assert _tree(world["run"]) == before
    # a folder inside the run (a new checkpoint-90: the next ship of RUN then found "no model weights")
    for inside in ("checkpoint-90", "checkpoint-90/evals"):
        r = run_bema("eval", world["run"] / "checkpoint-10", "--out", world["run"] / inside, "--tasks", "loss",
                     "--loss-data", data, "--backend", "transformers")  # fmt: skip
        line = one_line_error(r, 4)
        assert "lies inside the training run" in line and "reads as a checkpoint of it" in line, line
        assert _tree(world["run"]) == before


def test_a_staging_folder_belongs_to_exactly_one_out(tmp_path):
    """A ship into model-v2 killed between its two renames leaves the old model-v2 aside: a later
    ship into `model` leaves it alone; a later ship into `model-v2` puts it back."""
    from bema_cli.publish.write import clean_staging

    dead = 2**22 + 12345  # above Linux's default pid_max: no such process
    aside = tmp_path / f".bema-tmp-old-{dead}-model-v2"
    aside.mkdir()
    (aside / "bema.json").write_text("{}")
    user = tmp_path / ".bema-tmp-old-my-notes-model"  # not bema's: no pid in its place
    user.mkdir()
    clean_staging(tmp_path / "model")
    assert aside.is_dir() and user.is_dir() and not (tmp_path / "model").exists()
    clean_staging(tmp_path / "model-v2")
    assert not aside.exists() and (tmp_path / "model-v2" / "bema.json").is_file() and user.is_dir()


def test_a_base_with_another_tokenizer_is_warned_about(world, tmp_path):
    """Same shapes, another vocabulary (or a token added): not the model the run started from, said up
    front, once per command; the same tokenizer saved again by transformers (as the HF Trainer saves
    it into every checkpoint: "" where `tokenizers` wrote null) is the same and says nothing."""
    from transformers import AutoTokenizer

    def base_with(name: str, change) -> Path:
        other = tmp_path / name
        shutil.copytree(world["base"], other)
        (other / "bema.json").unlink()
        tok = json.loads((other / "tokenizer.json").read_text())
        change(tok)
        (other / "tokenizer.json").write_text(json.dumps(tok))
        return other

    def swap(tok):
        vocab = tok["model"]["vocab"]
        a, b = list(vocab)[10:12]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    def add(tok):
        tok["added_tokens"].append({"id": len(tok["model"]["vocab"]) + len(tok["added_tokens"]), "content": "<|x|>",
                                    "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": True})  # fmt: skip

    resaved = tmp_path / "resaved"
    shutil.copytree(world["base"], resaved)
    AutoTokenizer.from_pretrained(world["base"]).save_pretrained(resaved)
    assert (resaved / "tokenizer.json").read_text() != (world["base"] / "tokenizer.json").read_text()
    args = ["stabilize", world["run"], "--method", "ema", "--final-only"]
    for base, warned in ((base_with("swapped", swap), True), (base_with("added", add), True),
                         (resaved, False), (world["base"], False)):  # fmt: skip
        r = run_bema(*args, "--base", base, "--out", tmp_path / f"out-{base.name}")
        assert r.returncode == 0 and ("its tokenizer differs from the run's" in r.stderr) == warned, (
            base,
            r.stderr,
        )
    data = write_data(tmp_path / "data")
    r = run_bema("ship", world["run"], "--base", tmp_path / "swapped", "--out", tmp_path / "ship", "--tasks", "loss",
                 "--loss-data", data / "heldout.jsonl", "--backend", "transformers", "--dry-run")  # fmt: skip
    assert r.returncode == 0 and r.stderr.count("its tokenizer differs from the run's") == 1, r.stderr


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_ship_refuses_to_decide_at_theta0(world, tmp_path, dry):
    """`--at 0` names theta0, not a checkpoint: the decision and its dry run (one shared reading of
    the run, request.decision_run) refuse it in one line, before any engine starts."""
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": f"count {i} and {i + 1}"}) + "\n" for i in range(6)))
    r = run_bema("ship", world["run"], "--base", world["base"], "--out", tmp_path / "model", "--at", "0",
                 "--tasks", "loss", "--loss-data", data, "--backend", "transformers", *dry)  # fmt: skip
    line = one_line_error(r, 2)
    assert "--at: ship decides at a checkpoint's step, not at theta0 (0)" in line, line
    assert not (tmp_path / "model").exists()


def test_an_out_that_cannot_be_placed_is_refused_before_any_work(world):
    """`--out FILE/model` (exit 1, "File exists", before) and `cd DIR; ship --out . --overwrite` (the
    whole race, then exit 1, "Device or resource busy") are the up-front check's: exit 4, one line,
    before any engine starts or record is made."""
    data = world["root"] / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": f"count {i} and {i + 1}"}) + "\n" for i in range(30)))
    common = ["--base", world["base"], "--tasks", "loss", "--loss-data", data, "--backend", "transformers"]
    afile = world["root"] / "notes.txt"
    afile.write_text("x")
    line = one_line_error(run_bema("ship", world["run"], "--out", afile / "model", *common), 4)
    assert f"lies under {afile}, a file" in line, line
    here = world["root"] / "shipped"
    here.mkdir()
    (here / "bema.json").write_text("{}")
    r = run_bema("ship", world["run"], "--out", ".", "--overwrite", *common, cwd=here)
    line = one_line_error(r, 4)
    assert "is the folder this command runs in" in line, line
    assert sorted(p.name for p in here.iterdir()) == ["bema.json"]
    assert not list(world["root"].glob(".*bema*"))  # no work folder, lock or staging left beside it


def test_a_task_ship_cannot_use_and_a_margin_with_no_guard_are_refused(world):
    """`--tasks loss,train_loss --guard-margin 0` exited 0: train_loss was never scored, no guard ran
    and the margin was ignored. Each is refused up front, exit 2, naming the flag."""
    data = world["root"] / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": f"count {i} and {i + 1}"}) + "\n" for i in range(30)))
    common = [
        "ship",
        world["run"],
        "--base",
        world["base"],
        "--out",
        world["root"] / "m",
        "--backend",
        "transformers",
    ]
    line = one_line_error(
        run_bema(*common, "--tasks", "loss", "--loss-data", data, "--loss-train-data", data), 2
    )
    assert "--tasks train_loss: ship neither decides nor guards" in line, line
    line = one_line_error(run_bema(*common, "--tasks", "loss", "--loss-data", data, "--guard-margin", "0"), 2)
    assert "--guard-margin: no guard task" in line, line
    assert not (world["root"] / "m").exists()


def test_a_token_the_hub_refuses_is_found_before_the_race(world):
    """A token the Hub refuses (401) was found after the whole race, DIR written: the Hub is asked
    whose token it is first (exit 6, nothing made); a Hub that cannot be reached is said and the
    work goes on (here --dry-run, which asks too)."""
    from hub_standin import HubStandIn
    from test_push import hub_env

    data = world["root"] / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": f"count {i} and {i + 1}"}) + "\n" for i in range(30)))
    out = world["root"] / "m"
    args = ["ship", world["run"], "--base", world["base"], "--out", out, "--tasks", "loss", "--loss-data", data,
            "--backend", "transformers", "--push", "org/m"]  # fmt: skip
    with HubStandIn() as hub:
        r = run_bema(*args, env=hub_env(hub.url, token="hf_refused"))
        line = one_line_error(r, 6)
        assert "the Hub refused the token for org/m (401" in line, line
        assert "GET /api/whoami-v2" in hub.calls and not out.exists()
        assert not [c for c in hub.calls if not c.startswith("GET ")]  # nothing created or uploaded
        assert not list(world["root"].glob(".m.*"))  # no work folder: refused before any work
        ok = run_bema(*args, "--dry-run", env=hub_env(hub.url))
        assert ok.returncode == 0 and "--push org/m: the Hub knows the token (stand-in-user)" in ok.stderr, (
            ok.stderr
        )
    gone = run_bema(*args, "--dry-run", env=hub_env(hub.url))  # the stand-in has stopped: nothing answers
    assert gone.returncode == 0, gone.stderr
    assert (
        "--push org/m: the token could not be checked (the Hub at" in gone.stderr
        and "going on" in gone.stderr
    )
