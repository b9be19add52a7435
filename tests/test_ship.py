"""`bema ship` end to end (the real CLI in a subprocess, transformers backend): on a run where
averaging helps it ships an average; where it cannot (steady drift, every average lags) it ships
the raw checkpoint and says that none of the averages it tested beats vanilla. DIR is the model folder; a killed ship
resumes evaluating nothing twice; the fitted averages never lose to the menu on the pick items."""

from __future__ import annotations

import importlib
import itertools
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import names, one_line_error, run_bema, vllm_available
from ship_runs import drift_run, heldout, noisy_run, optimum

from bema_cli.decide import guard

pytestmark = pytest.mark.slow  # a sweep of 8 configs and a dozen fitted candidates per run (~15 s each)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ship")
    data = heldout(root / "heldout.jsonl")
    star = optimum(tiny_model_dir, data, root / "star")
    return {"root": root, "base": tiny_model_dir, "data": data,
            "noisy": noisy_run(tiny_model_dir, star, root / "noisy"),
            "drift": drift_run(tiny_model_dir, star, root / "drift")}  # fmt: skip


def ship(runs, name, out, *extra):
    r = run_bema("ship", runs[name], "--base", runs["base"], "--out", out, "--tasks", "loss",
                 "--loss-data", runs["data"], "--backend", "transformers", "--json", *extra)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r


def test_min_effect_ships_vanilla_unless_an_average_clears_it(runs, tmp_path):
    """--min-effect E: an average ships only if its interval against vanilla lies beyond E. On the
    noisy run, where an average ships at E = 0 (the test below), E = 5 nats/token is out of reach:
    each candidate's sequence against vanilla ends below it after a round, the race stops, no fit is
    searched, and vanilla ships with the verdict naming the margin. A negative E is refused."""
    doc, r = ship(runs, "noisy", tmp_path / "model", "--min-effect", "5")
    assert doc["decision"]["run"] == "vanilla", doc["verdict"]
    stopped = doc["race"]["stopped"]
    assert stopped.startswith("every candidate's sequence lies within --min-effect 5 of vanilla"), stopped
    assert all(d["after"] == 16 for d in doc["race"]["dropped"].values())  # each left after one round
    left = [line for line in r.stderr.splitlines() if " left the race after 16 of " in line]
    assert len(left) == len(doc["race"]["dropped"]), r.stderr  # a line each, saying when and why
    assert "the fits were not searched" in doc["verdict"] and not doc.get("fitted")
    assert "--min-effect 5" in doc["verdict"] or "not beyond its interval" in doc["verdict"], doc["verdict"]
    line = one_line_error(run_bema("ship", runs["noisy"], "--out", tmp_path / "m2", "--min-effect", "-1"), 2)
    assert "--min-effect" in line, line


@pytest.mark.slow  # two ships with a generation task: `make test-slow`
def test_a_guard_task_blocks_an_average_it_cannot_show_not_worse(runs, tmp_path):
    """--tasks loss,gsm8k: loss decides, gsm8k guards. The tiny model answers no gsm8k item, so the
    average and vanilla tie there exactly: within the default margin (0.03) the average ships; with
    --guard-margin 0 nothing can show it is not worse, and vanilla ships, the verdict naming the guard."""
    from test_eval import write_data

    data = write_data(tmp_path / "data")
    args = [
        "--tasks",
        "loss,gsm8k",
        "--data-dir",
        data,
        "--limit",
        "6",
        "--max-new-tokens",
        "4",
        "--fit",
        "none",
    ]
    doc, _ = ship(runs, "noisy", tmp_path / "m", *args)
    assert doc["decision"]["run"] != "vanilla", doc["verdict"]
    # vanilla is loaded once for gsm8k and both halves of loss, the shipped average once more at most
    # (when it was not the last config raced): 3 swaps fewer than each task in turn
    rows = [json.loads(x) for f in (tmp_path / "m" / ".bema-ship" / "race").glob("*/results.jsonl")
            for x in f.read_text().splitlines()]  # fmt: skip
    assert doc["stages"]["swap"]["count"] <= len({r["candidate"] for r in rows if "candidate" in r}) + 1
    (g,) = doc["guards"]
    assert g["task"] == "gsm8k" and g["passed"] and g["margin"] == 0.03
    assert doc["other_tasks"]["gsm8k"]["guard"] == {"margin": 0.03, "passed": True}
    doc, r = ship(runs, "noisy", tmp_path / "m0", *args, "--guard-margin", "0")
    assert doc["decision"]["run"] == "vanilla" and doc["decision"]["blocked"]["guard"] == "gsm8k"
    assert "but the guard gsm8k blocked it" in doc["verdict"], doc["verdict"]
    # a guard of 6 items cannot pass an equal model: said before anything was scored, and the block
    # names the levers
    said = r.stderr.index(
        "warning: gsm8k guard: an average as good as vanilla passes 0% of the time at 6 items"
    )
    assert said < r.stderr.index("gsm8k: vanilla on its 6 items"), r.stderr
    assert "or the metric alone would decide" in doc["verdict"], doc["verdict"]
    dry = run_bema("ship", runs["noisy"], "--base", runs["base"], "--out", tmp_path / "m1", "--loss-data",
                   runs["data"], "--backend", "transformers", "--json", "--dry-run", *args)  # fmt: skip
    (g,) = json.loads(dry.stdout)["guards"]
    assert g["task"] == "gsm8k" and g["items"] == 6 and g["equal_passes"] < 0.8 and "said" in g, dry.stdout
    assert json.loads((tmp_path / "m0" / "bema.json").read_text())["run"] == "vanilla"
    # the card renders the decision's own verdict (never a sentence of its own: it said "no average
    # of the run beat it beyond its interval" of an average the guard had blocked), and the guard's row
    card = (tmp_path / "m0" / "README.md").read_text()
    assert f"bema's decision: {doc['verdict']}." in card, card
    assert "no average of the run beat it" not in card
    (row,) = [line for line in card.splitlines() if line.startswith("| `gsm8k` |")]
    g = doc["other_tasks"]["gsm8k"]
    assert f"| {g['vanilla']:.4g} |" in row and f"not shipped: {g['candidate']} vs vanilla" in row, row
    assert "verdict" not in doc["select"]  # one verdict in the document: the decision's
    # the blocked average's flip table on the guard: in the notes, the card and `report DIR`
    (flip,) = [n for n in doc["notes"] if n.startswith("gsm8k: of 6 items, ")]
    assert f"Note: {flip}." in card and doc["other_tasks"]["gsm8k"]["flips"]["items"] == 6
    report = run_bema("report", tmp_path / "m0").stdout
    assert flip in report
    # one record behind every view: the --json document and the sealed ship.json read as the same
    # Decision; the blocked candidate's metric row on the card and in `report DIR`, marked as such
    from bema_cli.decide.outcome import Decision

    sealed_doc = json.loads((tmp_path / "m0" / ".bema-ship" / "ship.json").read_text())
    assert Decision.of(doc) == Decision.of(sealed_doc)
    blocked = doc["decision"]["blocked"]["run"]
    assert f"not shipped (blocked by the gsm8k guard): {blocked} vs vanilla" in card, card
    assert "blocked by the gsm8k guard" in report and f"{doc['verdict']}\n" in report, report


def test_noisy_iterates_ship_an_average_as_a_model_folder(runs, tmp_path):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model"
    doc, r = ship(runs, "noisy", out)
    decision = doc["decision"]
    assert decision["run"] != "vanilla" and decision["step"] == 80
    assert decision["vs_vanilla"]["high"] < 0  # lower loss than vanilla, beyond the interval
    assert doc["verdict"].startswith(f"ship {decision['run']} at step 80: held-out loss ")
    assert doc["tie_rule"].startswith("among configs tied with the best")
    AutoModelForCausalLM.from_pretrained(out)  # DIR itself is the model
    record = json.loads((out / "bema.json").read_text())
    assert record["run"] == decision["run"]
    assert json.loads((out / ".bema-ship" / "ship.json").read_text())["verdict"] == doc["verdict"]
    # where the whole command's time went: the sweep's stages, the fits' swaps from memory, the write
    assert {"walk", "loss", "swap", "write"} <= set(doc["stages"]), sorted(doc["stages"])
    assert "fit_basis" not in doc["stages"]  # the menu's vectors are computed in memory, no stabilize
    assert doc["stages"]["swap"]["seconds"] > 0 and "stages: " in r.stderr
    # every menu candidate was swapped in at least once, and the swaps are counted beside their seconds
    assert doc["stages"]["swap"]["count"] >= len(doc["race"]["survivors"]) + len(doc["race"]["dropped"])
    card = ModelCard.load(out / "README.md")
    assert card.data.eval_results[0].metric_type == "loss"
    assert str(runs["root"]) not in (out / "README.md").read_text()  # no absolute local path
    # loss's default fit is the simplex alone (the soup only with --fit soup); a simplex (it starts
    # at LAWA-w4) may end worse than the menu's best on the pick items, and then is not shipped
    assert "simplex" in doc["fitted"] and "soup" not in doc["fitted"], sorted(doc["fitted"])
    found = [x for x in r.stderr.splitlines() if x.startswith("loss: simplex found ")]  # its result, once
    assert len(found) == 1 and f"{doc['fitted']['simplex']['pick_value']:.4g} on the " in found[0], r.stderr
    equals = doc["fitted"]["simplex"]["equals"]
    assert (equals is None) == ("the menu's" not in found[0]) and (equals is None or equals in found[0])
    menu = min(c["picked_value"] for c in doc["select"]["candidates"])
    if doc["fitted"]["best"]["pick_value"] > menu:
        assert decision["kind"] != "fitted"
    if decision["kind"] == "fitted":  # then its coefficients stream into bema.json, summing to 1
        c = record["coefficients"]
        assert abs(sum(c.values()) - 1) < 1e-9
    # the shipped weights carry their provenance: rebuilt from it alone, bitwise
    v = run_bema("verify", out)
    assert v.returncode == 0 and "bitwise identical to its rebuild" in v.stdout, v.stderr
    # push --dry-run ships DIR as it is (the records under .bema-ship stay home)
    dry = run_bema("push", out, "--repo-id", "org/m", "--dry-run", "--json")
    names = {f["path"] for f in json.loads(dry.stdout)["files"]}
    assert "model.safetensors" in names and not any(n.startswith(".bema-ship") for n in names)


def test_steady_drift_ships_vanilla_and_says_so(runs, tmp_path):
    out = tmp_path / "model"
    doc, _ = ship(runs, "drift", out)
    assert doc["decision"]["kind"] == "vanilla" and doc["decision"]["step"] == 80
    assert "vanilla was the best on the 22 pick items" in doc["verdict"]
    assert "none of the averages scored on the report items (" in doc["verdict"]  # what was tested, named
    assert "beats vanilla beyond its interval there" in doc["verdict"]
    assert "18 report items: differences under " in doc["verdict"]  # what they can resolve
    from safetensors.torch import load_file

    written, raw = (
        load_file(out / "model.safetensors"),
        load_file(runs["drift"] / "checkpoint-80" / "model.safetensors"),
    )
    assert written.keys() == raw.keys() and all(
        (written[k] == raw[k]).all() for k in raw
    )  # the raw checkpoint
    text = (out / "README.md").read_text()
    assert "The raw checkpoint at step 80, selected by bema" in text and "| kappa |" not in text
    assert f"bema's decision: {doc['verdict']}." in text  # the card tells the verdict's story, word for word
    v = run_bema("verify", out)
    assert v.returncode == 0 and "bitwise identical to its rebuild" in v.stdout, v.stderr
    plain = run_bema("ship", runs["drift"], "--base", runs["base"], "--out", out, "--tasks", "loss",
                     "--loss-data", runs["data"], "--backend", "transformers")  # fmt: skip
    assert plain.returncode == 0 and "up to date" in plain.stderr
    lines = plain.stdout.strip().splitlines()  # the verdict, then a note per average that lags
    assert lines[0] == doc["verdict"] and all(x.startswith("note: ") for x in lines[1:]), plain.stdout
    assert lines[1:] == [f"note: {n}" for n in doc["notes"]]


def test_up_to_date_answers_only_the_same_request(runs, tmp_path):
    """A shipped DIR answers "up to date" to the request that made it; another --holdout (or another
    run) is refused naming what differs, and a garbled ship.json is one line, not a traceback."""
    out = tmp_path / "model"
    ship(runs, "drift", out, "--fit", "none")
    same, r = ship(runs, "drift", out, "--fit", "none")
    assert same["up_to_date"] is True and "up to date" in r.stderr
    from hub_standin import HubStandIn
    from test_push import hub_env

    with HubStandIn() as hub:  # the README's one-liner re-run with --push: it still pushes
        pushed = run_bema("ship", runs["drift"], "--base", runs["base"], "--out", out, "--tasks", "loss",
                          "--loss-data", runs["data"], "--backend", "transformers", "--fit", "none",
                          "--push", "org/m", "--json", env=hub_env(hub.url))  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        assert len(hub.repos["org/m"].commits) == 1
        assert json.loads(pushed.stdout)["pushed"]["revision_sha"] == hub.repos["org/m"].commits[0]["oid"]
    other = run_bema("ship", runs["drift"], "--base", runs["base"], "--out", out, "--tasks", "loss",
                     "--loss-data", runs["data"], "--backend", "transformers", "--fit", "none", "--holdout", "0.3")  # fmt: skip
    line = one_line_error(other)
    assert "another request (differs in: holdout" in line and "--overwrite" in line, line
    other = run_bema("ship", runs["noisy"], "--base", runs["base"], "--out", out, "--tasks", "loss",
                     "--loss-data", runs["data"], "--backend", "transformers", "--fit", "none")  # fmt: skip
    assert "differs in: inputs" in one_line_error(other)
    (out / ".bema-ship" / "ship.json").write_text("[]")
    line = one_line_error(run_bema("ship", runs["drift"], "--base", runs["base"], "--out", out, "--tasks", "loss",
                                   "--loss-data", runs["data"], "--backend", "transformers", "--fit", "none"))  # fmt: skip
    assert "ship.json: the ship's record changed since bema sealed it" in line, line


def test_a_killed_ship_resumes_evaluating_nothing_twice(runs, tmp_path):
    out = tmp_path / "model"
    first, _ = ship(runs, "drift", out, "--fit", "none")
    work = tmp_path / ".model.bema-ship"
    shutil.move(str(out / ".bema-ship"), str(work))  # killed before the final rename: records kept
    (work / "ship.json").unlink()
    shutil.rmtree(out)
    results = work / "race" / "loss" / "results.jsonl"  # one record per (candidate, slice of items)
    lines = results.read_text().splitlines(keepends=True)
    assert len(lines) > 8  # the race's rounds and the finalists' report items
    results.write_text("".join(lines[:-2]))  # and before its last two evaluations
    again, r = ship(runs, "drift", out, "--fit", "none")
    missing = sum(len(json.loads(x)["items"]["ids"]) for x in lines[-2:])
    assert again["race"]["evaluations"]["items"] == missing  # only the missing two slices, evaluated again
    assert len((out / ".bema-ship" / "race" / "loss" / "results.jsonl").read_text().splitlines()) == len(
        lines
    )
    assert again["verdict"] == first["verdict"] and again["decision"] == first["decision"]


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")
def test_the_shipped_folder_loads_in_vllm(runs, tmp_path):
    out = tmp_path / "model"
    ship(runs, "noisy", out, "--fit", "none")
    r = run_bema("eval", out, "--backend", "vllm", "--tasks", "loss", "--loss-data", runs["data"],
                 "--out", tmp_path / "eval", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    (record,) = json.loads(r.stdout)["records"]
    assert names(record["model_path"], out) and record["metrics"]["loss"] > 0


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")
def test_a_fit_is_served_by_a_vllm_engine_core_in_its_own_process(runs, tmp_path):
    """The fits' vectors reach vLLM's engine core process by their typed key (scorer.FitKey, pickled
    across its RPC): each simplex trial is scored under its own weights, named `fit:<digest>`."""
    r = run_bema("ship", runs["noisy"], "--base", runs["base"], "--out", tmp_path / "m", "--tasks", "loss",
                 "--loss-data", runs["data"], "--backend", "vllm", "--dtype", "float32", "--fit", "simplex",
                 "--json", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["backend"] == "vllm" and doc["fitted"]["candidates"], doc.get("fitted")
    lines = (tmp_path / "m" / ".bema-ship" / "race" / "loss" / "results.jsonl").read_text().splitlines()
    scored: dict[str, dict] = {}  # each fit's NLL per item, over its records (a record per round)
    for rec in map(json.loads, lines):
        if rec["model_path"].startswith("fit:"):
            ids, nll = rec["items"]["ids"], rec["items"]["nll"]
            scored.setdefault(rec["model_path"], {}).update(zip(ids, nll, strict=True))
    assert len(scored) >= 2, sorted(scored)
    # distinct vectors, distinct weights: any two trials' summed NLLs on the items they share differ
    pairs = 0
    for a, b in itertools.combinations(scored, 2):
        shared = scored[a].keys() & scored[b].keys()
        if shared:
            pairs += 1
            assert sum(scored[a][i] for i in shared) != sum(scored[b][i] for i in shared), (a, b)
    assert pairs >= len(scored) - 1, pairs


def test_too_few_report_items_ship_vanilla_and_say_it_cannot_decide(runs, tmp_path):
    """A 4-record held-out file (2 report items): no interval is trusted, whatever the averages score."""
    from ship_runs import heldout

    few = heldout(tmp_path / "few.jsonl", n=4)
    r = run_bema("ship", runs["noisy"], "--base", runs["base"], "--out", tmp_path / "m", "--tasks", "loss",
                 "--loss-data", few, "--backend", "transformers", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["decision"]["kind"] == "vanilla" and "fewer than 10" in doc["decision"]["undecided"]
    assert "cannot decide on" in doc["verdict"] and "report item" in doc["verdict"]
    assert "give at least 20 held-out records at --holdout 0.5" in doc["verdict"], doc["verdict"]
    # nothing could ship, so no average is scored: vanilla on its 4 items, and said
    assert doc["race"]["survivors"] == ["vanilla"] and not doc.get("fitted"), doc["race"]
    # vanilla on its 4 items, theta0 on the 3 report items (the base note), nothing else: 8 candidates
    # before, and the fits
    assert doc["race"]["evaluations"]["items"] == 4 + 3 and doc["stages"]["swap"]["count"] <= 2, doc["stages"]
    assert "so the menu was not raced" in doc["verdict"] and "only vanilla is scored" in r.stderr, r.stderr
    dry = run_bema("ship", runs["noisy"], "--base", runs["base"], "--out", tmp_path / "m2", "--tasks", "loss",
                   "--loss-data", few, "--backend", "transformers", "--fit", "none", "--dry-run", "--json")  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["evaluations"]["at_most"] == 4, dry.stdout


def test_records_are_sealed_and_no_fitted_model_is_kept(runs, tmp_path):
    """DIR/.bema-ship keeps the records and ship.json, never a fitted candidate (DIR is the shipped
    model); records edited by hand (two configs' scores swapped) are refused by --overwrite, not
    reused, and the edited ship.json is refused by a plain re-run."""
    out = tmp_path / "model"
    doc, _ = ship(runs, "noisy", out)
    work = out / ".bema-ship"
    assert doc["fitted"]["candidates"] and not (work / "fit" / "models").exists()
    assert (work / "seal.json").is_file()
    results = work / "race" / "loss" / "results.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    first: dict = {}  # each candidate's first record: a config's is the first round of pick items
    for n, row in enumerate(rows):
        first.setdefault(row["candidate"], n)
    i, j = list(first.values())[1:3]  # vanilla's first is every pick item at once: two configs'
    assert rows[i]["items"]["ids"] == rows[j]["items"]["ids"]  # two configs' first round
    rows[i]["items"], rows[j]["items"] = rows[j]["items"], rows[i]["items"]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_bema("ship", runs["noisy"], "--base", runs["base"], "--out", out, "--tasks", "loss",
                 "--loss-data", runs["data"], "--backend", "transformers")  # fmt: skip
    line = one_line_error(r)  # a plain re-run cannot answer from edited records
    assert f"{results}: the ship's record changed since bema sealed it" in line, line
    r = run_bema("ship", runs["noisy"], "--base", runs["base"], "--out", out, "--tasks", "loss",
                 "--loss-data", runs["data"], "--backend", "transformers", "--overwrite", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr  # --overwrite: the edited records are not reused; decided afresh
    assert "its records are not reused; deciding afresh" in r.stderr and "resuming" not in r.stderr
    again = json.loads(r.stdout)
    assert (
        again["verdict"] == doc["verdict"] and again["decision"] == doc["decision"]
    )  # the swap changed nothing


def test_a_stale_work_folder_says_overwrite_and_overwrite_starts_afresh(runs, tmp_path):
    """An interrupted ship's records made with another setup: the refusal names ship's own fix
    (--overwrite, not eval's --force), and --overwrite is not blocked by them."""
    out = tmp_path / "model"
    ship(runs, "drift", out, "--fit", "none")
    work = tmp_path / ".model.bema-ship"
    shutil.move(str(out / ".bema-ship"), str(work))  # killed before the final rename
    (work / "ship.json").unlink()
    shutil.rmtree(out)
    args = ["ship", runs["drift"], "--base", runs["base"], "--out", out, "--tasks", "loss",
            "--loss-data", runs["data"], "--backend", "transformers", "--fit", "none", "--loss-samples", "30"]  # fmt: skip
    line = one_line_error(run_bema(*args))
    assert f"{work}: records of an earlier, interrupted ship made with another setup" in line, line
    assert "--overwrite starts this one afresh" in line and "--force" not in line.split("(")[0]
    r = run_bema(*args, "--overwrite", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["decision"]["kind"] in ("vanilla", "menu", "fitted") and not work.exists()


def test_what_a_killed_ship_left_half_written_is_removed(runs, tmp_path):
    """SIGKILL runs no cleanup: the next ship removes dead processes' staging folders beside DIR, and
    puts back a DIR that was moved aside between place()'s two renames."""
    out = tmp_path / "model"
    dead = 2**22 + 12345  # above pid_max's default: no such process
    stale = [tmp_path / f".bema-tmp-ship-{dead}-model"]
    for folder in stale:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    ship(runs, "drift", out, "--fit", "none")
    assert not any(p.exists() for p in stale)
    old = tmp_path / f".bema-tmp-old-{dead}-model"
    out.rename(old)  # killed after moving the old DIR aside, before the new one came in
    doc, r = ship(runs, "drift", out, "--fit", "none")
    assert out.is_dir() and not old.exists() and doc.get("up_to_date") is True, r.stderr


def test_loss_data_without_tasks_decides_on_loss_and_generates_nothing(runs, tmp_path):
    """`bema ship RUN --loss-data F` (no --tasks): offline there is no gsm8k data, and none is needed."""
    r = run_bema("ship", runs["drift"], "--base", runs["base"], "--out", tmp_path / "m", "--loss-data",
                 runs["data"], "--backend", "transformers", "--fit", "none", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["metric"] == "loss" and "generate" not in doc["stages"]
    records = (tmp_path / "m" / ".bema-ship" / "race" / "loss" / "results.jsonl").read_text().splitlines()
    assert {json.loads(x)["task"] for x in records} == {"loss"}


def test_max_evaluations_stops_the_race_and_says_so(runs, tmp_path):
    """--max-evaluations N: the menu's race stops before it would pass N (candidate, item) pairs, the
    fits are not searched, and the verdict says where it stopped; without it the race runs on."""
    doc, _ = ship(runs, "noisy", tmp_path / "m", "--max-evaluations", "60")
    race = doc["race"]
    # vanilla always runs on its 22 pick items; each later candidate on 22, or fewer when the race
    # dropped it; the race stops before the next candidate could pass 60 pairs
    scored = len(race["survivors"]) + len(race["dropped"])
    pairs = 22 * len(race["survivors"]) + sum(d["after"] for d in race["dropped"].values())
    assert race["stopped"].startswith(f"--max-evaluations 60 reached after {scored} of 8 candidates"), race
    assert scored >= 2 and pairs <= 60 < pairs + 22, race
    assert race["pick_items_seen"] == 22
    assert (
        race["evaluations"]["items"] <= 2 * 22 + 3 * 18 + 18
    )  # those two, the finalists' and theta0's report items
    assert "fitted" not in doc and "--max-evaluations 60 reached" in doc["verdict"]
    full, _ = ship(runs, "noisy", tmp_path / "full")
    assert full["race"]["stopped"] is None and full["race"]["pick_items_seen"] == 22


def test_dry_run_says_the_budget_and_writes_nothing(runs, tmp_path):
    """--dry-run: evaluations at most (below the every-candidate-every-item design), a projected
    time, and the report items' MDD once earlier records exist; nothing evaluated or written."""
    out = tmp_path / "m"
    args = ["ship", runs["noisy"], "--base", runs["base"], "--out", out, "--tasks", "loss", "--loss-data",
            runs["data"], "--backend", "transformers", "--dry-run"]  # fmt: skip
    r = run_bema(*args, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    ev = doc["evaluations"]
    assert doc["items"] == {"pick": 22, "report": 18, "other_tasks": 0}
    # 8 candidates (7 configs, vanilla) and 12 fit trials (the simplex: loss's default fit) at most on
    # the pick items, 3 finalists on the report items; before: every one (and the fit) on every item
    assert ev["at_most"] == (8 + 12) * 22 + 3 * 18 < ev["exhaustive_design"] == (8 + 12 + 1) * 40
    both = json.loads(run_bema(*args, "--json", "--fit", "soup,simplex").stdout)["evaluations"]  # +10 soups
    assert both["at_most"] == (8 + 22) * 22 + 3 * 18 and both["exhaustive_design"] == (8 + 22 + 2) * 40
    assert doc["projection"]["seconds"] > 0 and doc["mdd"]["value"] is None  # loss: no spread known yet
    assert list(tmp_path.iterdir()) == []  # nothing written beside DIR either
    # can averaging help? the motion measured by one read of the run, before any engine starts
    measured = doc["motion_verdict"]
    assert doc["motion_from"].endswith("GB read") and measured["window"] == 4  # 8 checkpoints: the last half
    shipped, _ = ship(runs, "noisy", out)
    # the ship's own walk measured it too (kept with the records); a dry run after it reads that record
    assert shipped["motion_verdict"] == pytest.approx(measured, rel=1e-5)
    r = run_bema(*args, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert "18 report items resolve differences of " in r.stdout and "nats/token and up" in r.stdout
    assert (
        f"the last 4 checkpoints still move: {measured['last_window']:.2g} of the weights' norm" in r.stdout
    )
    again = json.loads(run_bema(*args, "--overwrite", "--json").stdout)
    assert again["motion_from"] == str(out / ".bema-ship" / "motion.json")


def test_allow_gaps_is_recorded_in_the_shipped_folder_and_theta0_is_the_base(runs, tmp_path):
    """A run whose middle checkpoint is gone ships with --allow-gaps (it failed at the write before),
    and says so in bema.json and the card; a vanilla or an average names the run's theta0, the base."""
    run = tmp_path / "run"
    shutil.copytree(runs["noisy"], run)
    steps = sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))
    shutil.rmtree(run / f"checkpoint-{steps[len(steps) // 2]}")
    out = tmp_path / "model"
    r = run_bema("ship", run, "--base", runs["base"], "--out", out, "--tasks", "loss", "--loss-data", runs["data"],
                 "--backend", "transformers", "--allow-gaps", "--fit", "none")  # fmt: skip
    assert r.returncode == 0, r.stderr
    record = json.loads((out / "bema.json").read_text())
    assert record["allow_gaps"] is True and names(record["theta0_source"], runs["base"])
    # nothing of the machine in what a push sends, nor in the records kept in DIR/.bema-ship (an
    # `hf upload DIR` sends them too): the race's results, the request, the motion, ship.json
    for file in (p for p in out.rglob("*") if p.is_file()):
        data = file.read_bytes()
        assert str(tmp_path).encode() not in data and str(runs["root"]).encode() not in data, file
        assert str(runs["base"]).encode() not in data, file
    assert (out / ".bema-ship" / "request.json").is_file() and (out / ".bema-ship" / "motion.json").is_file()
    assert "| allow gaps | true" in (out / "README.md").read_text()


def test_megatrons_thinning_reaches_ship_and_sweep(runs, tmp_path):
    """--min-interval and --min-checkpoints on ship and sweep as on stabilize: the candidates, the
    fits' basis and the motion are the thinned run's (from the last step back, every 20 steps)."""
    args = ["--base", runs["base"], "--tasks", "loss", "--loss-data", runs["data"], "--backend", "transformers",
            "--dry-run", "--json", "--min-interval", "20"]  # fmt: skip
    r = run_bema("ship", runs["noisy"], "--out", tmp_path / "m", *args)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # 4 kept checkpoints (20, 40, 60, 80): the soup's ingredients are the menu and them, minus one
    assert doc["step"] == 80 and doc["candidates"]["fit_trials_at_most"] == 12  # loss: the simplex alone
    r = run_bema("ship", runs["noisy"], "--out", tmp_path / "m", *args, "--fit", "soup,simplex")
    assert json.loads(r.stdout)["candidates"]["fit_trials_at_most"] == 8 + 4 - 2 + 12, r.stderr
    r = run_bema("sweep", runs["noisy"], "--out", tmp_path / "s", *args, "--method", "ema", "--at", "all")
    assert r.returncode == 0, r.stderr
    assert (
        sorted({rec["step"] for rec in json.loads(r.stdout)["records"]}) == []
    )  # a dry run evaluates nothing
    assert json.loads(r.stdout)["pending"] == 4 * 2  # vanilla and ema at 20, 40, 60, 80
    r = run_bema("ship", runs["noisy"], "--out", tmp_path / "m", *args, "--min-checkpoints", "5")
    assert r.returncode != 0 and one_line_error(r) and "--min-checkpoints" in r.stderr, r.stderr


def test_a_refused_ship_leaves_no_work_folder_and_the_corrected_one_runs(runs, tmp_path):
    """A ship refused before any record (a held-out file of one record: --holdout leaves a side empty;
    a generation task with no data) leaves no `.DIR.bema-ship` behind, so the corrected command is not
    refused as "an earlier, interrupted ship made with another setup" (exit 4, before); a work folder
    such a ship left holding its request alone is not a resume either."""
    out, work = tmp_path / "model", tmp_path / ".model.bema-ship"
    one = tmp_path / "one.jsonl"
    one.write_text(Path(runs["data"]).read_text().splitlines()[0] + "\n")
    common = [
        "ship",
        runs["drift"],
        "--base",
        runs["base"],
        "--out",
        out,
        "--backend",
        "transformers",
        "--fit",
        "none",
    ]
    refused = run_bema(*common, "--tasks", "loss", "--loss-data", one)
    assert refused.returncode == 2 and "--holdout" in one_line_error(refused), refused.stderr
    assert not work.exists() and not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = run_bema(*common, "--tasks", "loss,gsm8k", "--loss-data", runs["data"], "--data-dir", empty)
    assert refused.returncode == 3 and not work.exists(), refused.stderr
    work.mkdir()  # what a ship killed before its first record left (its request, nothing else)
    (work / "request.json").write_text('{"digest": "another"}\n')
    r = run_bema(*common, "--tasks", "loss", "--loss-data", runs["data"], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["decision"]["step"] == 80 and not work.exists()


def test_overwrite_replaces_only_what_bema_wrote(runs, tmp_path):
    """A user's notes.txt and my-evals/r.jsonl inside a shipped DIR: `ship --overwrite` decides again
    and replaces the model, and both files are still there, byte for byte, and said on stderr (they
    were deleted without a word)."""
    out = tmp_path / "model"
    ship(runs, "drift", out, "--fit", "none")
    (out / "notes.txt").write_text("my notes\n")
    (out / "my-evals").mkdir()
    (out / "my-evals" / "r.jsonl").write_text('{"acc": 1}\n')
    doc, r = ship(runs, "drift", out, "--fit", "none", "--overwrite", "--holdout", "0.4")
    assert doc["request"]["holdout"] == 0.4 and json.loads((out / "bema.json").read_text())["step"] == 80
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert (out / "my-evals" / "r.jsonl").read_text() == '{"acc": 1}\n'
    assert "kept 2 file(s) bema did not write: my-evals/r.jsonl, notes.txt" in r.stderr, r.stderr
    assert not list(tmp_path.glob(".bema-tmp-*"))
    v = run_bema("verify", out)  # the user's files are not the model's: verify still agrees
    assert v.returncode == 0 and "its config and tokenizer files are as written" in v.stdout, (
        v.stdout + v.stderr
    )


def test_a_foreign_line_is_never_sealed_and_overwrite_always_starts_afresh(runs, tmp_path):
    """A line another process appends to the race's records while ship runs: the seal refuses it
    (records.seal, from what this process read and wrote: `results.unchanged`). Sealed into DIR by a
    bema before that, every `--overwrite` failed with exit 3 naming --overwrite as the remedy; it now
    sets the records aside and decides afresh."""
    from bema_cli.errors import InputError
    from bema_cli.eval.results import ResultsFile
    from bema_cli.publish import records

    work = tmp_path / "work"
    mine = ResultsFile(work / "race" / "loss")
    mine.write([{"run": "vanilla", "step": 80, "task": "loss", "model_path": "v"}])
    records.seal(work)  # what this process wrote: sealed
    with open(mine.path, "a") as f:
        f.write('{"run": "vanilla", "step": 80, "task": "loss", "model_path": "forged"}\n')
    with pytest.raises(InputError, match="changed while ship ran"):
        records.seal(work)
    out = tmp_path / "model"
    ship(runs, "drift", out, "--fit", "none")
    results = next((out / ".bema-ship" / "race").glob("*/results.jsonl"))
    line = json.loads(results.read_text().splitlines()[-1])
    with open(results, "a") as f:  # a record of the race's shape, not on its chain
        f.write(json.dumps({**line, "model_path": "foreign", "chain": "0" * 32}) + "\n")
    records.seal(out / ".bema-ship")  # sealed in, as the bema before sealed it
    said = []
    for _ in range(2):  # it failed three times in a row, exit 3, naming --overwrite
        doc, r = ship(runs, "drift", out, "--fit", "none", "--overwrite")
        assert doc["decision"]["step"] == 80
        said.append("deciding afresh (--overwrite)" in r.stderr)
    assert said == [True, False], said  # set aside once; the records made afresh are then reused
    assert all('"foreign"' not in p.read_text() for p in (out / ".bema-ship").rglob("*.jsonl"))


def test_a_ship_lists_its_run_once(runs, tmp_path, monkeypatch):
    """One listing of the run's checkpoints per ship: the menu's windows (no wider than the run), the
    plan and the dry run all read it (in-process, find_checkpoints counted where it is called)."""
    from typer.testing import CliRunner

    from bema_cli.cli import app
    from bema_cli.io import checkpoints

    prepare = importlib.import_module("bema_cli.stabilize.prepare")  # the module, not its function
    listed, real = [], checkpoints.find_checkpoints

    def counted(*args, **kwargs):
        listed.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "find_checkpoints", counted)
    monkeypatch.setattr(prepare, "find_checkpoints", counted)
    r = CliRunner().invoke(app, ["ship", str(runs["noisy"]), "--base", str(runs["base"]), "--out",
                                 str(tmp_path / "m"), "--loss-data", str(runs["data"]), "--backend",
                                 "transformers", "--dry-run", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert listed == [str(runs["noisy"])], listed


def test_a_loss_guard_is_foreseen_before_anything_is_scored(runs, tmp_path):
    """--metric gsm8k with held-out loss as its guard: the dry run says, before any evaluation, how
    often a model truly as good as vanilla passes that loss guard at its records and margin (the
    runs' few held-out records: rarely), with its levers and the spread it assumes."""
    from test_eval import write_data

    r = run_bema("ship", runs["noisy"], "--base", runs["base"], "--out", tmp_path / "m", "--loss-data",
                 runs["data"], "--tasks", "gsm8k,loss", "--metric", "gsm8k", "--data-dir",
                 write_data(tmp_path / "data"), "--backend", "transformers", "--json", "--dry-run")  # fmt: skip
    assert r.returncode == 0, r.stderr
    (g,) = json.loads(r.stdout)["guards"]
    records = len((runs["data"]).read_text().splitlines())
    assert g["task"] == "loss" and g["items"] == records and g["margin"] == 0.02, g
    assert g["equal_passes"] == pytest.approx(guard.pass_rate(records, 0.02, guard.LOSS_SPREAD), abs=1e-3)
    assert g["equal_passes"] < 0.8 and "sd 0.13 nats/token assumed" in g["said"], g
    assert f"warning: {g['said']}" in r.stderr


def test_a_dry_run_projects_from_what_this_machine_measured(runs, tmp_path):
    """A first dry run says its projection counts arithmetic alone (nothing measured on this
    machine yet); a ship keeps what it measured (its engine's start, a swap, a held-out record's
    forward), and the next dry run stands on those floors: its engine start is the measured one
    and its forwards are its evaluations at most times the measured record. (How close a projection
    comes to a ship's wall time is bench/bench_ship.py's: a timing, not a test.)"""
    cache = tmp_path / "cache"
    env = {**os.environ, "BEMA_CACHE": str(cache)}
    args = ["ship", runs["noisy"], "--base", runs["base"], "--out", tmp_path / "m", "--tasks", "loss",
            "--loss-data", runs["data"], "--backend", "transformers", "--dry-run"]  # fmt: skip
    first = json.loads(run_bema(*args, "--json", env=env).stdout)["projection"]
    assert first["measured_floors"] is None
    line = run_bema(*args, env=env).stdout
    assert "(no transformers run measured on this machine yet: it counts arithmetic alone" in line, line
    r = run_bema(*args[:-1], "--json", env=env)
    assert r.returncode == 0, r.stderr
    spent = json.loads(r.stdout)["stages"]
    ((key, kept),) = json.loads((cache / "timings.json").read_text()).items()
    assert key.startswith("transformers | ") and set(kept) == {"engine_start", "swap", "loss_record"}, kept
    assert kept["engine_start"] == pytest.approx(spent["engine_start"]["seconds"], abs=1e-5)
    assert kept["swap"] == pytest.approx(spent["swap"]["seconds"] / spent["swap"]["count"], abs=1e-5)
    # floors far above what arithmetic counts on this tiny model: the projection must be made of them
    slow = {k: v * 1000 for k, v in kept.items()}
    (cache / "timings.json").write_text(json.dumps({key: slow}))
    again = json.loads(run_bema(*args, "--overwrite", "--json", env=env).stdout)
    parts = again["projection"]["parts_seconds"]
    assert sorted(again["projection"]["measured_floors"]) == ["engine_start", "loss_record", "swap"]
    assert parts["engine_start"] == pytest.approx(slow["engine_start"], abs=0.05)
    assert parts["forward"] == pytest.approx(again["evaluations"]["at_most"] * slow["loss_record"], abs=0.05)
    jobs = again["candidates"]["menu"] + again["candidates"]["fit_trials_at_most"]
    assert parts["load"] >= jobs * slow["swap"], (parts, jobs, slow)
