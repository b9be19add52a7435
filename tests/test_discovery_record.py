"""Discovery validates once: each checkpoint folder is listed, its weight map checked and its
headers parsed once per process (`io/reader.describe`), and every reader below takes that record;
a folder that changes afterwards (a rewritten file, a shard added) is validated again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file
from trajectory import _save, finetune_trajectory, write_trajectory

import bema_cli.io.reader as reader
from bema_cli.io.fingerprint import weight_files

# Runs the CLI in a fresh interpreter (bema's output settings are process-wide), counting per folder
# the listings of its weight files and the parses of its headers.
COUNTING = """
import collections, json, sys
from pathlib import Path
from typer.testing import CliRunner
import bema_cli.io.reader as reader, bema_cli.io.safetensors as st
from bema_cli.cli import app
seen = collections.Counter()
listing, header = reader.model_weight_files, st._header
def counted_listing(folder):
    seen["list " + Path(folder).name] += 1
    return listing(folder)
def counted_header(path):
    seen["header " + Path(path).parent.name] += 1
    return header(path)
reader.model_weight_files, st._header = counted_listing, counted_header
r = CliRunner().invoke(app, sys.argv[1:])
print(json.dumps({"exit": r.exit_code, "output": r.output[-2000:], "seen": seen}))
"""


def test_a_sweep_validates_each_checkpoint_once(tiny_model_dir, tmp_path):
    """The whole sweep (discovery, fingerprints, the walk, eval's targets and resume keys): before
    the record, 2-4 listings per checkpoint."""
    run = finetune_trajectory(tiny_model_dir, tmp_path, [10, 20, 30])
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello there"}]}) + "\n")  # fmt: skip
    args = ["sweep", run, "--base", tiny_model_dir, "--method", "bema", "--at", "20,30", "--tasks", "loss",
            "--loss-data", data, "--backend", "transformers", "--out", tmp_path / "sweep", "--json"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", COUNTING, *map(str, args)], capture_output=True, text=True)
    doc = json.loads(proc.stdout.splitlines()[-1])
    assert doc["exit"] == 0, doc["output"]
    folders = [f"checkpoint-{s}" for s in (10, 20, 30)] + [tiny_model_dir.name]
    counts = {f: (doc["seen"].get(f"list {f}"), doc["seen"].get(f"header {f}")) for f in folders}
    assert counts == {f: (1, 1) for f in folders}, doc["seen"]


def test_a_changed_folder_is_validated_again(tmp_path):
    base, run = write_trajectory(tmp_path, [1], shards=1)
    folder = run / "checkpoint-1"
    first = reader.describe(folder)
    assert reader.describe(folder) is first and reader.describe(str(folder)) is first  # str paths too
    assert reader.safetensors_files(str(folder)) == [
        folder / "model.safetensors"
    ]  # as the vLLM swap calls it
    opened = reader.open_checkpoint(folder)  # its own object (the engine re-points a held one's files)
    assert opened is not first.index and opened.tensors == first.index.tensors
    assert weight_files(folder) == [folder / "model.safetensors"]

    # rewritten in place with another layout: the next call sees the new tensor, not the record's
    save_file({"layer.0.weight": torch.zeros(3, 2)}, folder / "model.safetensors")
    os.utime(folder / "model.safetensors", ns=(1, first.signature[1][2] + 10**9))
    again = reader.describe(folder)
    assert again is not first and set(again.index.tensors) == {"layer.0.weight"}

    # resharded: model.safetensors replaced by two shards and an index
    (folder / "model.safetensors").unlink()
    _save({"a": torch.ones(4), "b": torch.ones(2)}, folder, shards=2)
    resharded = reader.describe(folder)
    assert [p.name for p in resharded.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert set(resharded.index.tensors) == {"a", "b"}
