"""A synthetic fine-tuning trajectory on disk: base/ + checkpoint-<s>/ in the HF layout.

Tensors have transformer-like names and shapes; one embedding matrix holds ~45% of
the bytes, so at the default 250 MB it is >= 100 MB and a streaming engine with a
modest --max-memory has to split it. Weights follow a random walk from the base.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

EMBED_SHARE = 0.45  # fraction of the model's bytes in the one big tensor (embeddings)
WALK_STD = 1e-3  # per-checkpoint step of the random walk; base weights have std 0.02


@dataclass(frozen=True)
class Trajectory:
    base: Path
    run: Path  # holds checkpoint-<s>/
    steps: list[int]
    file_bytes: int  # size of one model.safetensors
    big_tensor_bytes: int
    numel: int  # parameters in one model
    dtype: str

    def checkpoint(self, step: int) -> Path:
        return self.run / f"checkpoint-{step}"

    def input_files(self) -> list[Path]:
        """Every byte a stabilizer has to read: theta0 and each checkpoint's weights."""
        return [self.base / "model.safetensors"] + [
            self.checkpoint(s) / "model.safetensors" for s in self.steps
        ]


def layout(total_bytes: int, itemsize: int) -> tuple[dict[str, tuple[int, ...]], dict]:
    """Tensor names -> shapes adding up to ~total_bytes, and a matching config.json."""
    hidden = 1024 if total_bytes >= 64 * 2**20 else 128
    inter = hidden * 11 // 4  # Llama-ish MLP width
    vocab = max(8, round(EMBED_SHARE * total_bytes / (hidden * itemsize)))
    per_layer = (4 * hidden * hidden + 3 * inter * hidden + 2 * hidden) * itemsize
    layers = max(1, round((total_bytes - vocab * hidden * itemsize) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }
    return shapes, config


def make_trajectory(
    root: Path, total_bytes: int, n_checkpoints: int, dtype: str = "float32", seed: int = 0
) -> Trajectory:
    """Write root/base and root/run/checkpoint-{100,200,...}; one full model in memory at a time."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    shapes, config = layout(total_bytes, torch.finfo(torch_dtype).bits // 8)
    config["dtype"] = dtype
    gen = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=gen) * 0.02 for k, shape in shapes.items()}  # fp32 walk
    steps = [100 * (i + 1) for i in range(n_checkpoints)]
    folders = [root / "base"] + [root / "run" / f"checkpoint-{s}" for s in steps]
    for i, folder in enumerate(folders):
        if i > 0:
            for t in state.values():
                t.add_(torch.randn(t.shape, generator=gen), alpha=WALK_STD)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.to(torch_dtype) for k, v in state.items()},
            str(folder / "model.safetensors"),
            {"format": "pt"},
        )
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    itemsize = torch.finfo(torch_dtype).bits // 8
    big = shapes["model.embed_tokens.weight"]
    return Trajectory(
        base=folders[0],
        run=root / "run",
        steps=steps,
        file_bytes=(folders[0] / "model.safetensors").stat().st_size,
        big_tensor_bytes=big[0] * big[1] * itemsize,
        numel=sum(math.prod(shape) for shape in shapes.values()),
        dtype=dtype,
    )
