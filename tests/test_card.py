"""The model card (README.md) of every checkpoint bema writes, read back with huggingface_hub's own parser."""

from __future__ import annotations

import json

from conftest import run_bema
from huggingface_hub import ModelCard
from trajectory import write_trajectory

from bema_cli import card


def test_every_stabilize_output_has_a_hub_model_card(tmp_path):
    base, run = write_trajectory(tmp_path, [10, 20, 30])
    config = json.loads((base / "config.json").read_text()) if (base / "config.json").exists() else {}
    (base / "config.json").write_text(json.dumps({**config, "_name_or_path": "Qwen/Qwen2.5-1.5B"}))
    out = tmp_path / "out"
    proc = run_bema("stabilize", run, "--base", base, "--out", out, "--method", "bema,lawa", "--window", "2")
    assert proc.returncode == 0, proc.stderr
    folders = sorted(out.glob("*/checkpoint-*"))
    assert len(folders) == 6
    for folder in folders:
        parsed = ModelCard.load(folder / "README.md")  # the Hub client's parser: YAML metadata + text
        record = json.loads((folder / "bema.json").read_text())
        assert parsed.data.library_name == "transformers"
        assert parsed.data.base_model == "Qwen/Qwen2.5-1.5B"  # theta0 is a local copy of a Hub model
        method_tag = [] if record["method"] == "bema" else [record["method"]]  # "bema" is there once
        assert parsed.data.tags == ["bema", *method_tag, "checkpoint-averaging"]
        text = parsed.text
        # the inputs by name (run/checkpoint-N, inside the folder the output shares with them), never
        # by the absolute local path: not in the card, bema.json or any weight file's header
        assert (
            record["source_checkpoint"] == f"run/checkpoint-{record['step']}"
            and record["theta0_source"] == "base"
        )
        assert f"at step {record['step']}" in text and f"`{record['source_checkpoint']}`" in text
        for file in folder.iterdir():
            assert str(tmp_path).encode() not in file.read_bytes(), file.name
        assert "2508.00180" in text
        if record["method"] == "lawa":
            assert "| window | `2` |" in text
        else:
            assert "| eta | `0.2` |" in text and "| kappa | `0.5` |" in text


def test_a_local_theta0_is_not_a_base_model_and_results_make_a_model_index(tmp_path):
    record = {"run": "bema-k0.5-e0.2", "method": "bema", "step": 100, "kappa": 0.5, "eta": 0.2,
              "theta0_source": str(tmp_path), "bema_version": "0.5.0"}  # fmt: skip
    assert card.hub_base_model(str(tmp_path), tmp_path) is None  # a local folder without a Hub name
    assert card.hub_base_model("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"
    evaluation = [
        {
            "dataset": "gsm8k",
            "metric": "accuracy",
            "value": 0.61,
            "interval": [0.55, 0.67],
            "vs": "vanilla +0.04",
        }
    ]
    path = tmp_path / "README.md"
    path.write_text(card.card(record, None, evaluation=evaluation))
    parsed = ModelCard.load(path)
    assert parsed.data.base_model is None
    (result,) = parsed.data.eval_results
    assert result.dataset_type == "gsm8k" and result.metric_type == "accuracy" and result.metric_value == 0.61
    assert "95% CI 0.55 to 0.67" in result.metric_name
    assert "| `gsm8k` | `accuracy` | 0.61 | 0.55 to 0.67 | vanilla +0.04 |" in parsed.text


def test_pipes_and_backticks_in_paths_keep_the_table_and_links_resolve(tmp_path):
    import re

    odd = tmp_path / "runs|a`b" / "checkpoint-40"
    record = {"run": "ema-k0.5", "method": "ema", "step": 40, "kappa": 0.5, "source_checkpoint": str(odd),
              "theta0_source": "Qwen/Qwen2.5-0.5B", "bema_version": "0.7.0"}  # fmt: skip
    text = card.card(record, "Qwen/Qwen2.5-0.5B")
    rows = [line for line in text.splitlines() if line.startswith("| source checkpoint")]
    assert rows == ["| source checkpoint | runs\\|a&#96;b/checkpoint-40 |"]  # one row, two cells
    assert len(re.split(r"(?<!\\)\|", rows[0])) == 4  # unescaped pipes: the row's own three
    parsed = ModelCard(text)
    assert parsed.data.base_model == "Qwen/Qwen2.5-0.5B"
    links = re.findall(r"https?://[^\s)\"]+", parsed.text)
    assert links == [
        "https://arxiv.org/abs/2508.00180"
    ]  # the one link, the paper's (no unpublished package page)


def test_a_vanilla_selection_card_names_no_averaging_parameters():
    record = {"run": "vanilla", "method": "vanilla", "step": 80, "kappa": 0.5, "eta": 0.2,
              "source_checkpoint": "/x/run/checkpoint-80", "theta0_source": "/x/base", "bema_version": "0.7.0"}  # fmt: skip
    text = ModelCard(card.card(record, None, selected=True)).text
    assert "The raw checkpoint at step 80, selected by bema" in text and "averaged as below" not in text
    assert "| kappa |" not in text and "| eta |" not in text and "/x/run" not in text


def test_the_card_names_the_source_as_bema_json_does():
    """bema.json said run/sft/checkpoint-380 and the card sft/checkpoint-380: a relative name (what
    records write) is shown as it is; only an older record's absolute path is cut to its last parts."""
    record = {"run": "vanilla", "method": "vanilla", "step": 380, "source_checkpoint": "run/sft/checkpoint-380",
              "theta0_source": "Qwen/Qwen2.5-0.5B", "bema_version": "0.9.0"}  # fmt: skip
    text = card.card(record, None, selected=True)
    assert "| source checkpoint | `run/sft/checkpoint-380` |" in text, text
    assert card.shown_path("/home/alice/run/sft/checkpoint-380") == "sft/checkpoint-380"
