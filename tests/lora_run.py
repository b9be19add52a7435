"""Real PEFT LoRA checkpoints for the tests: perturbed adapters (fast) or an HF Trainer run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

PREFIX = "base_model.model."


def perturbed_adapters(base_dir: Path, run_dir: Path, steps: list[int], seed: int = 0, **lora) -> Path:
    """checkpoint-<s>/ adapters of a PEFT model whose trainable tensors take a random walk.

    `lora` goes to peft.LoraConfig (default: q_proj, v_proj and the embedding adapted, norms saved whole).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj", "embed_tokens"],
        "modules_to_save": ["norm"],
        **lora,
    }
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), LoraConfig(**config)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for step in steps:
            for _, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            model.save_pretrained(run_dir / f"checkpoint-{step}")
    return run_dir


def weights_of(adapter_dir: Path, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full float64 weights an adapter checkpoint stands for, written independently of bema:
    W + (lora_alpha / r) * B @ A (rsLoRA: / sqrt(r); embeddings: (B @ A).T), saved tensors replaced."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    out = {k: v.double() for k, v in base.items()}
    for key, value in tensors.items():
        name = key.removeprefix(PREFIX)
        for a_suffix, b_suffix, transposed in (
            (".lora_A.weight", ".lora_B.weight", False),
            (".lora_embedding_A", ".lora_embedding_B", True),
        ):
            if name.endswith(a_suffix):
                module = name.removesuffix(a_suffix)
                a, b = value.double(), tensors[PREFIX + module + b_suffix].double()
                r = a.shape[0]
                scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
                delta = scale * (b @ a)
                out[module + ".weight"] += delta.T if transposed else delta
        if ".lora_" not in name and ".base_layer." not in name:
            out[name] = value.double()
    return out
