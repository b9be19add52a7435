"""`bema demo`: the generated tasks score correctly with bema eval's own rules, the output folder is
guarded, and `bema demo --quick` runs the whole pipeline through the real CLI."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest
from conftest import run_bema

import bema_cli
from bema_cli.demo import world
from bema_cli.eval.results import write_jsonl_atomic
from bema_cli.eval.tasks import get_task

TASKS = ("gsm8k", "boolq", "mmlu_hs")

# `bema demo --quick` (seed 0): the digest of theta0's and step 40's weights as recorded on
# 2026-11-26 (an AMD EPYC with AVX-512) with this software. Same software and seed, any x86-64
# CPU: the same bits (what the pins are for); other versions train other bits, so the check skips.
RECORDED_WITH = {
    "torch": "2.13.0+cpu",
    "transformers": "5.19.0",
    "tokenizers": "0.23.3",
    "accelerate": "1.15.0",
}
RECORDED_WEIGHTS = {"base": "cd0881bbf0610b5c", "sft/checkpoint-40": "d02f40a77369f211"}


def weights_digest(path) -> str:
    """sha256 over the tensors' names and raw bytes, in name order (not the file's header)."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(path), "pt") as f:
        for name in sorted(f.keys()):
            digest.update(name.encode())
            digest.update(f.get_tensor(name).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("task", TASKS)
def test_gold_reply_is_scored_right_and_other_items_reply_wrong(task):
    """The SFT target of each item parses, with the eval's rules, to that item's gold answer."""
    module = get_task(task)
    _, test = world.split_items(task, 0, 40, seed=3)
    hits = 0
    for record, other in zip(test, test[1:] + test[:1], strict=True):
        answer = module.extract_strict(world.reply(task, record))
        assert answer is not None and module.is_correct(answer, module.gold(record))
        other_answer = module.extract_strict(world.reply(task, other))
        hits += module.is_correct(other_answer, module.gold(record))
    assert hits < len(test)  # a reply is not right for every item: the scoring is per item


@pytest.mark.parametrize("task", TASKS)
def test_splits_are_disjoint_and_in_the_eval_schema(task, tmp_path):
    from bema_cli.eval import data

    train, test = world.split_items(task, 300, 50, seed=0)
    key = world._key
    assert len(test) == 50 and len({key(r) for r in test}) == 50
    assert not {key(r) for r in train} & {key(r) for r in test}
    path = tmp_path / f"{task}.jsonl"
    write_jsonl_atomic(path, test)
    docs = data.load_docs(get_task(task), [path], limit=50, seed=37371)  # bema eval's reader and checks
    assert sorted(map(key, docs)) == sorted(map(key, test))


def test_generated_answers_agree_with_the_world():
    rng = random.Random(0)
    owned, coins = world.belongings(), world.coins()
    for _ in range(100):
        record = world.count_item(rng)
        name = record["question"].split("How many coins does ")[1].split()[0]
        assert record["answer"].endswith(f"#### {coins[name]}")
        record = world.boolq_item(rng)
        _, name, _, _, color, obj = record["question"].split()
        assert record["answer"] == (owned[name.capitalize()] == (color, obj))
        record = world.mmlu_item(rng)
        if record["subject"] == "high_school_mathematics":
            a, b = record["question"].removeprefix("What is ").removesuffix("?").split(" + ")
            assert record["choices"][record["answer"]] == str(int(a) + int(b))


def test_chat_uses_the_eval_prompt():
    record = world.boolq_item(random.Random(1))
    messages = world.chat("boolq", record)
    assert messages[:-1] == get_task("boolq").messages(record)
    assert messages[-1] == {"role": "assistant", "content": world.reply("boolq", record)}


def test_the_demo_pins_mkl_to_a_branch_this_cpu_honours():
    """MKL_CBWR=AVX2, the first pin, is ignored on AMD CPUs (MKL then picks its kernels by CPU, and
    two VMs of one kind trained different weights); MKL itself says which branch it runs."""
    script = (
        "from bema_cli.demo.pins import pin_instruction_set; pin_instruction_set(); "
        "import torch; from bema_cli.machine import mkl_branch; print(mkl_branch())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.stdout.strip() == "COMPATIBLE", run.stderr


@pytest.mark.parametrize("own", [None, "AVX2"])
def test_the_mkl_pin_stays_in_training(own):
    """The demo's bema subprocesses (eval, ship: vLLM is not pinned, and 1.5x slower on COMPATIBLE)
    run without the MKL pin the demo set; a value the user set reaches them unchanged."""
    script = (
        "import os; from bema_cli.demo.pins import pin_instruction_set, subprocess_env; "
        "pin_instruction_set(); print(os.environ['MKL_CBWR'], subprocess_env(dict(os.environ)).get('MKL_CBWR'), "
        "subprocess_env(dict(os.environ))['ATEN_CPU_CAPABILITY'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")}
    env |= {"MKL_CBWR": own} if own else {}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    expected = f"{own} {own} avx2" if own else "COMPATIBLE None avx2"
    assert run.stdout.strip() == expected, run.stderr


@pytest.mark.parametrize("own", [None, "ACTIVE"])
def test_the_demo_threads_sleep_at_barriers_in_every_process(own):
    """On cores shared with other jobs, spinning OpenMP threads collapsed the demo (bench/bench_busy.py):
    `bema demo` makes them sleep, in its own training and in the bema subprocesses it runs; a policy
    the user set is theirs."""
    script = (
        "import os; from bema_cli.demo.pins import pin_instruction_set, subprocess_env; "
        "pin_instruction_set(); print(os.environ['OMP_WAIT_POLICY'], subprocess_env(dict(os.environ))['OMP_WAIT_POLICY'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | (
        {"OMP_WAIT_POLICY": own} if own else {}
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    expected = own or "PASSIVE"
    assert run.stdout.split() == [expected, expected], run.stderr


def test_refuses_a_folder_that_is_not_a_demo(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    result = run_bema("demo", "--quick", "--out", target)
    assert result.returncode == 4, result.stderr
    assert "not a bema demo folder" in result.stderr and str(target) in result.stderr
    assert [p.name for p in target.iterdir()] == ["notes.txt"]


def test_refuses_an_old_demo_without_overwrite(tmp_path):
    target = tmp_path / "demo"
    target.mkdir()
    (target / ".bema-demo").write_text("")
    (target / "results").mkdir()
    result = run_bema("demo", "--quick", "--out", target)
    assert result.returncode == 4
    assert "--overwrite" in result.stderr and (target / "results").is_dir()


@pytest.mark.slow  # 20-50 s on 2 cores: the whole pipeline through the real CLI
def test_quick_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = run_bema("demo", "--quick", "--out", out, "--json", timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)  # the one JSON document on stdout
    for command in ("$ bema stabilize", "$ bema eval", "$ bema report"):
        assert command in result.stderr
    # provenance: what two machines' numbers can differ by (versions, CPU, the pinned code paths)
    import torch

    environment = summary["environment"]
    assert environment["bema"] == bema_cli.__version__ and environment["torch"] == torch.__version__
    assert environment["pins"] == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "COMPATIBLE",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert environment["mkl_branch"] == "COMPATIBLE"  # what MKL ran, by its own account
    assert environment["train_threads"] == 2 and environment["cpu"] and environment["cpu_vector"]
    assert json.loads((out / "summary.json").read_text())["environment"] == environment

    # same software, same seed: the weights recorded on another machine, bit for bit
    from importlib.metadata import version

    if {name: version(name) for name in RECORDED_WITH} == RECORDED_WITH:
        trained = {name: weights_digest(out / name / "model.safetensors") for name in RECORDED_WEIGHTS}
        assert trained == RECORDED_WEIGHTS, (trained, environment)

    # fine-tuning checkpoints: every 10 steps, loadable model folders with a tokenizer
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "sft").glob("checkpoint-*"))
    assert steps == [10, 20, 30, 40]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / "sft" / "checkpoint-40" / name).is_file()
    assert (out / "base" / "model.safetensors").is_file()

    # stabilized runs at the evaluated steps, with their hyperparameters
    manifest = json.loads((out / "stabilized" / "manifest.json").read_text())
    runs = {r["run"]: r for r in manifest["runs"]}
    assert set(runs) == {"ema-k0.5", "bema-k0.5-e0.2", "bema-k0.5-e0.5", "lawa-w8", "wsm-minus_sqrt-w8"}
    for run in runs.values():
        assert [o["step"] for o in run["outputs"]] == [20, 40]
        meta = json.loads((out / "stabilized" / run["run"] / "checkpoint-40" / "bema.json").read_text())
        assert meta["method"] == run["method"] and meta["step"] == 40
    # the window (8) is larger than the quick run: the merge at step 40 is of the 4 checkpoints there are
    assert runs["lawa-w8"]["outputs"][-1]["members"] == 4
    assert runs["lawa-w8"]["outputs"][-1]["member_steps"] == [10, 20, 30, 40]

    # ship: the model folder to ship, decided on held-out loss (picked on half the records), with its card
    shipped = json.loads((out / "ship" / ".bema-ship" / "ship.json").read_text())
    assert shipped["decision"]["step"] == 40 and shipped["verdict"].startswith("ship ")
    written = json.loads((out / "ship" / "bema.json").read_text())  # DIR is the model the verdict names
    assert written["run"] == shipped["decision"]["run"] and "loss" in (out / "ship" / "README.md").read_text()
    assert "$ bema ship" in result.stderr

    # results: every (run, step, task), base as step 0 of each run
    records = [json.loads(line) for line in (out / "results" / "results.jsonl").read_text().splitlines()]
    got = {(r["run"], r["step"], r["task"]) for r in records}
    want = {
        (run, step, task) for run in ("vanilla", *runs) for step in (0, 20, 40) for task in (*TASKS, "loss")
    }
    assert got == want
    losses = {(r["run"], r["step"]): r["metrics"] for r in records if r["task"] == "loss"}
    assert len({m["tokens"] for m in losses.values()}) == 1  # every model scored on the same held-out tokens
    assert (
        losses[("vanilla", 40)]["loss"] < losses[("vanilla", 0)]["loss"]
    )  # training lowers the held-out loss
    for r in records:
        if r["task"] != "loss":
            m, draws = r["metrics"], r["n_prompts"] * r["n_samples"]
            assert r["n_samples"] == 2
            # a strictly correct sample is flexibly correct too (bema's own flexible rules; gsm8k's
            # is lm-eval's, which reads the last number even after a right `#### n`); whole samples
            if r["task"] != "gsm8k":
                assert m["accuracy_strict"] <= m["accuracy_flexible"]
            assert m["parse_failure_rate_flexible"] <= m["parse_failure_rate_strict"]
            for way in ("strict", "flexible"):
                assert m[f"accuracy_{way}"] * draws == pytest.approx(
                    round(m[f"accuracy_{way}"] * draws), abs=1e-9
                )
        assert r["is_base"] == (r["step"] == 0)

    # the printed summary is the results file
    for r in records:
        value = summary["loss" if r["task"] == "loss" else "accuracy"]
        value = value[r["run"]] if r["task"] == "loss" else value[r["task"]][r["run"]]
        metric = r["metrics"]["loss" if r["task"] == "loss" else "accuracy_flexible"]
        assert value[str(r["step"])] == pytest.approx(metric)
    assert summary["runs"][0] == "vanilla" and summary["steps"] == [0, 20, 40]

    # the plots decode
    import matplotlib.image

    image = matplotlib.image.imread(out / "curves.png")
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    image = matplotlib.image.imread(out / "summary.png")
    assert image.shape[:2] == (380, 1400)  # 14 x 3.8 inches at 100 dpi: the lag, the tail, gsm8k
    assert json.loads((out / "summary.json").read_text())["loss"] == summary["loss"]


@pytest.mark.slow  # a quick demo interrupted in fine-tuning, then continued: ~1-2 min on 2 cores
def test_an_interrupted_demo_keeps_its_finished_stages_and_a_rerun_continues(tmp_path):
    """Ctrl-C during fine-tuning (as soon as its first checkpoint is saved): the finished stages stay,
    the interrupted one leaves nothing half-made, and the same command continues from them."""
    import signal
    import subprocess
    import time

    from conftest import BEMA

    stages = ["data", "base", "finetune", "stabilize", "eval", "report", "ship"]
    folders = {"data": "data", "base": "base", "finetune": "sft"}
    out = tmp_path / "demo"
    proc = subprocess.Popen([str(BEMA), "demo", "--quick", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 600
    while (
        time.monotonic() < deadline and proc.poll() is None and not (out / "sft" / "checkpoint-10").exists()
    ):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    done = json.loads((out / ".bema-demo").read_text())["done"]
    assert done == stages[: len(done)] and "base" in done and "report" not in done, done
    for stage, folder in folders.items():  # a finished stage kept whole, the interrupted one removed
        assert (out / folder).exists() == (stage in done), (stage, done)
    base_bytes = (out / "base" / "model.safetensors").read_bytes()
    again = run_bema("demo", "--quick", "--out", out, "--json", timeout=1200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing the demo" in again.stderr and "(done earlier)" in again.stderr
    assert (out / "base" / "model.safetensors").read_bytes() == base_bytes  # not retrained
    assert json.loads((out / ".bema-demo").read_text())["done"] == stages


def test_other_stabilize_settings_keep_the_training_stages(tmp_path):
    """A demo trained with the same settings but stabilized/evaluated otherwise (e.g. by an older bema):
    its data, base and fine-tuning run are kept, everything after them starts over; other training
    settings are still refused."""
    from dataclasses import asdict, replace

    from bema_cli.demo.pipeline import MARKER, QUICK, prepare_out
    from bema_cli.errors import OutputError

    out = tmp_path / "demo"
    out.mkdir()
    old = {"config": asdict(replace(QUICK, etas=(0.3,))), "quick": True}
    done = ["data", "base", "finetune", "stabilize", "eval", "report"]
    (out / MARKER).write_text(json.dumps({"settings": old, "done": done}))
    for folder in ("sft", "base", "stabilized", "results"):
        (out / folder).mkdir()
    (out / "curves.png").write_bytes(b"png")
    doc = prepare_out(out, False, {"config": asdict(QUICK), "quick": True})
    assert doc["done"] == ["data", "base", "finetune"]
    assert (out / "sft").is_dir() and (out / "base").is_dir()
    assert (
        not (out / "stabilized").exists()
        and not (out / "results").exists()
        and not (out / "curves.png").exists()
    )
    assert json.loads((out / MARKER).read_text())["settings"]["config"]["etas"] == list(QUICK.etas)
    (out / MARKER).write_text(
        json.dumps({"settings": {"config": asdict(replace(QUICK, lr=1.0)), "quick": True}})
    )
    with pytest.raises(OutputError, match="other settings"):
        prepare_out(out, False, {"config": asdict(QUICK), "quick": True})
    assert (out / "sft").is_dir()  # nothing removed when refused


def test_the_quick_demo_says_it_only_checks_the_install(tmp_path, capfd):
    """40 steps learn nothing: the quick demo's accuracies of 0 and its 'ship vanilla' are not results."""
    from bema_cli.demo.summary import print_summary

    summary = {"runs": ["vanilla"], "steps": [40], "accuracy": {}, "loss": {"vanilla": {40: 1.5}}}
    print_summary({**summary, "quick": True}, tmp_path)
    assert (
        "quick demo: 40 fine-tuning steps check that the install works end to end" in capfd.readouterr().out
    )
    print_summary({**summary, "quick": False}, tmp_path)
    assert "quick demo" not in capfd.readouterr().out


def test_overwrite_refuses_a_demo_folder_holding_a_users_files(tmp_path):
    """--overwrite replaces a demo folder (its marker says so), never what a user put beside the
    demo's own entries: refused naming them, nothing deleted (exit 4; it was rmtree'd whole)."""
    target = tmp_path / "demo"
    target.mkdir()
    (target / ".bema-demo").write_text('{"settings": {}, "done": []}')
    (target / "results").mkdir()
    (target / "my-notes.md").write_text("mine")
    result = run_bema("demo", "--quick", "--out", target, "--overwrite")
    assert result.returncode == 4, result.stderr
    assert "my-notes.md" in result.stderr and "did not write" in result.stderr
    assert (target / "my-notes.md").read_text() == "mine" and (target / "results").is_dir()
