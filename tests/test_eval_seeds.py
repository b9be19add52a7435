"""Sampling seeds: one per (seed, task, prompt), on every backend.

The per-prompt standard error treats prompts as independent draws. That holds only when each
prompt's samples use their own random stream: with one seed for every request, sample j of
every prompt used the same random numbers (identical prompts gave identical lists). These tests
run the real backends on the tiny model: identical prompt texts with different seeds must give
different samples; a prompt's samples must not change with the batch size, the order or the
other prompts of the call; and the seeds must be recorded.
"""

from __future__ import annotations

import json

import pytest
from conftest import names, run_bema, vllm_available
from test_eval import read_jsonl, write_data

from bema_cli.eval.backends.base import SEED_RULE, EngineOptions, Sampling, prompt_seed

SAMPLING = Sampling(n=4, temperature=1.0, max_new_tokens=8)
TEXTS = ["hi", "hi", "the cat sees the dog", "what is 2 plus 2"]  # the first two are the same text


def test_prompt_seed_is_a_pure_function_of_seed_task_and_prompt():
    """Stable across processes (sha256, not Python's salted hash), distinct per input, 62 bits."""
    assert (
        prompt_seed(13337, "gsm8k", "0")
        == int.from_bytes(__import__("hashlib").sha256(b"13337/gsm8k/0").digest()[:8], "big") >> 2
    )
    seeds = {prompt_seed(s, t, d) for s in (1, 2) for t in ("boolq", "gsm8k") for d in ("0", "1", "b/0")}
    assert len(seeds) == 12 and all(0 <= s < 2**62 for s in seeds)


def _backend(name: str, model_dir, batch_size: int = 8):
    if name == "vllm":
        from bema_cli.eval.backends.vllm_backend import VllmBackend

        backend = VllmBackend(EngineOptions(dtype="auto"))  # auto: the checkpoint's float32, as transformers
    else:
        from bema_cli.eval.backends.transformers_backend import TransformersBackend

        backend = TransformersBackend(EngineOptions(dtype="auto", batch_size=batch_size))
    backend.load(model_dir)
    return backend


def _prompts(backend) -> list[str]:
    from bema_cli.eval.chat import render

    return [render(backend.tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]


BACKENDS = [
    "transformers",
    pytest.param(
        "vllm",
        marks=[pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")],
    ),
]


@pytest.mark.parametrize("name", BACKENDS)
def test_samples_are_independent_across_prompts_and_do_not_depend_on_the_call(name, tiny_model_dir):
    backend = _backend(name, tiny_model_dir)
    try:
        prompts = _prompts(backend)
        seeds = [prompt_seed(13337, "t", str(i)) for i in range(len(prompts))]
        assert backend.dtype == "float32" or name == "vllm" and backend.llm is None
        together = backend.generate(prompts, SAMPLING, seeds)
        assert backend.dtype == "float32"  # --dtype auto is the checkpoint's dtype on both backends
        assert all(len(samples) == SAMPLING.n for samples in together)
        # the same text under two prompts' seeds: two different lists (one shared seed made them equal)
        assert together[0] != together[1]
        # each prompt alone, and all of them in reverse order: the same samples
        alone = [backend.generate([p], SAMPLING, [s])[0] for p, s in zip(prompts, seeds, strict=True)]
        assert alone == together
        assert backend.generate(prompts[::-1], SAMPLING, seeds[::-1])[::-1] == together
        if name == "transformers":  # batches of one prompt instead of all four in one batch
            backend.options = EngineOptions(dtype="float32", batch_size=1)
            assert backend.generate(prompts, SAMPLING, seeds) == together
        # a prompt's seed decides its samples: another seed, other samples
        assert backend.generate(prompts[:1], SAMPLING, [seeds[0] + 1000])[0] != together[0]
    finally:
        backend.close()


def test_seeds_are_recorded_per_prompt_and_in_the_record(tiny_model_dir, tmp_path):
    """samples.jsonl carries each prompt's seed; the record names the rule and the scheme (a resume-key
    field: results made with the old one-seed-for-all scheme are refused, not mixed in)."""
    data = write_data(tmp_path / "data")
    out = tmp_path / "out"
    r = run_bema("eval", tiny_model_dir, "--backend", "transformers", "--data-dir", data, "--tasks", "boolq,gsm8k",
                 "--n-samples", 3, "--max-new-tokens", 4, "--limit", 4, "--seed", 7, "--out", out,
                 "--log-samples", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    for record in json.loads(r.stdout)["records"]:
        assert record["seeds"] == {"sampling": 7, "selection": 37371, "scheme": 2, "per_prompt": SEED_RULE}
        assert record["resume_key"]["seeds"] == record["seeds"]
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 8
    for s in samples:
        assert s["seed"] == prompt_seed(7, s["task"], s["doc_id"])
    # an earlier file made with the one-seed scheme is refused by name, not extended
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    for x in lines:
        x["resume_key"]["seeds"] = {"sampling": 7, "selection": 37371}
    (out / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    again = run_bema("eval", tiny_model_dir, "--backend", "transformers", "--data-dir", data, "--tasks", "boolq",
                     "--n-samples", 3, "--max-new-tokens", 4, "--limit", 4, "--seed", 7, "--out", out)  # fmt: skip
    assert again.returncode != 0 and "seeds.scheme" in again.stderr, again.stderr


def test_eval_without_out_keeps_its_results_in_a_named_folder(tiny_model_dir, tmp_path):
    """No --out: the results go to ./results/, said on the first stderr line (nothing is thrown away)."""
    data = write_data(tmp_path / "data")
    r = run_bema("eval", tiny_model_dir, "--backend", "transformers", "--data-dir", data, "--tasks", "boolq",
                 "--n-samples", 1, "--max-new-tokens", 2, "--limit", 1, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == "results go to ./results/ (the default; --out DIR chooses)"
    (record,) = read_jsonl(tmp_path / "results" / "results.jsonl")
    assert record["task"] == "boolq" and names(record["model_path"], tiny_model_dir)


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")
@pytest.mark.parametrize("verbose", [False, True])
def test_stderr_holds_bemas_own_lines_unless_verbose(tiny_model_dir, tmp_path, verbose):
    """vLLM's Triton and NUMA warnings and the like go to OUT/libraries.log; -v shows them on stderr."""
    data = write_data(tmp_path / "data")
    out = tmp_path / "out"
    r = run_bema(*(["-v"] if verbose else []), "eval", tiny_model_dir, "--backend", "vllm", "--data-dir", data,
                 "--tasks", "boolq", "--n-samples", 1, "--max-new-tokens", 2, "--limit", 1, "--out", out)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    noise = ("NUMA", "Triton", "Warning", "WARNING", "nanobind", "leaked")
    if verbose:
        assert any(word in r.stderr for word in noise), r.stderr
    else:
        lines = r.stderr.splitlines()
        assert lines[0].startswith("starting vLLM engine on") and lines[1].startswith("vLLM KV cache: "), (
            r.stderr
        )
        assert lines[2].startswith("[1/1] boolq: ") and lines[3].startswith("stages: engine_start "), r.stderr
        assert len(lines) == 4 and not any(word in r.stderr for word in noise), r.stderr
        assert any(word in (out / "libraries.log").read_text() for word in noise)
