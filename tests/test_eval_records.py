"""Records that reproduce: the resume key refuses a differing re-run, --force replaces, torn lines
are cut, nonsense flags are usage errors, step-less models are labelled and reported."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from conftest import run_bema
from test_eval import read_jsonl, write_data

from bema_cli.errors import OutputError, UsageError
from bema_cli.eval import evaluate, protocol, resume
from bema_cli.eval.backends.base import EngineOptions

SMALL = dict(tasks=["gsm8k", "loss"], n_samples=2, max_new_tokens=4, limit=2, backend="transformers",
             log_samples=True)  # fmt: skip


@pytest.fixture(scope="module")
def first(tiny_model_dir, tmp_path_factory):
    """One small evaluation of a copy of the tiny model (gsm8k + loss), in-process."""
    root = tmp_path_factory.mktemp("records")
    data_dir = write_data(root / "data")
    model = root / "models" / "checkpoint-7"
    shutil.copytree(tiny_model_dir, model)
    config = evaluate.EvalConfig(out=str(root / "out"), data_dir=str(data_dir), loss_data=str(data_dir / "heldout.jsonl"),
                                 **SMALL)  # fmt: skip
    records = evaluate.run_eval([str(model)], None, config, EngineOptions())
    return {"root": root, "data": data_dir, "model": model, "config": config, "records": records}


def again(first, engine=EngineOptions(), **changes):
    config = evaluate.EvalConfig(**{**first["config"].__dict__, **changes})
    return evaluate.run_eval([str(first["model"])], None, config, engine)


def test_records_carry_the_resume_key(first):
    (gsm8k,) = [r for r in first["records"] if r["task"] == "gsm8k"]
    key = gsm8k["resume_key"]
    assert set(key) == {
        "protocol",
        "data_sha256",
        "chat_template",
        "seeds",
        "backend",
        "dtype",
        "max_model_len",
        "weights",
    }
    assert key["protocol"]["prompt_version"] == 1 and key["protocol"]["num_fewshot"] == 0
    assert (key["backend"], key["dtype"], key["chat_template"]) == (
        "transformers",
        "auto:checkpoint",
        "model",
    )
    assert gsm8k["dtype"] == "float32"  # auto: the checkpoint's own dtype, recorded as run
    assert gsm8k["batch_size"] == 8 and gsm8k["step"] == 7
    assert again(first) == first["records"]  # the same setup: nothing redone, the same records returned


@pytest.mark.parametrize(
    "changes, engine, named",
    [
        ({"seed": 1}, {}, "seeds.sampling 13337 -> 1"),
        ({"temperature": 0.5}, {}, "protocol.temperature 1.0 -> 0.5"),
        ({"cot": True}, {}, "protocol.cot False -> True"),
        ({"max_new_tokens": 5}, {}, "protocol.max_new_tokens 4 -> 5"),
        ({}, {"dtype": "bfloat16"}, "dtype auto:checkpoint -> bfloat16"),
        ({"backend": "vllm"}, {}, "backend transformers -> vllm"),
    ],
)
def test_a_differing_rerun_is_refused_naming_the_difference(first, changes, engine, named):
    results = first["root"] / "out" / "results.jsonl"
    before = results.read_bytes()
    with pytest.raises(OutputError) as err:
        again(first, EngineOptions(**engine), **changes)
    message = str(err.value)
    assert named in message and "--force" in message and "\n" not in message, message
    assert results.read_bytes() == before  # nothing written


def test_the_batch_size_changes_no_sample_and_resumes(first, tmp_path):
    """A prompt's samples come from its own seed (base.prompt_seed), whatever batch it runs in: the
    samples are identical at batch sizes 8, 5 and 3, so a re-run with another size resumes. A record
    of an older bema, whose key still holds a batch size, resumes too."""
    assert again(first, EngineOptions(batch_size=5)) == first["records"]  # nothing redone, nothing refused
    responses = {}
    for size in (8, 5, 3):
        config = evaluate.EvalConfig(
            **{**first["config"].__dict__, "out": str(tmp_path / f"b{size}"), "limit": 6}
        )
        evaluate.run_eval([str(first["model"])], None, config, EngineOptions(batch_size=size))
        lines = read_jsonl(tmp_path / f"b{size}" / "samples.jsonl")
        responses[size] = {x["doc_id"]: x["responses"] for x in lines}
    assert len(responses[8]) == 6 and len({tuple(v) for v in responses[8].values()}) > 1
    assert responses[8] == responses[5] == responses[3]
    results = tmp_path / "b8" / "results.jsonl"
    old = [{**r, "resume_key": {**r["resume_key"], "batch_size": 8}} for r in read_jsonl(results)]
    results.write_text("".join(json.dumps(r) + "\n" for r in old))
    config = evaluate.EvalConfig(**{**first["config"].__dict__, "out": str(tmp_path / "b8"), "limit": 6})
    again_records = evaluate.run_eval([str(first["model"])], None, config, EngineOptions(batch_size=3))
    assert [r["eval_id"] for r in again_records] == [r["eval_id"] for r in old]  # resumed, not redone


def test_chat_template_and_weights_are_in_the_key(first, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(OutputError, match=r"chat_template model -> file:sha256:"):
        again(first, chat_template_file=str(template))
    other = tmp_path / "checkpoint-7"  # same folder name, other weights: a copy evaluated, then retrained
    shutil.copytree(first["model"], other)
    config = evaluate.EvalConfig(
        **{**first["config"].__dict__, "out": str(tmp_path / "o"), "tasks": ["loss"]}
    )
    evaluate.run_eval([str(other)], None, config, EngineOptions())
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4)  # the last parameter's last value changes
    weights.write_bytes(bytes(data))
    with pytest.raises(OutputError, match=r"weights [0-9a-f]{32} -> [0-9a-f]{32}"):
        evaluate.run_eval([str(other)], None, config, EngineOptions())


def test_cli_refusal_is_one_line_and_force_replaces(first):
    out, results = first["root"] / "out", first["root"] / "out" / "results.jsonl"
    args = [first["model"], "--tasks", "gsm8k", "--data-dir", first["data"], "--backend", "transformers",
            "--n-samples", 2, "--max-new-tokens", 4, "--limit", 2, "--out", out, "--seed", 5]  # fmt: skip
    before = read_jsonl(results)
    proc = run_bema("eval", *args)
    assert proc.returncode == 4, proc.stderr
    (line,) = [x for x in proc.stderr.strip().splitlines() if x.startswith("error:")]
    assert "seeds.sampling 13337 -> 5" in line and "Traceback" not in proc.stderr
    proc = run_bema("eval", *args, "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    after = read_jsonl(results)
    assert len(after) == len(before)  # replaced, not appended
    (gsm8k,) = [r for r in after if r["task"] == "gsm8k"]
    assert gsm8k["seeds"]["sampling"] == 5 and gsm8k["resume_key"]["seeds"]["sampling"] == 5


def test_torn_final_lines_are_cut_on_resume(first, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(first["root"] / "out", out)
    results, samples = out / "results.jsonl", out / "samples.jsonl"
    for path in (results, samples):
        path.write_bytes(path.read_bytes()[:-25])  # a crash in the middle of the last write
    n_results = len(results.read_text().splitlines())
    args = [first["model"], "--tasks", "gsm8k,loss", "--data-dir", first["data"], "--backend", "transformers",
            "--loss-data", first["data"] / "heldout.jsonl", "--n-samples", 2, "--max-new-tokens", 4, "--limit", 2,
            "--out", out, "--log-samples"]  # fmt: skip
    proc = run_bema("eval", *args)
    assert proc.returncode == 0, proc.stderr
    assert f"{results}:{n_results}: cut off a torn final line" in proc.stderr.replace("\n", "")
    assert f"{samples}:" in proc.stderr
    records = read_jsonl(results)  # every line parses again
    assert sorted(r["task"] for r in records) == ["gsm8k", "loss"]
    # the copied OUT names the model by another tail of its path (inside the folder OUT shares with
    # it): the same weights, so the gsm8k record is this model's, renamed, not evaluated again
    assert {r["model_path"] for r in records} == {str(first["model"].relative_to(first["root"].parent))}, (
        records
    )
    assert all(json.loads(line) for line in samples.read_text().splitlines())


@pytest.mark.parametrize(
    "changes, engine, flag",
    [
        ({"n_samples": 0}, {}, "--n-samples"), ({"limit": 0}, {}, "--limit"),
        ({"max_new_tokens": 0}, {}, "--max-new-tokens"), ({"temperature": -1.0}, {}, "--temperature"),
        ({"temperature": math.nan}, {}, "--temperature"), ({}, {"batch_size": 0}, "--batch-size"),
        ({"tasks": []}, {}, "--tasks"), ({"tasks": ["lm_eval:"]}, {}, "--tasks"),
        ({"num_fewshot": -1}, {}, "--num-fewshot"), ({}, {"max_model_len": 0}, "--max-model-len"),
    ],
)  # fmt: skip
def test_nonsense_values_are_usage_errors(changes, engine, flag):
    config = evaluate.EvalConfig(**{**SMALL, **changes})
    with pytest.raises(UsageError, match=flag):
        protocol.validate(config, EngineOptions(**engine))


def test_nonsense_values_exit_2_on_the_cli(tiny_model_dir, tmp_path):
    for args in (["--n-samples", "0"], ["--tasks", ""], ["--temperature", "nan"]):
        proc = run_bema("eval", tiny_model_dir, "--backend", "transformers", *args, "--out", tmp_path / "o")
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.strip().splitlines()[-1].startswith("error: " + args[0]), proc.stderr
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_a_stepless_model_is_labelled_and_reported(first, tmp_path):
    model = tmp_path / "my-final-model"  # not checkpoint-<s>, no bema.json, no trainer_state.json
    shutil.copytree(first["model"], model)
    out = tmp_path / "out"
    config = evaluate.EvalConfig(**{**first["config"].__dict__, "out": str(out), "tasks": ["loss"]})
    (record,) = evaluate.run_eval([str(model), str(first["model"])], None, config, EngineOptions())[:1]
    assert (record["step"], record["label"], record["run"]) == (None, "my-final-model", "vanilla")
    proc = run_bema("report", out, "--json")
    assert proc.returncode == 0, proc.stderr
    loss = json.loads(proc.stdout)["tasks"]["loss"]["loss"]
    assert loss["references"] == {"my-final-model": {"value": record["metrics"]["loss"],
                                                     "stderr": record["metrics"]["loss_stderr"]}}  # fmt: skip
    assert loss["runs"]["vanilla"]["steps"] == [7]
    proc = run_bema("report", out, "--plot", tmp_path / "p.png", env={"COLUMNS": "200"})
    assert proc.returncode == 0 and "my-final-model (no step)" in proc.stdout, proc.stderr


def test_engine_errors_name_the_real_cause():
    """A pydantic ValidationError (how vLLM's ModelConfig refuses a setting) becomes its message, on one line."""
    from pydantic import BaseModel, ValidationError, model_validator

    from bema_cli.eval.backends.vllm_backend import cause

    class ModelConfig(BaseModel):
        max_model_len: int

        @model_validator(mode="after")
        def check(self):
            raise ValueError(
                "User-specified max_model_len (2048) is greater than the derived max_model_len "
                "(max_position_embeddings=512 in model's config.json)."
            )

    with pytest.raises(ValidationError) as err:
        ModelConfig(max_model_len=2048)
    assert str(err.value).splitlines()[0] == "1 validation error for ModelConfig"  # what used to be shown
    assert cause(err.value) == (
        "User-specified max_model_len (2048) is greater than the derived max_model_len "
        "(max_position_embeddings=512 in model's config.json)."
    )


def test_max_model_len_default_fits_the_model():
    from bema_cli.eval.backends.vllm_backend import default_max_model_len

    assert default_max_model_len({"max_position_embeddings": 512}) == 512
    assert default_max_model_len({"max_position_embeddings": 32768}) == 2048
    assert default_max_model_len({"n_positions": 1024}) == 1024  # GPT-2 style configs
    assert default_max_model_len({}) == 2048


def test_few_shot_prompts_come_from_the_shots_split(first, tmp_path):
    """--num-fewshot K: K items of <task>_shots.jsonl (the paper's selection formula, per subject for
    MMLU-HS) as user/assistant turns before each prompt, the same for every prompt."""
    from bema_cli.eval import data
    from bema_cli.eval.tasks import boolq, mmlu_hs
    from bema_cli.eval.tasks import common as scoring

    data_dir = tmp_path / "data"
    shutil.copytree(first["data"], data_dir)
    shots = [
        {"question": f"is shot {i} true", "passage": f"shot passage {i}", "answer": i % 3 == 0}
        for i in range(9)
    ]
    (data_dir / "boolq_shots.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shots))
    config = evaluate.EvalConfig(**{**first["config"].__dict__, "out": str(tmp_path / "o"), "tasks": ["boolq"],
                                    "data_dir": str(data_dir), "num_fewshot": 3})  # fmt: skip
    (record,) = evaluate.run_eval([str(first["model"])], None, config, EngineOptions())
    assert record["protocol"]["num_fewshot"] == 3
    picked = [shots[i] for i in data.select(9, 3, 37371)]
    for line in read_jsonl(tmp_path / "o" / "samples.jsonl"):
        positions = [line["prompt"].index(f"Passage: {s['passage']}") for s in picked]
        assert positions == sorted(positions)  # every picked shot, in order, before the item itself
        assert line["prompt"].count("Answer: true") + line["prompt"].count("Answer: false") >= 3
    assert [m["role"] for m in scoring.build_messages(boolq, shots[0], picked)] == [
        "user",
        "assistant",
    ] * 3 + ["user"]
    assert scoring.build_messages(boolq, shots[1], picked)[1]["content"] == boolq.shot_reply(picked[0])
    rows = [
        {"question": f"q{s}{i}", "subject": s, "choices": list("abcd"), "answer": i % 4}
        for s in "xy"
        for i in range(5)
    ]
    path = tmp_path / "mmlu_hs_shots.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_subject = data.load_shots(mmlu_hs, [path], 2, 37371)
    assert {s: [r["question"] for r in v] for s, v in by_subject.items()} == {
        s: [f"q{s}{i}" for i in data.select(5, 2, 37371)] for s in "xy"
    }
    with pytest.raises(OutputError, match="protocol.num_fewshot 3 -> 0"):  # part of the resume key
        evaluate.run_eval([str(first["model"])], None, evaluate.EvalConfig(**{**config.__dict__, "num_fewshot": 0}),
                          EngineOptions())  # fmt: skip


def test_swap_weights_are_cast_like_a_fresh_load(tiny_trained_dir):
    """The swap's weights iterator casts floating tensors to the engine dtype exactly as a fresh
    load's param.copy_ does (round to nearest even), and adds the tied output head."""
    import torch
    from safetensors.torch import load_file

    from bema_cli.eval.backends.vllm_swap import checkpoint_weights

    stored = load_file(str(tiny_trained_dir / "model.safetensors"))
    got = dict(checkpoint_weights(tiny_trained_dir, tied=True, dtype=torch.bfloat16))
    assert set(got) == set(stored) | {"lm_head.weight"}
    for name, tensor in stored.items():
        param = torch.empty_like(tensor, dtype=torch.bfloat16)
        param.copy_(tensor)  # what a fresh engine's weight_loader does with the file's tensor
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], param), name
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert dict(checkpoint_weights(tiny_trained_dir, tied=False)).keys() == stored.keys()  # no cast, no head


def test_swap_comparison_names_what_differs():
    from bema_cli.eval.backends.vllm_swap import compare

    same = {"logprobs": [-1.5, -2.0], "params": {"a": "x", "b": "y"}}
    assert compare(same, same) is None
    assert (
        compare(same, {**same, "logprobs": [-1.5, -2.001]})
        == "all parameters equal; probe logprobs differ by up to 0.001"
    )
    message = compare(same, {"logprobs": [-1.5, -2.0], "params": {"a": "x", "b": "z"}})
    assert message.startswith("parameter b (and 0 more) differs")


def test_max_model_len_is_in_the_vllm_resume_key(first):
    """vLLM refuses prompts longer than --max-model-len: records made with another value differ."""
    pytest.importorskip("vllm")
    config = evaluate.EvalConfig(**{**first["config"].__dict__, "backend": "vllm"})
    keys = [
        evaluate.Evaluation(config, EngineOptions(max_model_len=n)).inputs["gsm8k"].resume_key
        for n in (None, 512)
    ]
    assert resume.differences(keys[0], keys[1]) == ["max_model_len none -> 512"]
    assert evaluate.Evaluation(config, EngineOptions()).inputs["loss"].resume_key["max_model_len"] is None


def test_dtype_auto_is_the_checkpoints_dtype_on_every_backend(tmp_path, tiny_model_dir):
    """auto = config.json's dtype, else the weights' first floating dtype, else float32 (vLLM's own
    auto ran a float32 checkpoint in bfloat16 on CPU, transformers in float32)."""
    from bema_cli.eval.backends.base import resolve_dtype

    assert (
        resolve_dtype("auto", tiny_model_dir) == "float32"
        and resolve_dtype("float16", tiny_model_dir) == "float16"
    )
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (model / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert resolve_dtype("auto", model) == "bfloat16"
    (model / "config.json").write_text(json.dumps(config))  # no dtype named: the weights' own
    assert resolve_dtype("auto", model) == "float32"
