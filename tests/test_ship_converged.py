"""`bema ship` on runs where a fitted vector equals a menu config's: a fine-tune that converged early
(its last checkpoints are equal, so the simplex search's uniform start is LAWA-w4's vector) and a
run of two checkpoints. A candidate is its coefficient vector: equal vectors are one candidate,
scored once, whatever their names (it crashed with KeyError 'simplex-...' before)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import one_line_error, run_bema
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
    # loss's default fit: the simplex alone (bench_decide: the soup found no better model, at a third
    # more swaps); it is what the request records
    assert "simplex" in doc["fitted"] and "soup" not in doc["fitted"], sorted(doc["fitted"])
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


def test_ship_says_why_an_average_lags_and_the_card_gives_the_recipe(world, tmp_path):
    """The vectors say why an EMA loses on a short run (its weight on theta0, checked here against the
    recurrence by hand in float64) and when a window is wider than the run; the card and bema.json
    name the shipped model's checkpoints and weights, keyed by step."""
    steps = (100, 200, 300)
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=steps, reach_at=2)
    out = tmp_path / "model"
    r = _ship(world, run, out, "--fit", "none")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    theta0 = 1.0
    for s in steps:  # ema_0 = theta0; ema <- (1 - beta) ema + beta theta_s, beta = (10 + s)^-0.5
        theta0 *= 1 - (10 + s) ** -0.5
    want = f"ema-k0.5 still weighs theta0 at {theta0:.3g} at step 300: with 3 checkpoints, save more often"
    assert any(n.startswith(want) for n in doc["notes"]), doc["notes"]
    # the menu's windows (4 and 8) are no wider than the run: its 3 checkpoints make lawa-w3 and
    # wsm-minus_sqrt-w3, named by what they average (before: lawa-w4 and lawa-w8 of 3 checkpoints)
    assert "lawa-w3" in json.dumps(doc["race"]) and "-w4" not in json.dumps(doc), doc["race"]
    assert not any("averages 3 checkpoints" in n for n in doc["notes"]), doc["notes"]
    human = run_bema("ship", run, "--base", world["base"], "--out", tmp_path / "m2", "--tasks", "loss", "--loss-data",
                     world["data"], "--backend", "transformers", "--fit", "none")  # fmt: skip
    assert human.returncode == 0 and "note: ema-k0.5 still weighs theta0" in human.stdout, human.stderr
    # progress: a line per menu candidate and per fit trial, named by what it is, never a digest
    assert "loss: menu candidate 1 of " in human.stderr and "fit:" not in human.stderr, human.stderr
    record = json.loads((out / "bema.json").read_text())
    assert set(record["coefficients"]) <= {"theta0", "100", "200", "300"}
    assert abs(sum(record["coefficients"].values()) - 1) < 1e-9
    card = (out / "README.md").read_text()
    words = " + ".join(
        f"{c:.4g} x checkpoint-{k}" for k, c in record["coefficients"].items() if k != "theta0"
    )
    assert "| weights |" in card and words in card, card


def test_a_checkpoint_folder_given_as_the_run_says_pass_its_parent(world, tmp_path):
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200), reach_at=2)
    line = one_line_error(_ship(world, run / "checkpoint-200", tmp_path / "m"))
    assert "looks like a checkpoint, not a run: pass its parent folder" in line, line


def test_push_without_a_token_is_refused_before_the_race(world, tmp_path):
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200), reach_at=2)
    env = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}
    args = ["ship", run, "--base", world["base"], "--out", tmp_path / "m", "--tasks", "loss", "--loss-data",
            world["data"], "--backend", "transformers", "--push", "org/model"]  # fmt: skip
    line = one_line_error(run_bema(*args, env=env), 6)
    assert "--push org/model: no Hugging Face token" in line, line
    assert not (tmp_path / ".m.bema-ship").exists()  # nothing was raced
    dry = run_bema(*args, "--dry-run", env=env)
    assert dry.returncode == 0 and "warning: --push org/model: no Hugging Face token" in dry.stderr, (
        dry.stderr
    )


def test_ship_without_loss_data_or_tasks_says_what_it_decides_on(world, tmp_path):
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200), reach_at=2)
    r = run_bema("ship", run, "--base", world["base"], "--out", tmp_path / "m", "--backend", "transformers",
                 "--data-dir", tmp_path / "nodata", env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    line = one_line_error(r)
    assert "ship decides on --loss-data FILE (held-out loss) or on --tasks" in line, line


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_the_same_request_spelled_relative_is_the_same_and_another_file_names_its_flag(world, tmp_path):
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200), reach_at=2)
    shutil.copy(world["data"], tmp_path / "heldout.jsonl")
    args = ["ship", "run", "--base", world["base"], "--out", "m", "--tasks", "loss", "--backend", "transformers",
            "--fit", "none", "--json"]  # fmt: skip
    first = run_bema(*args, "--loss-data", "heldout.jsonl", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run_bema(*[str(a).replace("run", str(run), 1) if a == "run" else a for a in args], "--loss-data",
                     tmp_path / "heldout.jsonl", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0 and json.loads(again.stdout).get("up_to_date") is True, again.stderr
    other = tmp_path / "other.jsonl"
    other.write_text(world["data"].read_text())
    line = one_line_error(run_bema(*args, "--loss-data", other, cwd=tmp_path))
    assert "differs in: " in line and "--loss-data" in line, line


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_copies_of_a_held_out_row_are_one_item(world, tmp_path):
    """40 identical held-out rows gave a zero-width '95% interval' and an average shipped: copies are
    one independent item. 12 rows 4 times over are 12 items: too few report items to decide on."""
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200, 300), reach_at=3)
    rows = world["data"].read_text().splitlines()
    args = ["ship", run, "--base", world["base"], "--tasks", "loss", "--backend", "transformers", "--json"]
    same = tmp_path / "same.jsonl"
    same.write_text((rows[0] + "\n") * 40)
    r = run_bema(*args, "--out", tmp_path / "m1", "--loss-data", same)
    assert r.returncode == 2 and "39 of the 40 held-out records repeat another" in r.stderr, r.stderr
    assert "1 items leave one side empty" in r.stderr and not (tmp_path / "m1").exists()
    four = tmp_path / "four.jsonl"
    four.write_text("".join(row + "\n" for row in rows[:12]) * 4)
    r = run_bema(*args, "--out", tmp_path / "m2", "--loss-data", four)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["decision"]["kind"] == "vanilla" and "cannot decide" in doc["verdict"], doc["verdict"]
    assert "36 of the 48 held-out records repeat another" in r.stderr, r.stderr


def test_out_as_a_symbolic_link_is_refused_before_any_work(world, tmp_path):
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200), reach_at=2)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for link in ("link", "dangling"):
        line = one_line_error(_ship(world, run, tmp_path / link))
        assert f"--out {tmp_path / link}: a symbolic link" in line, line
    assert (tmp_path / "link").is_symlink() and not list((tmp_path / "real").iterdir())


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
@pytest.mark.parametrize("edit", ["swap", "duplicate", "none"])
def test_an_interrupted_ships_records_are_chained_and_an_edit_is_refused(world, tmp_path, edit):
    """The race's records as a killed ship leaves them (no ship.json, no seal): resumed as they are,
    nothing is evaluated again; two records' scores swapped, or a record appended twice, is refused."""
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200, 300), reach_at=2)
    assert _ship(world, run, tmp_path / "m1", "--fit", "none").returncode == 0
    work = tmp_path / ".m2.bema-ship"
    shutil.copytree(tmp_path / "m1" / ".bema-ship", work)
    for name in ("ship.json", "seal.json", "motion.json"):
        (work / name).unlink(missing_ok=True)
    results = work / "race" / "loss" / "results.jsonl"
    lines = results.read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    if edit == "swap":
        i, j = [n for n, r in enumerate(recs) if "items" in r][:2]
        recs[i]["items"]["nll"], recs[j]["items"]["nll"] = recs[j]["items"]["nll"], recs[i]["items"]["nll"]
        results.write_text("".join(json.dumps(r) + "\n" for r in recs))
    elif edit == "duplicate":
        results.write_text("\n".join([*lines, lines[-1]]) + "\n")
    r = _ship(world, run, tmp_path / "m2", "--fit", "none")
    if edit == "none":
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["race"]["evaluations"]["items"] == 0  # every record reused
        return
    line = one_line_error(r)
    assert f"{results}: record " in line and "changed since bema appended it" in line, line


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_held_out_rows_far_above_the_training_loss_are_warned_about(world, tmp_path):
    """vanilla's held-out loss twice the run's last logged training loss (and half a nat above): the rows
    may not be in the shape the run trained on, said as a warning and a note."""
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200), reach_at=2)
    state = {"global_step": 200, "log_history": [{"step": 100, "loss": 0.9}, {"step": 200, "loss": 0.01}]}
    (run / "checkpoint-200" / "trainer_state.json").write_text(json.dumps(state))
    r = _ship(world, run, tmp_path / "m", "--fit", "none")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    note = doc["notes"][0]
    assert note.startswith("vanilla's held-out loss ") and "last training loss 0.01" in note, note
    assert "warning: vanilla's held-out loss" in r.stderr
    # not confident (vanilla is below theta0 here): shipped, the warning in the verdict and on the card
    assert doc["verdict"].endswith(
        "warning: the held-out rows may not be in the shape the run trained on (see the note)"
    )
    assert f"Note: {note}." in (tmp_path / "m" / "README.md").read_text()
    state["log_history"][-1]["loss"] = 0.7  # in line with the held-out loss: nothing said
    (run / "checkpoint-200" / "trainer_state.json").write_text(json.dumps(state))
    r = _ship(world, run, tmp_path / "m2", "--fit", "none")
    assert r.returncode == 0 and not any("held-out loss" in n for n in json.loads(r.stdout).get("notes", []))


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_held_out_loss_that_training_raised_is_warned_about(world, tmp_path):
    """A run that walks away from what the held-out rows favour (theta0 is the optimum, the run ends at
    the untrained model): vanilla's held-out loss is above theta0's on the report items, said as a
    warning and a note with the likely causes; a run that walks toward it says nothing so."""
    run = converged_run(world["star"], world["base"], tmp_path / "run", steps=(100, 200), reach_at=2)
    r = run_bema("ship", run, "--base", world["star"], "--out", tmp_path / "m", "--tasks", "loss", "--loss-data",
                 world["data"], "--backend", "transformers", "--json", "--fit", "none")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # and far above the run's own training loss too: confident that the rows are in another shape, so
    # nothing is written (it shipped EMA at "-0.55" where, on the trained tokens, EMA was worse)
    state = {"global_step": 200, "log_history": [{"step": 200, "loss": 0.01}]}
    (run / "checkpoint-200" / "trainer_state.json").write_text(json.dumps(state))
    args = ["ship", run, "--base", world["star"], "--out", tmp_path / "m3", "--tasks", "loss", "--loss-data",
            world["data"], "--backend", "transformers", "--json", "--fit", "none"]  # fmt: skip
    refused = run_bema(*args)  # after the race's progress lines: the one error line, last
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 3 and "Traceback" not in refused.stderr, refused.stderr
    assert line.startswith("error: ") and "far above the run's last training loss" in line, line
    assert "--trust-held-out" in line, line
    assert not (tmp_path / "m3").exists()
    trusted = run_bema(*args, "--trust-held-out")  # the user's choice: it ships, saying so
    assert trusted.returncode == 0, trusted.stderr
    assert "shape the run trained on" in json.loads(trusted.stdout)["verdict"]
    (run / "checkpoint-200" / "trainer_state.json").unlink()
    (note,) = [n for n in doc["notes"] if "above theta0's" in n]
    n = doc["select"]["selection"]["reported_on"]
    assert f"on the same {n} report items: training made these rows less likely" in note, note
    assert "warning: vanilla's held-out loss" in r.stderr
    toward = converged_run(world["base"], world["star"], tmp_path / "toward", steps=(100, 200), reach_at=2)
    r = _ship(world, toward, tmp_path / "m2", "--fit", "none")
    assert r.returncode == 0 and not any("above theta0's" in n for n in json.loads(r.stdout)["notes"])


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_report_on_a_ship_folder_shows_the_decisions_table(world, tmp_path):
    """`bema report DIR` on a shipped model: the decision's rows, every one on the same report items,
    the shipped one marked, the verdict; no race record of a candidate dropped after 16 items, and no
    warning about bema's own records."""
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200, 300), reach_at=3)
    out = tmp_path / "model"
    doc = json.loads(_ship(world, run, out).stdout)
    r = run_bema("report", out, env={"COLUMNS": "200"})
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    n = doc["select"]["selection"]["reported_on"]
    assert f"every row on the same {n} report items" in r.stdout, r.stdout
    assert " ".join(doc["verdict"].split()) in " ".join(r.stdout.split()) and "shipped" in r.stdout
    rows = {c["run"] for c in doc["select"]["candidates"]}
    dropped = set(doc["race"]["dropped"]) - rows
    table = r.stdout.split("\nship ")[0]  # the rows, before the verdict and its notes
    assert dropped and not any(name in table.split() for name in dropped), r.stdout
    assert json.loads(run_bema("report", out, "--json").stdout)["verdict"] == doc["verdict"]
    # a forged verdict, and records in shapes bema never wrote: refused as ship refuses them, one
    # line naming the file, exit 3 (it printed the forged verdict, exit 0, or crashed with exit 70)
    path = out / ".bema-ship" / "ship.json"
    sealed = path.read_text()
    forged = json.loads(sealed)
    forged["verdict"] = "ship lawa-w4 at step 300: forged"
    shapes = [forged, {**forged, "select": {}}, {**forged, "decision": None}, {**forged, "verdict": 3}, [1]]
    for bad in shapes:
        path.write_text(json.dumps(bad))
        for args in ((), ("--json",)):
            line = one_line_error(run_bema("report", out, *args), 3)
            assert str(path) in line and "forged" not in line, line
    path.write_text(sealed)
    assert run_bema("report", out).returncode == 0  # bema's own bytes again: reported


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_the_dry_runs_projection_counts_a_floor_per_forward(world, tmp_path):
    """On a tiny model FLOP/s alone projected 10-14x low: every held-out record is a forward with a
    per-call floor (sweep/project.FORWARD_FLOOR_S, measured), counted for each evaluation at most."""
    from bema_cli.sweep.project import FORWARD_FLOOR_S

    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200, 300), reach_at=3)
    r = _ship(world, run, tmp_path / "m", "--dry-run")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    at_most = doc["evaluations"]["at_most"]
    assert doc["projection"]["parts_seconds"]["forward"] >= round(FORWARD_FLOOR_S * at_most, 1) - 0.1, doc


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_allow_gaps_reaches_the_fits(world, tmp_path):
    """The gap error's own advice, --allow-gaps, carries through the fits (they died in an internal
    stabilize that never got the flag): the vectors are computed from the very plan that allows it."""
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200, 300, 400, 500, 600),
                        reach_at=4)  # fmt: skip
    (run / "checkpoint-600" / "trainer_state.json").write_text(
        json.dumps({"global_step": 600, "save_steps": 100})
    )
    shutil.rmtree(run / "checkpoint-300")
    line = one_line_error(_ship(world, run, tmp_path / "m"))
    assert "checkpoint step(s) 300 missing" in line and "--allow-gaps" in line, line
    r = _ship(world, run, tmp_path / "m", "--allow-gaps")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fitted"]["candidates"], doc["fitted"]  # the fits were searched
    assert json.loads((tmp_path / "m" / "bema.json").read_text())["allow_gaps"] is True


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_a_refused_push_says_the_verdict_first(world, tmp_path):
    """The Hub knows the token (ship asks it first, before the race) but refuses the push after the
    whole decision (403 at the repo's creation: the token's rights): the verdict (and with --json the
    whole document, with the push's error) is on stdout before the one-line error, exit 6."""
    from hub_standin import TOKEN, HubStandIn

    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200), reach_at=2)
    with HubStandIn() as hub:
        hub.fault = ("status", "POST /api/repos/create", 403)
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
               "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": TOKEN}  # fmt: skip
        args = ["ship", run, "--base", world["base"], "--tasks", "loss", "--loss-data", world["data"],
                "--backend", "transformers", "--fit", "none", "--push", "org/model"]  # fmt: skip
        r = run_bema(*args, "--out", tmp_path / "m", env=env)
        assert r.returncode == 6 and r.stdout.startswith("ship "), (r.stdout, r.stderr)
        assert "refused the token" in r.stderr.strip().splitlines()[-1]
        r = run_bema(*args, "--out", tmp_path / "m2", "--json", env=env)
        doc = json.loads(r.stdout)
        assert (
            r.returncode == 6
            and doc["verdict"].startswith("ship ")
            and "refused the token" in doc["push_error"]
        )


@pytest.mark.slow  # ship runs beyond the default run's budget: `make test-slow`
def test_sweep_says_why_an_average_lags_too(world, tmp_path):
    run = converged_run(world["base"], world["star"], tmp_path / "run", steps=(100, 200, 300), reach_at=2)
    r = run_bema("sweep", run, "--base", world["base"], "--out", tmp_path / "s", "--method", "ema,lawa",
                 "--window", "4", "--at", "last", "--tasks", "loss", "--loss-data", world["data"],
                 "--backend", "transformers", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["notes"]
    assert any(n.startswith("ema-k0.5 still weighs theta0 at ") for n in notes), notes
    assert "lawa-w4 averages 3 checkpoints, not 4: the run has 3 up to step 300" in notes
