"""LoRA runs stabilized exactly in weight space (docs/math.md), through the real CLI.

A real PEFT LoRA fine-tune with the HF Trainer (tiny Qwen2, save_steps) and a perturbed rsLoRA
run with an adapted embedding and modules_to_save. Tolerances: merged outputs within 1e-5 of
the float64 weight-space reference relative to each tensor's largest |value| (float32 reads
and accumulation cost ~1e-7); adapter outputs, loaded with PeftModel.from_pretrained and
merged, within the optimal rank-R error (Eckart-Young, from a float64 SVD of the reference
delta) plus 1e-5, and exact (1e-5) at a rank covering every averaged checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_bema
from lora_run import perturbed_adapters, weights_of
from reference import reference
from trajectory import load_model

STEPS = [3, 6, 9]
R = 4


def _trainer_run(base: Path, run: Path) -> Path:
    """PEFT LoRA with the HF Trainer: q/k/v/o adapted, final norm saved whole, a checkpoint every 3 steps."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=R, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=["norm"]
    )
    model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 500, (24,), generator=g) for _ in range(16)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = TrainingArguments(
        output_dir=str(run),
        max_steps=STEPS[-1],
        save_steps=3,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    return run


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    shutil.copytree(tiny_model_dir, base)
    return base, _trainer_run(base, root / "run"), root


def _reference(base: Path, run: Path, method: str) -> dict:
    theta0 = load_model(base)
    trajectory = [(s, weights_of(run / f"checkpoint-{s}", theta0)) for s in STEPS]
    return reference({k: v.double() for k, v in theta0.items()}, trajectory, method)


def _stabilize(*args) -> dict:
    r = run_bema("stabilize", *args, "--json")
    assert r.returncode == 0, r.stderr
    return {**json.loads(r.stdout), "_stderr": r.stderr}


def _check_merged(doc: dict, refs: dict) -> int:
    checked = 0
    for o in doc["outputs"]:
        out = load_model(Path(o["path"]))
        expect = refs[o["method"]][o["step"]]
        assert set(out) == set(expect)
        for name, value in out.items():
            err = (value.double() - expect[name]).abs().max()
            assert err <= 1e-5 * expect[name].abs().max(), (o["run"], o["step"], name, float(err))
            checked += 1
    return checked


def test_trainer_lora_merged_equals_weight_space_reference(trainer_run):
    base, run, root = trainer_run
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == [
        f"checkpoint-{s}" for s in STEPS
    ]
    doc = _stabilize(run, "--method", "bema,ema", "--out", root / "merged")  # --base from adapter_config
    inferred = (
        f"base model (theta0): {base}, as {run / f'checkpoint-{STEPS[0]}' / 'adapter_config.json'} names it"
    )
    assert inferred in doc["_stderr"]  # what was inferred is said
    refs = {m: _reference(base, run, m) for m in ("bema", "ema")}
    assert _check_merged(doc, refs) == 2 * len(STEPS) * len(load_model(base))
    final = Path(doc["outputs"][-1]["path"])
    record = json.loads((final / "bema.json").read_text())
    assert record["lora"]["output"] == "merged" and record["theta0_source"] == base.name  # by name
    assert record["lora"]["modules"] == 2 * 4 and "model.norm.weight" in record["lora"]["modules_to_save"]
    # averaging the factors A and B separately (what this must avoid) is measurably wrong here
    a_avg = _factor_average_error(base, run, refs["ema"][STEPS[-1]])
    assert a_avg > 1e-3, a_avg
    # the merged output loads like any model folder
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert torch.equal(model.state_dict()["model.norm.weight"], load_model(final)["model.norm.weight"])


def _factor_average_error(base: Path, run: Path, ema_ref: dict) -> float:
    """Relative error of EMA-averaging A and B separately, then merging, against the weight-space EMA."""
    from safetensors.torch import load_file

    from bema_cli.schedule import Schedule

    events = {e.step: e for e in Schedule(method="ema").resolved().plan(STEPS)}
    avg = None
    for s in STEPS:
        t = {
            k: v.double() for k, v in load_file(run / f"checkpoint-{s}" / "adapter_model.safetensors").items()
        }
        zero = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in t.items()}
        avg = {k: v.clone() for k, v in zero.items()} if avg is None else avg
        for k in avg:
            avg[k].lerp_(t[k], events[s].beta)
    tmp = run.parent / "factor-avg"
    shutil.copytree(run / f"checkpoint-{STEPS[-1]}", tmp, dirs_exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.float() for k, v in avg.items()}, tmp / "adapter_model.safetensors")
    merged = weights_of(tmp, load_model(base))
    name = "model.layers.0.self_attn.q_proj.weight"
    delta = ema_ref[name] - load_model(base)[name].double()
    return float((merged[name] - ema_ref[name]).norm() / delta.norm())


@pytest.mark.parametrize("rank", [R, R * len(STEPS)])
def test_trainer_lora_adapter_output(trainer_run, rank):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, run, root = trainer_run
    out = root / f"adapter-{rank}"
    doc = _stabilize(run, "--base", base, "--lora-output", "adapter", "--lora-rank", str(rank), "--out", out)
    ref = _reference(base, run, "bema")
    theta0 = load_model(base)
    for o in doc["outputs"]:
        folder = Path(o["path"])
        assert sorted(p.name for p in folder.iterdir()) == [
            "README.md",  # the model card: a PEFT adapter's
            "adapter_config.json",
            "adapter_model.safetensors",
            "bema.json",
        ]
        assert "library_name: peft" in (folder / "README.md").read_text()
        record = json.loads((folder / "bema.json").read_text())["lora"]
        assert (
            record["rank"] == rank and json.loads((folder / "adapter_config.json").read_text())["r"] == rank
        )
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, folder).merge_and_unload().state_dict()
        expect = ref[o["step"]]
        for module, recorded in record["truncation_error"].items():
            name = module + ".weight"
            delta = expect[name] - theta0[name].double()
            s = torch.linalg.svdvals(delta)
            optimal = float((s[rank:] ** 2).sum().sqrt() / s.norm())
            achieved = float((merged[name].double() - expect[name]).norm() / delta.norm())
            assert abs(recorded - optimal) <= 1e-4, (module, recorded, optimal)
            assert achieved <= optimal + 1e-5, (module, achieved, optimal)
            if rank == R * len(STEPS):
                assert achieved <= 1e-5, (module, achieved)
        err = (merged["model.norm.weight"].double() - expect["model.norm.weight"]).abs().max()
        assert err <= 1e-6, "modules_to_save tensors are stabilized as full tensors"
    if rank == R:  # three averaged checkpoints need rank up to 12: truncating to 4 loses something
        assert (
            max(
                json.loads((Path(o["path"]) / "bema.json").read_text())["lora"]["max_truncation_error"]
                for o in doc["outputs"]
            )
            > 1e-3
        )


def test_rslora_embedding_and_modules_to_save(tiny_model_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    run = perturbed_adapters(base, tmp_path / "run", [10, 20, 30], use_rslora=True)
    doc = _stabilize(run, "--method", "bema", "--out", tmp_path / "out", "--steps", "30")
    theta0 = load_model(base)
    trajectory = [(s, weights_of(run / f"checkpoint-{s}", theta0)) for s in (10, 20, 30)]
    ref = reference({k: v.double() for k, v in theta0.items()}, trajectory, "bema")
    assert _check_merged(doc, {"bema": ref}) == len(theta0)
    out = load_model(Path(doc["outputs"][0]["path"]))
    assert not torch.equal(out["model.embed_tokens.weight"], theta0["model.embed_tokens.weight"])
    untouched = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(out[untouched], theta0[untouched]), (
        "a module LoRA does not adapt stays bitwise the base"
    )


def test_adapter_output_keeps_a_portable_base_name():
    """--lora-output adapter writes the base as the user gave it (a Hub id) or as the training adapter
    named it, never the absolute local path theta0 happened to be read from."""
    from types import SimpleNamespace

    from bema_cli.io.lora_out import adapter_config

    trained = SimpleNamespace(config={"r": 8, "base_model_name_or_path": "Qwen/Qwen2.5-1.5B"})
    assert (
        adapter_config(trained, 4, "/root/.cache/hf/models--Qwen/snap/abc")["base_model_name_or_path"]
        == "Qwen/Qwen2.5-1.5B"
    )
    assert adapter_config(trained, 4, "my-org/other-base")["base_model_name_or_path"] == "my-org/other-base"
    unnamed = SimpleNamespace(config={"r": 8})
    assert adapter_config(unnamed, 4, "/home/me/models/base")["base_model_name_or_path"] == "models/base"
    local = SimpleNamespace(config={"r": 8, "base_model_name_or_path": "/home/me/models/base"})
    assert adapter_config(local, 4, "/home/me/models/base")["base_model_name_or_path"] == "models/base"


def test_verify_rebuilds_a_lora_runs_outputs_merged_and_adapter(tiny_model_dir, tmp_path):
    """`bema verify` on a LoRA run's outputs: a merged model, and a PEFT adapter (its header carries
    the record and the rank, so stabilize makes it again at that rank) are rebuilt in a temporary
    folder, bitwise, saying why not in memory; a changed adapter tensor is named (exit 1)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    run = perturbed_adapters(base, tmp_path / "run", [10, 20, 30])
    _stabilize(run, "--base", base, "--method", "bema", "--out", tmp_path / "merged", "--steps", "30")
    doc = _stabilize(run, "--base", base, "--method", "ema", "--lora-output", "adapter", "--lora-rank", "2",
                     "--out", tmp_path / "adapter", "--steps", "20,30")  # fmt: skip
    # rank 2 loses much of these deltas: the warning names each output where it is, not the temporary
    # folder it was written in
    warned = [line for line in doc["_stderr"].splitlines() if "truncation loses" in line]
    assert sorted(line.split(": rank 2 ")[0].removeprefix("warning: ") for line in warned) == sorted(
        o["path"] for o in doc["outputs"]
    )
    for folder in (tmp_path / "merged" / "bema-k0.5-e0.2" / "checkpoint-30",
                   tmp_path / "adapter" / "ema-k0.5" / "checkpoint-20",
                   tmp_path / "adapter" / "ema-k0.5" / "checkpoint-30"):  # fmt: skip
        r = run_bema("verify", folder, "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["identical"] and doc["rebuilt"].startswith("in a temporary folder (a LoRA run's output")
        assert "warning" not in r.stderr  # the rank-2 truncation was warned about by stabilize, not again
    folder = tmp_path / "adapter" / "ema-k0.5" / "checkpoint-30"
    path = folder / "adapter_model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["bema"])["record"]["lora"] == {"output": "adapter", "rank": 2}
    weights = load_file(path)
    name = sorted(weights)[0]
    weights[name].view(-1)[0] += 1e-3
    save_file(weights, str(path), metadata=meta)
    r = run_bema("verify", folder, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["differ"] == [name], r.stdout
