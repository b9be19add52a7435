"""`bema eval` / `bema rescore` end to end on the transformers backend (real CLI subprocesses).

Tiny local data files written here (never benchmark text), the tiny Qwen2 base model and
a fine-tuned copy. One shared evaluation run per module keeps the suite fast.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import names, run_bema

from bema_cli.eval import data
from bema_cli.eval.backends.base import SEED_RULE
from bema_cli.eval.tasks import get_task

LIMIT, N_SAMPLES = 2, 2  # small: the shared run must stay quick on 2 shared CPU cores
BEMA_META = {"bema_version": "0.1.0", "run": "bema_k0.5", "method": "bema", "preset": "paper", "kappa": 0.5,
             "eta": 0.2, "gamma": 1.0, "rho": 0.0, "tau": 0, "phi": 1, "beta_min": 0.0, "step": 20, "alpha": 0.5,
             "beta": 0.1, "source_checkpoint": "/x/checkpoint-20", "theta0_source": "/x/base",
             "accum_dtype": "float32", "out_dtype": "float32"}  # fmt: skip


def write_data(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = {
        "boolq": [{"question": f"does the cat {i} run", "passage": f"the cat {i} runs.", "answer": i % 2 == 0} for i in range(6)],
        "gsm8k": [{"question": f"what is {i} plus {i}", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(6)],
        "mmlu_hs": [{"question": f"pick {i}", "subject": s, "choices": ["a", "b", "c", "d"], "answer": i % 4}
                    for s in ("high_school_biology", "high_school_physics") for i in range(5)],
    }  # fmt: skip
    for name, items in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    loss = [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "the cat sees the dog"},
            ]
        },
        {"text": "the dog runs over the bird. 3 + 4 = 7"},
        {
            "messages": [
                {"role": "user", "content": "what is 2 plus 2"},
                {"role": "assistant", "content": "#### 4"},
            ]
        },
        # TRL's prompt-completion rows, standard and conversational: scored on the completion only
        {"prompt": "the cat sees", "completion": " the bird. 2 + 3 = 5"},
        {
            "prompt": [{"role": "user", "content": "what is 3 plus 4"}],
            "completion": [{"role": "assistant", "content": "3 + 4 = 7 #### 7"}],
        },
    ]
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in loss))
    return root


@pytest.fixture(scope="module")
def evaluated(tiny_model_dir, tiny_trained_dir, tmp_path_factory):
    """base + a raw checkpoint + a stabilize OUT dir (manifest) evaluated in one `bema eval` call."""
    root = tmp_path_factory.mktemp("eval")
    data_dir = write_data(root / "data")
    raw = root / "run" / "checkpoint-20"
    shutil.copytree(tiny_trained_dir, raw)
    stab = root / "stab"
    shutil.copytree(tiny_trained_dir, stab / "bema_k0.5" / "checkpoint-20")
    (stab / "bema_k0.5" / "checkpoint-20" / "bema.json").write_text(json.dumps(BEMA_META))
    manifest = {"bema_version": "0.1.0", "created": "now", "theta0_source": str(tiny_model_dir),
                "checkpoints": [{"step": 20, "path": str(raw)}],
                "runs": [{"run": "bema_k0.5", "method": "bema", "outputs": [{"step": 20, "path": "bema_k0.5/checkpoint-20", "alpha": 0.5, "beta": 0.1}]}]}  # fmt: skip
    (stab / "manifest.json").write_text(json.dumps(manifest))
    out = root / "out"
    args = [raw, stab, "--base", tiny_model_dir, "--data-dir", data_dir, "--loss-data", data_dir / "heldout.jsonl",
            "--backend", "transformers", "--n-samples", N_SAMPLES, "--max-new-tokens", 6, "--limit", LIMIT,
            "--out", out, "--log-samples"]  # fmt: skip
    proc = run_bema("eval", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    return {"root": root, "data": data_dir, "out": out, "raw": raw, "stab": stab, "args": args, "doc": doc,
            "records": doc["records"], "base": tiny_model_dir, "trained": tiny_trained_dir}  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_records_follow_the_contract(evaluated):
    records = evaluated["records"]
    assert records == read_jsonl(evaluated["out"] / "results.jsonl")  # --json prints what was written
    # (base x 2 runs + raw + stabilized) x 4 tasks
    assert len(records) == 16
    keys = {"bema_version", "created", "model_path", "run", "step", "stabilizer", "task", "metrics", "n_prompts",
            "n_samples", "backend", "dtype", "seeds", "protocol", "seconds", "is_base"}  # fmt: skip
    for r in records:
        assert keys <= set(r), keys - set(r)
        assert (r["backend"], r["dtype"]) == ("transformers", "float32")
    base = [r for r in records if r["is_base"]]
    assert {(r["run"], r["step"]) for r in base} == {("vanilla", 0), ("bema_k0.5", 0)}
    assert all(names(r["model_path"], evaluated["base"]) for r in base)
    # a model and a data file are named by their path inside the folder they share with --out, never
    # by a path of this machine (the records travel with OUT, and a ship's with the model it wrote)
    for file in ("results.jsonl", "samples.jsonl"):
        text = (evaluated["out"] / file).read_text()
        assert str(evaluated["root"]) not in text and str(evaluated["base"]) not in text, file
    assert {r["protocol"]["data"] for r in records if r["task"] == "loss"} == {"data/heldout.jsonl"}
    vanilla = [r for r in records if r["model_path"] == "run/checkpoint-20"]
    assert {(r["run"], r["step"]) for r in vanilla} == {("vanilla", 20)}
    assert all(r["stabilizer"] == {"method": "vanilla"} for r in vanilla)
    stabilized = [r for r in records if r["model_path"] == "stab/bema_k0.5/checkpoint-20"]
    assert {(r["run"], r["step"]) for r in stabilized} == {("bema_k0.5", 20)}
    assert stabilized[0]["stabilizer"]["kappa"] == 0.5 and stabilized[0]["stabilizer"]["method"] == "bema"
    assert all(r["stabilizer"]["eta"] == 0.2 for r in base if r["run"] == "bema_k0.5")
    by_task = {r["task"]: r for r in vanilla}
    assert {t: by_task[t]["n_prompts"] for t in by_task} == {
        "boolq": LIMIT,
        "gsm8k": LIMIT,
        "mmlu_hs": 2 * LIMIT,
        "loss": 5,
    }
    assert set(by_task["mmlu_hs"]["per_subject"]) == {"high_school_biology", "high_school_physics"}
    ways = ("strict", "flexible")
    assert set(by_task["gsm8k"]["metrics"]) == {
        f"{m}_{w}" for m in ("accuracy", "parse_failure_rate") for w in ways
    } | {f"accuracy_{w}_stderr" for w in ways}
    assert set(by_task["loss"]["metrics"]) == {"loss", "loss_stderr", "tokens"}
    assert by_task["gsm8k"]["seeds"] == {
        "sampling": 13337,
        "selection": 37371,
        "scheme": 2,
        "per_prompt": SEED_RULE,
    }
    protocol = by_task["boolq"]["protocol"]
    assert (
        protocol["n_samples"],
        protocol["max_new_tokens"],
        protocol["limit"],
        protocol["temperature"],
    ) == (N_SAMPLES, 6, LIMIT, 1.0)
    assert protocol["chat_template"] == "model"


def test_json_document_says_where_the_time_and_memory_went(evaluated):
    """`bema eval --json` is one document like sweep's: the records as results.jsonl holds them,
    and the run's stages (one engine start, a swap per model, generation and loss scoring), its
    seconds, its peak RSS split into bema's own and the engine processes' (none on transformers)."""
    doc = evaluated["doc"]
    assert doc["records"] == read_jsonl(evaluated["out"] / "results.jsonl")
    assert list(doc["stages"]) == ["engine_start", "swap", "generate", "loss"]
    assert sum(s["seconds"] for s in doc["stages"].values()) <= doc["seconds"]
    assert doc["stages"]["swap"]["bytes"] == 0 or doc["stages"]["swap"]["gb_per_s"] is not None
    memory = doc["memory"]
    assert memory["peak_rss"] == memory["peak_rss_bema"] + memory["peak_rss_engine"]
    assert memory["peak_rss_engine"] == 0 and memory["peak_rss_bema"] > 200e6  # torch and a model loaded
    assert doc["bema_version"] == evaluated["records"][0]["bema_version"]


def test_samples_and_records_agree(evaluated):
    """samples.jsonl holds each item's own gold and both extractions; the records are their means."""
    samples = read_jsonl(evaluated["out"] / "samples.jsonl")
    rows = {n: read_jsonl(evaluated["data"] / f"{n}.jsonl") for n in ("boolq", "gsm8k", "mmlu_hs")}
    records = {(r["model_path"], r["task"]): r for r in evaluated["records"]}
    groups: dict = {}
    for s in samples:
        task = get_task(s["task"])
        if s["task"] == "mmlu_hs":
            subject, index = s["doc_id"].split("/")
            row = [r for r in rows["mmlu_hs"] if r["subject"] == subject][int(index)]
        else:
            row = rows[s["task"]][int(s["doc_id"])]
        assert s["gold"] == task.gold(row)  # each prompt carries its own item's answer
        assert row["question"] in s["prompt"]
        assert len(s["responses"]) == N_SAMPLES
        for way in ("strict", "flexible"):
            extracted = [getattr(task, f"extract_{way}")(x) for x in s["responses"]]
            assert s[f"extracted_{way}"] == extracted
            assert s[f"correct_{way}"] == [
                a is not None and task.is_correct(a, task.gold(row)) for a in extracted
            ]
        groups.setdefault((s["model_path"], s["task"]), []).append(s)
    for (path, name), group in groups.items():
        if name != "mmlu_hs":  # the paper's subset: sorted RandomState(37371).choice(len, k)
            assert [int(s["doc_id"]) for s in group] == data.select(len(rows[name]), LIMIT, 37371)
        metrics = records[(path, name)]["metrics"]
        for way in ("strict", "flexible"):
            per_prompt = [np.mean(s[f"correct_{way}"]) for s in group]
            assert metrics[f"accuracy_{way}"] == pytest.approx(np.mean(per_prompt), abs=1e-12)
            assert metrics[f"accuracy_{way}_stderr"] == pytest.approx(
                np.std(per_prompt, ddof=1) / np.sqrt(len(group)), abs=1e-12
            )
            failures = np.mean([a is None for s in group for a in s[f"extracted_{way}"]])
            assert metrics[f"parse_failure_rate_{way}"] == pytest.approx(failures, abs=1e-12)


def test_loss_matches_independent_float64_computation(evaluated):
    """Reference: each record alone (no padding/batching), the model in float64, log-softmax by hand."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = evaluated["raw"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()

    def chat(messages, generation_prompt=False):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return tok(text, add_special_tokens=False).input_ids

    total, count, formats = 0.0, 0, set()
    for rec in read_jsonl(evaluated["data"] / "heldout.jsonl"):
        first = 1  # whole sequences: every token after the first; prompt-completion: the completion's
        if "messages" in rec:
            ids = chat(rec["messages"])
        elif "text" in rec:
            ids = tok(rec["text"]).input_ids
        elif isinstance(rec["prompt"], str):
            ids, first = tok(rec["prompt"] + rec["completion"]).input_ids, len(tok(rec["prompt"]).input_ids)
        else:
            ids, first = chat(rec["prompt"] + rec["completion"]), len(chat(rec["prompt"], True))
        assert first < len(ids) - 2  # the completion is there, and scored
        formats.add(next(iter(rec)) + ("-chat" if isinstance(rec.get("prompt"), list) else ""))
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0, :-1].double(), dim=-1)
        total -= float(logp.gather(1, x[0, 1:, None])[first - 1 :].sum())
        count += len(ids) - first
    assert formats == {"messages", "text", "prompt", "prompt-chat"}
    record = next(
        r for r in evaluated["records"] if r["model_path"] == "run/checkpoint-20" and r["task"] == "loss"
    )
    assert record["metrics"]["tokens"] == count
    # fp32 forward pass vs float64: agreement to 1e-5 relative
    assert record["metrics"]["loss"] == pytest.approx(total / count, rel=1e-5)
    base = next(r for r in evaluated["records"] if r["is_base"] and r["task"] == "loss")
    assert base["metrics"]["loss"] != pytest.approx(record["metrics"]["loss"], rel=1e-3)  # weights differ


def test_resume_skips_done_pairs_and_force_redoes_them(evaluated):
    results = evaluated["out"] / "results.jsonl"
    lines = read_jsonl(results)
    target = next(
        i for i, r in enumerate(lines) if r["task"] == "loss" and r["model_path"] == "run/checkpoint-20"
    )
    true_loss = lines[target]["metrics"]["loss"]
    lines[target]["metrics"]["loss"] = 999.0  # marks the record: kept if skipped, replaced if redone
    results.write_text("".join(json.dumps(r) + "\n" for r in lines))

    proc = run_bema("eval", *evaluated["args"])
    assert proc.returncode == 0, proc.stderr
    assert "skip" in proc.stderr and "all tasks in results.jsonl" in proc.stderr
    assert read_jsonl(results) == lines  # nothing re-run, nothing appended

    args = [a for a in evaluated["args"]]
    proc = run_bema("eval", evaluated["raw"], *args[2:], "--tasks", "loss", "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    after = read_jsonl(results)
    assert len(after) == len(lines)  # replaced, not duplicated
    redone = [r for r in after if r["task"] == "loss" and r["model_path"] == "run/checkpoint-20"]
    assert len(redone) == 1 and redone[0]["metrics"]["loss"] == pytest.approx(true_loss, rel=1e-6)


def test_rescore_reproduces_and_rescoring_hand_written_samples(evaluated, tmp_path):
    proc = run_bema("rescore", evaluated["out"] / "samples.jsonl", "--json")
    assert proc.returncode == 0, proc.stderr
    rescored = json.loads(proc.stdout)
    original = {
        (r["model_path"], r["run"], r["task"]): r for r in read_jsonl(evaluated["out"] / "results.jsonl")
    }
    assert len(rescored) == 12  # every generation record (base counted once per run)
    for r in rescored:
        assert r["metrics"] == original[(r["model_path"], r["run"], r["task"])]["metrics"]
        assert "rescored" in r

    lines = [{"model_path": "/m", "task": "gsm8k", "eval_id": "x", "doc_id": str(i), "gold": g, "responses": resp}
             for i, (g, resp) in enumerate([("2", ["#### 2", "so 2"]), ("5", ["#### 5", "#### 7"]), ("7", ["$7", "x"])])]  # fmt: skip
    lines.append({**lines[0], "responses": ["#### 9", "#### 9"]})  # a torn last line: skipped with a warning
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(x) + "\n" for x in lines)[:-9])
    out = tmp_path / "new.jsonl"
    proc = run_bema("rescore", samples, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert f"{samples}:4" in proc.stderr and "torn" in proc.stderr
    (record,) = read_jsonl(out)
    m = record["metrics"]
    assert m["accuracy_strict"] == pytest.approx(
        (0.5 + 0.5 + 0) / 3, abs=1e-12
    )  # "so 2", "$7" are not "#### n"
    assert m["parse_failure_rate_strict"] == pytest.approx(3 / 6, abs=1e-12)
    assert m["accuracy_flexible"] == pytest.approx((1 + 0.5 + 0.5) / 3, abs=1e-12)
    assert m["parse_failure_rate_flexible"] == pytest.approx(1 / 6, abs=1e-12)


def test_results_written_before_an_error_are_kept(evaluated, tmp_path):
    broken = tmp_path / "run" / "checkpoint-30"  # OUT apart from the run it evaluates
    shutil.copytree(evaluated["trained"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = tmp_path / "out"
    proc = run_bema("eval", evaluated["raw"], broken, "--backend", "transformers", "--tasks", "loss",
                    "--loss-data", evaluated["data"] / "heldout.jsonl", "--out", out)  # fmt: skip
    assert proc.returncode == 5, proc.stderr
    assert str(broken) in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()[-1]) < 400
    (record,) = read_jsonl(out / "results.jsonl")
    assert names(record["model_path"], evaluated["raw"]) and record["task"] == "loss"


def _bare(src: Path, dst: Path, drop: tuple[str, ...]) -> Path:
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink(missing_ok=True)
    return dst


def test_errors_are_one_line_with_exit_codes(evaluated, tmp_path):
    base, data_dir = evaluated["base"], evaluated["data"]
    common = ["--backend", "transformers", "--data-dir", data_dir, "--out", tmp_path / "o"]
    no_tok = _bare(
        base, tmp_path / "notok", ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    )
    no_weights = _bare(base, tmp_path / "noweights", ("model.safetensors",))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "boolq.jsonl").write_text(
        '{"question": "q", "passage": "p", "answer": true}\n{"question": "q", "passage": "p", "answer": "yes"}\n'
    )
    cases = [
        (["eval", base, *common, "--tasks", "boolq,nope"], 2, ["unknown task 'nope'"]),
        (["eval", no_tok, *common, "--tasks", "boolq"], 3, [str(no_tok), "no tokenizer"]),
        (["eval", no_weights, *common, "--tasks", "boolq"], 3, [str(no_weights), "no model.safetensors"]),
        (["eval", base, "--backend", "transformers", "--data-dir", bad, "--tasks", "boolq"], 3, [f"{bad / 'boolq.jsonl'}:2", "'answer'"]),
        (["eval", base, "--backend", "transformers", "--tasks", "gsm8k,boolq,mmlu_hs"], 3,
         ["gsm8k.jsonl", "openai/gsm8k", "boolq.jsonl", "google/boolq", "cais/mmlu"]),
        (["eval", base, *common, "--tasks", "loss"], 2, ["--loss-data"]),
    ]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    for args, code, needles in cases:
        proc = run_bema(*args, env=offline)
        assert proc.returncode == code, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error:"), proc.stderr
        for needle in needles:
            assert needle in last, (needle, last)
    assert (
        not (tmp_path / "o" / "results.jsonl").exists() or not (tmp_path / "o" / "results.jsonl").read_text()
    )


def test_expand_inputs_mixes_raw_stabilized_and_training_dirs(tmp_path):
    from bema_cli.eval.targets import base_target, expand_inputs

    def model(path: Path, meta: dict | None = None) -> Path:
        path.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (path / name).write_text("{}")
        if meta:
            (path / "bema.json").write_text(json.dumps(meta))
        return path

    for step in (10, 2):
        model(tmp_path / "train" / f"checkpoint-{step}")
    single = model(
        tmp_path / "ema" / "checkpoint-5", {**BEMA_META, "run": "ema_k1", "method": "ema", "step": 5}
    )
    targets = expand_inputs([str(tmp_path / "train"), str(single), str(tmp_path / "train" / "checkpoint-2")])
    assert [(t.path.name, t.run, t.step) for t in targets] == [
        ("checkpoint-2", "vanilla", 2),
        ("checkpoint-10", "vanilla", 10),
        ("checkpoint-5", "ema_k1", 5),
    ]  # deduplicated
    assert targets[2].stabilizer["method"] == "ema" and "alpha" not in targets[2].stabilizer
    base = base_target(str(tmp_path / "train" / "checkpoint-2"), targets)
    assert (base.step, base.is_base, [r for r, _ in base.runs]) == (0, True, ["vanilla", "ema_k1"])


def test_base_records_are_copied_for_a_run_new_to_the_results(evaluated, tmp_path):
    """The base is evaluated once: a later call that adds a run copies its base record, it does not regenerate."""
    ev, out = evaluated, tmp_path / "out"
    common = ["--base", ev["base"], "--data-dir", ev["data"], "--backend", "transformers", "--tasks", "gsm8k",
              "--n-samples", N_SAMPLES, "--max-new-tokens", 6, "--limit", LIMIT, "--out", out]  # fmt: skip
    first = run_bema("eval", ev["raw"], *common)
    assert first.returncode == 0, first.stderr
    second = run_bema("eval", ev["stab"], *common)
    assert second.returncode == 0, second.stderr
    base = {r["run"]: r for r in read_jsonl(out / "results.jsonl") if r["is_base"]}
    assert set(base) == {"vanilla", "bema_k0.5"}
    assert base["bema_k0.5"]["eval_id"] == base["vanilla"]["eval_id"]  # the same generation, copied
    assert base["bema_k0.5"]["metrics"] == base["vanilla"]["metrics"]
    assert base["bema_k0.5"]["stabilizer"]["method"] == "bema"
    assert f"gsm8k: {ev['base']}" not in second.stderr  # no second generation on the base


class OracleBackend:
    """Answers every prompt with the gold answer of the item it finds in the prompt (or of another item)."""

    name, dtype, template_source = "oracle", "float32", "model"

    def __init__(self, model_dir: Path, data_dir: Path, other: bool):
        from bema_cli.eval import chat

        self.tokenizer, _ = chat.load_tokenizer(model_dir)
        self.items = []  # (user message, answer text)
        formats = {"boolq": lambda g: f"Answer: {str(g).lower()}", "gsm8k": "#### {}".format,
                   "mmlu_hs": "Answer: {}".format}  # fmt: skip
        for name, fmt in formats.items():
            task, rows = get_task(name), read_jsonl(data_dir / f"{name}.jsonl")
            for i, row in enumerate(rows):
                gold = task.gold(row)
                if other:  # the next item (same subject for MMLU) whose gold differs
                    gold = next(task.gold(r) for r in rows[i + 1 :] + rows[:i]
                                if task.gold(r) != gold and r.get("subject") == row.get("subject"))  # fmt: skip
                self.items.append((task.messages(row)[0]["content"], fmt(gold)))

    def load(self, path):
        pass

    def generate(self, prompts, sampling, seeds):
        out = []
        for prompt in prompts:
            (answer,) = [a for text, a in self.items if text in prompt]
            out.append([answer] * sampling.n)
        return out

    def close(self):
        pass


@pytest.mark.parametrize("other, expected", [(False, 1.0), (True, 0.0)])
def test_oracle_backend_scores_exactly(tiny_model_dir, tmp_path, monkeypatch, other, expected):
    """Own gold: every sample right (1.0, nothing unparsed); another item's gold: every sample wrong (0.0)."""
    from bema_cli.eval import evaluate
    from bema_cli.eval.backends.base import EngineOptions

    data_dir = write_data(tmp_path / "data")
    monkeypatch.setattr(
        evaluate, "make_backend", lambda name, options: OracleBackend(tiny_model_dir, data_dir, other)
    )
    config = evaluate.EvalConfig(tasks=["boolq", "gsm8k", "mmlu_hs"], data_dir=str(data_dir), n_samples=3, limit=3,
                                 backend="transformers")  # fmt: skip
    records = evaluate.run_eval([str(tiny_model_dir)], None, config, EngineOptions())
    assert {r["task"]: r["n_prompts"] for r in records} == {"boolq": 3, "gsm8k": 3, "mmlu_hs": 6}
    for r in records:
        m = r["metrics"]
        assert (m["accuracy_strict"], m["accuracy_flexible"]) == (expected, expected), r["task"]
        assert (m["parse_failure_rate_strict"], m["parse_failure_rate_flexible"]) == (0.0, 0.0)
    subjects = next(r for r in records if r["task"] == "mmlu_hs")["per_subject"]
    assert {s: v["accuracy_strict"] for s, v in subjects.items()} == {
        "high_school_biology": expected,
        "high_school_physics": expected,
    }
