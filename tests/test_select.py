"""`bema select`: paired bootstrap intervals, ties, holdout, refusals; end to end on real eval records."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
from conftest import one_line_error, run_bema

from bema_cli.decide.metric import Metric, parse_metric
from bema_cli.decide.select import select, split
from bema_cli.errors import InputError, UsageError

GSM = Metric("gsm8k", "flexible", True)
PROTOCOL = {"task": "gsm8k", "limit": 60}


def record(run: str, step: int, scores, task: str = "gsm8k", **extra) -> dict:
    ids = list(range(len(scores)))
    return {"run": run, "step": step, "task": task, "metrics": {"accuracy_flexible": float(np.mean(scores))},
            "items": {"ids": ids, "flexible": [float(x) for x in scores], "strict": [float(x) for x in scores]},
            "protocol": PROTOCOL, "seeds": {"sampling": 0}, "n_samples": 4, "n_prompts": len(scores),
            "backend": "transformers", "dtype": "float32", "model_path": f"/x/{run}/checkpoint-{step}",
            "_where": f"results.jsonl ({run}@{step})", **extra}  # fmt: skip


def test_identical_and_shifted_configs_have_exact_intervals():
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 0.8, 50)
    doc = select(
        [record("vanilla", 100, base), record("same", 100, base), record("up", 100, base + 0.1)], GSM
    )
    rows = {c["run"]: c for c in doc["candidates"]}
    assert rows["same"]["vs_vanilla"] == {"value": 0.0, "low": 0.0, "high": 0.0}  # paired: no spread at all
    up = rows["up"]["vs_vanilla"]
    assert (
        up["value"] == pytest.approx(0.1)
        and up["low"] == pytest.approx(0.1)
        and up["high"] == pytest.approx(0.1)
    )
    assert doc["winner"]["run"] == "up" and rows["up"]["value"] == pytest.approx(base.mean() + 0.1)
    assert not rows["vanilla"]["tied_with_best"]  # 0.1 worse on every item: certainly not tied
    assert rows["up"]["vs_vanilla"] is not None and rows["vanilla"]["vs_vanilla"] is None
    # each value's own interval (the card's): around the value, identical for identical configs, and
    # far wider than the paired difference's (which is exact here)
    lo, hi = rows["vanilla"]["interval"]
    assert lo < rows["vanilla"]["value"] < hi and rows["same"]["interval"] == [lo, hi]
    assert hi - lo > 0.05 and doc["winner"]["interval"] == rows["up"]["interval"]


def test_intervals_cover_the_true_difference_about_95_percent_of_the_time():
    """300 simulated evaluations: per-item differences N(0.05, 0.2) on 60 items. A paired percentile
    bootstrap interval should contain 0.05 in about 95% of them (a little less at n = 60)."""
    rng = np.random.default_rng(1)
    hits = 0
    for trial in range(300):
        v = rng.uniform(0, 1, 60)
        a = v + rng.normal(0.05, 0.2, 60)
        doc = select([record("vanilla", 1, v), record("a", 1, a)], GSM, resamples=500, seed=trial)
        d = next(c for c in doc["candidates"] if c["run"] == "a")["vs_vanilla"]
        hits += d["low"] <= 0.05 <= d["high"]
    assert 0.88 <= hits / 300 <= 0.99, hits


def test_ties_and_the_winner():
    """The best on the pick items, then the stated tie rule among those tied with it: vanilla, then
    the simplest config, then the later step. The winner is the first row."""
    rng = np.random.default_rng(2)
    v = rng.uniform(0, 1, 80)
    records = [
        record("vanilla", 10, v),
        record("close", 10, v + rng.normal(0.005, 0.05, 80)),  # within noise of the best
        record("best", 10, v + rng.normal(0.01, 0.05, 80)),
        record("bad", 10, v - 0.3),
    ]
    doc = select(records, GSM, seed=3)
    rows = {c["run"]: c for c in doc["candidates"]}
    best = max(rows, key=lambda r: rows[r]["picked_value"])
    assert best == "best" and rows["best"]["tied_with_best"] and rows["vanilla"]["tied_with_best"]
    assert not rows["bad"]["tied_with_best"] and rows["bad"]["vs_best"]["high"] < 0
    assert doc["winner"]["run"] == "vanilla"  # tied with the best: vanilla is preferred
    assert doc["candidates"][0]["run"] == "vanilla" and doc["candidates"][-1]["run"] == "bad"
    assert doc["verdict"].startswith("ship vanilla at step 10") and "tie_rule" in doc
    # vanilla clearly worse: among the tied averages the simplest (ema before wsm) wins
    noise = rng.normal(0.0, 0.05, 80)
    records = [
        record("vanilla", 10, v - 0.3),
        record("wsm-minus_sqrt-w4", 10, v + 0.011),
        record("ema-k0.5", 10, v + 0.010 + noise - noise.mean()),  # 0.001 worse on average, within noise
    ]
    doc = select(records, GSM, seed=3)
    rows = {c["run"]: c for c in doc["candidates"]}
    assert max(rows, key=lambda r: rows[r]["picked_value"]) == "wsm-minus_sqrt-w4"
    assert rows["ema-k0.5"]["tied_with_best"] and doc["winner"]["run"] == "ema-k0.5"
    assert doc["candidates"][0]["run"] == "ema-k0.5" and doc["winner"]["tied_with"] == ["wsm-minus_sqrt-w4"]
    assert doc["verdict"].startswith("ship ema-k0.5 at step 10: gsm8k:flexible ")
    assert "vs vanilla" in doc["verdict"] and "tied with wsm-minus_sqrt-w4" in doc["verdict"]
    # everything identical: vanilla, whatever the order the records came in
    same = [record(name, 10, v) for name in ("wsm-minus_sqrt-w8", "lawa-w4", "vanilla", "bema-k0.5-e0.2")]
    assert select(same, GSM)["winner"]["run"] == select(same[::-1], GSM)["winner"]["run"] == "vanilla"


def test_at_all_ties_go_to_the_later_step():
    v = np.linspace(0.1, 0.9, 40)
    records = [record("vanilla", 10, v), record("vanilla", 20, v), record("ema-k0.5", 20, v)]
    doc = select(records, GSM, at="all")
    assert (doc["winner"]["run"], doc["winner"]["step"]) == ("vanilla", 20)


def test_last_is_the_last_step_every_config_has_and_missing_configs_are_named():
    """An interrupted sweep: only vanilla reached step 120. `last` is the last step every config has;
    a step where some are missing is refused (named) unless --allow-missing."""
    v = np.linspace(0.1, 0.9, 40)
    records = [record(run, step, v + (0.05 if run != "vanilla" else 0)) for step in (40, 80)
               for run in ("vanilla", "ema-k0.5", "bema-k0.5-e0.2")] + [record("vanilla", 120, v)]  # fmt: skip
    doc = select(records, GSM)
    assert doc["winner"]["step"] == 80 and {c["step"] for c in doc["candidates"]} == {80}
    with pytest.raises(
        InputError,
        match=r"step 120 has no gsm8k:flexible record of 2 config\(s\).*bema-k0.5-e0.2, ema-k0.5.*--allow-missing",
    ):
        select(records, GSM, at="120")
    doc = select(records, GSM, at="120", allow_missing=True)
    assert doc["missing"] == ["bema-k0.5-e0.2", "ema-k0.5"] and doc["winner"]["run"] == "vanilla"


@pytest.mark.parametrize(
    "items, needle",
    [
        ({"flexible": [float("nan")] + [0.5] * 9}, "item 0's flexible score is nan"),
        ({"flexible": [float("-inf")] + [0.5] * 9}, "item 0's flexible score is -inf"),
        ({"flexible": ["0.5"] * 10}, "item 0's flexible score '0.5' is not a number"),
        ({"flexible": [0.5] * 9}, "items.flexible holds 9 scores for 10 ids"),
        ({"flexible": "0.5"}, "items.flexible holds str scores for 10 ids"),
        ({"ids": []}, "items.ids is not a non-empty list"),
    ],
)
def test_non_finite_or_malformed_item_scores_are_errors_never_winners(items, needle):
    good = record("ema-k0.5", 5, [0.4] * 10)
    bad = record("vanilla", 5, [0.5] * 10)
    bad["items"] = {**bad["items"], **items}
    with pytest.raises(InputError, match=re.escape(needle)):
        select([good, bad], GSM)


def test_mcnemar_is_exact_for_yes_no_items():
    """b = 9 items only A got right, c = 1 only B: p = 2 * P(X <= 1), X ~ Bin(10, 1/2) = 22/1024."""
    a = [1] * 9 + [0] + [1] * 20 + [0] * 10
    b = [0] * 9 + [1] + [1] * 20 + [0] * 10
    doc = select([record("vanilla", 1, b), record("ema-k0.5", 1, a)], GSM)
    row = next(c for c in doc["candidates"] if c["run"] == "ema-k0.5")
    assert row["vs_vanilla"]["mcnemar_p"] == pytest.approx(22 / 1024, rel=1e-12)
    assert (
        "mcnemar_p"
        not in select([record("vanilla", 1, [0.5] * 40), record("e", 1, [0.25] * 40)], GSM)["candidates"][1][
            "vs_vanilla"
        ]
    )  # fractions of samples: no McNemar


def test_holdout_picks_on_one_part_and_reports_on_the_rest():
    rng = np.random.default_rng(4)
    v = rng.uniform(0, 1, 200)
    records = [record("vanilla", 5, v), record("a", 5, v + 0.02)]
    pick, rest = split(list(range(200)), 0.5, seed=7)
    assert pick and rest and not pick & rest and pick | rest == set(range(200))
    assert split(list(range(200)), 0.5, seed=7) == (pick, rest) and split(list(range(200)), 0.5, 8) != (
        pick,
        rest,
    )
    doc = select(records, GSM, holdout=0.5, seed=7)
    assert doc["selection"]["picked_on"] == len(pick) and doc["selection"]["reported_on"] == len(rest)
    a = next(c for c in doc["candidates"] if c["run"] == "a")
    assert a["value"] == pytest.approx(
        np.mean([v[i] + 0.02 for i in sorted(rest)])
    )  # reported on the rest only
    assert "picked on" in doc["selection"]["note"]
    assert "optimistic" in select(records, GSM)["selection"]["note"]


def test_loss_is_the_token_weighted_ratio_and_lower_is_better():
    m = parse_metric("loss")
    assert not m.higher_is_better and parse_metric("gsm8k:strict").key == "strict"

    def loss(run, nll, tokens):
        return {**record(run, 3, [0.0] * len(nll), task="loss"),
                "items": {"ids": list(range(len(nll))), "nll": nll, "tokens": tokens}}  # fmt: skip

    doc = select([loss("vanilla", [10.0, 30.0], [10, 10]), loss("ema", [8.0, 28.0], [10, 10])], m)
    rows = {c["run"]: c for c in doc["candidates"]}
    assert rows["vanilla"]["value"] == pytest.approx(40 / 20) and rows["ema"]["value"] == pytest.approx(
        36 / 20
    )
    assert doc["winner"]["run"] == "ema"


def test_refusals():
    v = [0.5] * 10
    with pytest.raises(InputError, match=r"protocol\.limit differs"):
        select([record("vanilla", 1, v), {**record("a", 1, v), "protocol": {**PROTOCOL, "limit": 30}}], GSM)
    with pytest.raises(InputError, match="no record holds it"):
        select([record("vanilla", 1, v)], parse_metric("boolq"))
    with pytest.raises(UsageError, match="--at 7: no gsm8k:flexible record at step 7"):
        select([record("vanilla", 1, v)], GSM, at="7")
    old = record("vanilla", 1, v)
    del old["items"]
    with pytest.raises(InputError, match="no per-item scores"):
        select([old], GSM)
    with pytest.raises(UsageError, match="--metric"):
        parse_metric("gsm8k:loose")


@pytest.fixture(scope="module")
def evaluated_run(tiny_model_dir, tmp_path_factory):
    """A tiny real model, two noisy 'checkpoints', stabilized (bema, ema) and evaluated on held-out loss."""
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("select")
    base = root / "base"
    shutil.copytree(tiny_model_dir, base)
    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for step in (10, 20):
        folder = root / "run" / f"checkpoint-{step}"
        shutil.copytree(base, folder)
        noisy = {k: v + 0.02 * step / 10 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
        save_file(noisy, str(folder / "model.safetensors"), metadata={"format": "pt"})
    chat = [{"messages": [{"role": "user", "content": f"count {i}"}, {"role": "assistant", "content": f"{i} and {i + 1}"}]} for i in range(12)]  # fmt: skip
    (root / "heldout.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chat))
    stab = root / "stab"
    proc = run_bema("stabilize", root / "run", "--base", base, "--out", stab, "--method", "bema,ema")
    assert proc.returncode == 0, proc.stderr
    proc = run_bema("eval", root / "run" / "checkpoint-10", root / "run" / "checkpoint-20", stab, "--base", base,
                    "--tasks", "loss", "--loss-data", root / "heldout.jsonl", "--backend", "transformers",
                    "--out", root / "results")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return root


def test_select_end_to_end_and_write_the_winner(evaluated_run, tmp_path):
    root = evaluated_run
    proc = run_bema("select", root / "results", "--metric", "loss", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    records = [json.loads(x) for x in (root / "results" / "results.jsonl").read_text().splitlines()]
    at20 = {r["run"]: r["metrics"]["loss"] for r in records if r["step"] == 20 and r["task"] == "loss"}
    rows = {c["run"]: c for c in doc["candidates"]}
    assert set(rows) == {"vanilla", "bema-k0.5-e0.2", "ema-k0.5"} and doc["at"] == "last"
    for run, value in at20.items():  # the point values are the eval records' own metrics
        assert rows[run]["value"] == pytest.approx(value, rel=1e-12)
    assert doc["winner"]["run"] == min(at20, key=at20.get)
    plain = run_bema("select", root / "results", "--metric", "loss")
    assert plain.returncode == 0 and f"winner: {doc['winner']['run']} at step 20" in plain.stdout
    # --write: the winner's vector through the one writer (as ship writes): the float64 sum of its
    # recorded coefficients over the checkpoints, within one rounding of `bema stabilize --steps 20`
    out = tmp_path / "ship"
    proc = run_bema("select", root / "results", "--metric", "loss", "--write", out, "--json")
    assert proc.returncode == 0, proc.stderr
    written = json.loads(proc.stdout)["written"]
    # no --holdout: the number is the pick's own, and the verdict, so the card, says so
    card = (out / "README.md").read_text()
    assert (
        "(optimistic: the winner's curse" in doc["verdict"] and f"bema's decision: {doc['verdict']}." in card
    )
    plain = run_bema("select", root / "results", "--metric", "loss", "--write", tmp_path / "again")
    assert plain.returncode == 0, plain.stderr  # where it is now, not "--write DIR writes it"
    assert plain.stdout.strip().splitlines()[-1].endswith(f"(written to {tmp_path / 'again'})"), plain.stdout
    import torch
    from safetensors.torch import load_file

    got = load_file(out / "model.safetensors")  # DIR itself is the model folder
    coefficients = json.loads((out / "bema.json").read_text())["coefficients"]
    folders = {
        "theta0": root / "base",
        **{k: root / "run" / f"checkpoint-{k}" for k in coefficients if k != "theta0"},
    }
    inputs = {k: load_file(folders[k] / "model.safetensors") for k in coefficients}
    for name, tensor in got.items():
        if tensor.is_floating_point():
            want = sum(c * inputs[k][name].double() for k, c in coefficients.items()).to(tensor.dtype)
            assert torch.equal(tensor, want), name
    if doc["winner"]["run"] != "vanilla":
        method = doc["winner"]["stabilizer"]["method"]
        ref = tmp_path / "ref"
        flags = ["--method", method, "--steps", "20"]
        assert (
            run_bema("stabilize", root / "run", "--base", root / "base", "--out", ref, *flags).returncode == 0
        )
        theirs = load_file(ref / written["run"] / "checkpoint-20" / "model.safetensors")
        for name, tensor in got.items():
            if tensor.is_floating_point():  # float32 accumulation against float64: a few ulps
                assert torch.allclose(tensor, theirs[name], rtol=1e-6, atol=1e-7), name
    assert run_bema("verify", out).returncode == 0
    assert written["path"] == str(out) and not list(tmp_path.glob(".bema-tmp-*"))
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # from_pretrained(DIR) finds the weights
    text = (out / "README.md").read_text()
    assert str(root) not in text and "checkpoint-20" in text  # folder names, not absolute paths
    line = one_line_error(run_bema("select", root / "results", "--metric", "loss", "--write", out), 4)
    assert "already exists" in line
    for file in (p for p in out.iterdir() if p.is_file()):  # nothing of the machine, headers included
        assert str(root).encode() not in file.read_bytes(), file.name
    parsed = ModelCard.load(out / "README.md")
    (result,) = parsed.data.eval_results
    assert result.metric_type == "loss" and result.metric_value == pytest.approx(doc["winner"]["value"])
    lo, hi = doc["winner"]["interval"]
    assert lo < doc["winner"]["value"] < hi and f"95% CI {lo:.4g} to {hi:.4g}" in result.metric_name
    assert math.isfinite(result.metric_value)


def test_select_write_never_replaces_the_base_or_the_winners_checkpoint(evaluated_run):
    """--write onto theta0 (a model bema shipped earlier, so --overwrite would take it) or onto the
    winner's own checkpoint is refused up front, and both stay byte for byte."""
    root = evaluated_run
    marker = root / "base" / "bema.json"
    marker.write_text(json.dumps({"run": "ema-k0.5", "step": 40}))  # continuing from a shipped model
    try:
        for target in (root / "base", root / "run" / "checkpoint-20"):
            before = {p: p.read_bytes() for p in sorted(target.rglob("*")) if p.is_file()}
            r = run_bema("select", root / "results", "--metric", "loss", "--write", target, "--overwrite")
            line = one_line_error(r)
            assert f"--write {target.resolve()}: " in line and "apart from the inputs" in line, line
            assert {p: p.read_bytes() for p in sorted(target.rglob("*")) if p.is_file()} == before
    finally:
        marker.unlink()


def test_cli_refusals_are_one_line(evaluated_run):
    line = one_line_error(run_bema("select", evaluated_run / "results", "--metric", "gsm8k"))
    assert "--metric gsm8k:flexible: no record holds it" in line
    line = one_line_error(run_bema("select", evaluated_run / "results", "--at", "15"))
    assert "--at 15" in line and "steps: 0, 10, 20" in line


def test_at_all_ranks_every_step_against_vanilla_at_the_same_step():
    v1, v2 = np.full(20, 0.2), np.full(20, 0.6)
    records = [
        record("vanilla", 1, v1),
        record("a", 1, v1 + 0.1),
        record("vanilla", 2, v2),
        record("a", 2, v2 + 0.05),
    ]
    doc = select(records, GSM, at="all")
    rows = {(c["run"], c["step"]): c for c in doc["candidates"]}
    assert set(rows) == {("vanilla", 1), ("a", 1), ("vanilla", 2), ("a", 2)}
    assert rows[("a", 1)]["vs_vanilla"]["value"] == pytest.approx(0.1)  # against vanilla at step 1
    assert rows[("a", 2)]["vs_vanilla"]["value"] == pytest.approx(0.05)  # and at step 2
    assert (doc["winner"]["run"], doc["winner"]["step"]) == ("a", 2)
    assert select(records, GSM, at="1")["winner"]["step"] == 1


def test_select_write_of_a_vector_without_theta0_writes_and_verifies(evaluated_run, tmp_path):
    """A winner whose vector has no theta0 term (vanilla: the checkpoint itself) is written through
    the one writer with its card (it ended in KeyError 'theta0' when the card looked for theta0's
    folder), and verify rebuilds it bitwise."""
    from bema_cli import report
    from bema_cli.decide import select as sel
    from bema_cli.publish.write import write_winner

    _, records = report.load([str(evaluated_run / "results")])
    doc = sel.select(records, parse_metric("loss"), "last", None, 200, 0)
    row = next(c for c in doc["candidates"] if c["run"] == "vanilla")
    doc["winner"] = {k: row[k] for k in sel.WINNER_KEYS} | {"tied_with": []}
    out = tmp_path / "vanilla"
    write_winner(doc, records, out)
    written = json.loads((out / "bema.json").read_text())
    assert written["run"] == "vanilla" and written["coefficients"] == {"20": 1.0}
    assert run_bema("verify", out).returncode == 0


def test_a_data_file_named_by_another_tail_of_its_path_is_one_protocol():
    """Records name a data file inside the folder it shares with OUT (provenance.input_name): those
    kept from before OUT moved name it by a longer tail. That is one protocol; another file is not."""
    rng = np.random.default_rng(1)
    scores = rng.uniform(0, 1, 40)
    here = {**PROTOCOL, "data": "data/gsm8k.jsonl"}
    moved = {**PROTOCOL, "data": "proj/data/gsm8k.jsonl"}
    doc = select(
        [record("vanilla", 100, scores, protocol=here), record("ema", 100, scores, protocol=moved)], GSM
    )
    assert {c["run"] for c in doc["candidates"]} == {"vanilla", "ema"}
    other = {**PROTOCOL, "data": "data/other.jsonl"}
    with pytest.raises(InputError, match=r"protocol\.data differs"):
        select(
            [record("vanilla", 100, scores, protocol=here), record("ema", 100, scores, protocol=other)], GSM
        )


def test_a_vanilla_kept_by_the_tie_rule_is_not_called_the_winner(tmp_path):
    """lawa-w4 reads better than vanilla but is tied with it: the tie rule keeps vanilla, and the line
    says "kept: vanilla (tied)", not "winner: vanilla" beside a model that reads better."""
    rng = np.random.default_rng(3)
    base = (rng.random(40) < 0.5).astype(float)
    better = base.copy()
    better[:2] = 1.0  # two more right answers: better, not beyond the interval
    lines = [record("vanilla", 100, base), record("lawa-w4", 100, better)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = run_bema("select", tmp_path, "--metric", "gsm8k:flexible")
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last == "kept: vanilla (tied) at step 100", r.stdout


def test_select_says_ship_may_keep_another_model_where_other_tasks_would_guard():
    """select ranks on one metric; with records of another task beside it, the winner's note says
    that ship, which guards on that task, may keep another model on the same run (and a select of
    the metric's task alone says nothing of the kind)."""
    rng = np.random.default_rng(4)
    base = rng.uniform(0, 0.8, 60)
    mine = [record("vanilla", 100, base), record("up", 100, np.minimum(base + 0.3, 1.0))]
    other = [record("vanilla", 100, base, task="mmlu"), record("up", 100, base - 0.2, task="mmlu")]
    doc = select([*mine, *other], GSM)
    assert doc["winner"]["run"] == "up"
    (note,) = doc["notes"]
    assert note.startswith("select ranks on ") and "mmlu guard nothing here" in note
    assert "notes" not in select(mine, GSM)
