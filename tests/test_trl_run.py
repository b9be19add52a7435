"""A user's own TRL run, end to end: a tiny model fine-tuned by TRL's `SFTTrainer` on conversational
prompt/completion rows (constant learning rate, a checkpoint every 5 steps), then `bema ship` on
TRL's output folder as TRL wrote it. bema's held-out loss is TRL's completion-only loss: each
record's summed NLL equals an independent float64 computation on the tokens TRL's own data
preparation gives (its `completion_mask`), with the same token counts."""

from __future__ import annotations

import json

import pytest
from conftest import run_bema

trl = pytest.importorskip("trl")  # the test extras install it (pyproject: test)
pytestmark = pytest.mark.slow  # a training run and a ship: the end-to-end suite (`make test-slow`)

TOLERANCE = 5e-5  # nats per record: bema's float32 forward against float64 (measured up to 1.0e-5)


def rows(lo: int, hi: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"count {i}"}],
             "completion": [{"role": "assistant", "content": f"{i} and {i + 1} and {i + 2}"}]}
            for i in range(lo, hi)]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    root = tmp_path_factory.mktemp("trl")
    heldout = rows(100, 124)
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout))
    args = SFTConfig(output_dir=str(root / "run"), per_device_train_batch_size=4, learning_rate=3e-3,
                     lr_scheduler_type="constant", max_steps=20, save_steps=5, save_only_model=True,
                     logging_steps=5, report_to=[], use_cpu=True, seed=0, bf16=False)  # fmt: skip
    trainer = SFTTrainer(model=str(tiny_model_dir), args=args, train_dataset=Dataset.from_list(rows(0, 60)),
                         eval_dataset=Dataset.from_list(heldout))  # fmt: skip
    trainer.train()
    # TRL's own data preparation: the tokens, and the labels its loss is taken on (-100: not scored)
    prepared = [(list(r["input_ids"]), [x != -100 for x in r["labels"]]) for r in trainer.eval_dataset]
    return {"root": root, "base": tiny_model_dir, "run": root / "run", "prepared": prepared}


def test_ship_on_a_trl_run_scores_trls_completion_only_loss(trained, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model"
    r = run_bema("ship", trained["run"], "--base", trained["base"], "--out", out, "--loss-data",
                 trained["root"] / "heldout.jsonl", "--backend", "transformers", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["decision"]["step"] == 20 and doc["verdict"].startswith("ship ")
    assert run_bema("verify", out).returncode == 0
    # vanilla's per-record NLL as bema scored it, from the race's records
    scored: dict[int, tuple[float, int]] = {}
    for line in (out / ".bema-ship" / "race" / "loss" / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("run") == "vanilla" and rec.get("step") == 20 and "items" in rec:
            items = rec["items"]
            scored.update(zip(items["ids"], zip(items["nll"], items["tokens"], strict=True), strict=True))
    assert len(scored) >= 20
    model = AutoModelForCausalLM.from_pretrained(trained["run"] / "checkpoint-20", dtype=torch.float64)
    for i, (nll, tokens) in scored.items():
        ids, mask = trained["prepared"][i]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], dim=-1)
        target = torch.tensor(ids[1:])
        take = torch.tensor(mask[1:], dtype=torch.bool)  # TRL's loss: the labelled (completion) tokens
        want = -logp[torch.arange(len(target)), target][take].sum().item()
        assert tokens == int(take.sum()), (i, tokens, int(take.sum()))
        assert abs(nll - want) < TOLERANCE, (i, nll, want)
