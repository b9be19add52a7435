"""Real Qwen2.5 shapes on disk, built locally: the published dimensions, random weights, a local
tokenizer; no Hub access. A base model and `checkpoint-<s>/` folders of a random walk from it,
in bfloat16 with tied embeddings, as the HF Trainer saves a Qwen2.5 fine-tune.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# config.json fields of the published Qwen2.5 models (huggingface.co/Qwen/Qwen2.5-*/config.json)
SHAPES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
}  # fmt: skip
VOCAB = 151936
WALK_STD = 1e-3  # per-checkpoint step of the random walk (weights have std 0.02)


def config(shape: str) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SHAPES[shape],
        "vocab_size": VOCAB, "tie_word_embeddings": True, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "use_sliding_window": False,
        "sliding_window": 32768, "max_window_layers": 21, "attention_dropout": 0.0,
        "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643,
        "torch_dtype": "bfloat16", "use_cache": True,
    }  # fmt: skip


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Qwen2's parameter names and shapes (biases on q/k/v, no lm_head: tied)."""
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    kv_dim = kv * h // cfg["num_attention_heads"]
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv_dim, h), p + "self_attn.k_proj.bias": (kv_dim,),
            p + "self_attn.v_proj.weight": (kv_dim, h), p + "self_attn.v_proj.bias": (kv_dim,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })  # fmt: skip
    out["model.norm.weight"] = (h,)
    return out


def numel(shape: str) -> int:
    import math

    return sum(math.prod(s) for s in shapes(config(shape)).values())


def _save(weights: dict, folder: Path, tokenizer_dir: Path, cfg: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def build(root: Path, shape: str, steps: list[int], seed: int = 0) -> dict:
    """root/base and root/run/checkpoint-<s> (skipped when already there); returns the paths."""
    import torch

    from bema_cli.demo.tinymodel import make_tiny_model

    root = Path(root)
    base, run = root / "base", root / "run"
    done = root / ".built"
    if done.exists() and json.loads(done.read_text()) == {"shape": shape, "steps": steps, "seed": seed}:
        return {"base": base, "run": run, "steps": steps, "numel": numel(shape)}
    shutil.rmtree(root, ignore_errors=True)
    tok = make_tiny_model(root / "tokenizer")  # a local byte-level BPE with the chat template
    cfg = config(shape)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shp in shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shp, dtype=torch.bfloat16)
        else:
            weights[name] = (torch.randn(shp, generator=g) * 0.02).to(torch.bfloat16)
    _save(weights, base, tok, cfg)
    for step in steps:
        for name, w in weights.items():
            if not name.endswith("norm.weight"):
                w.add_((torch.randn(w.shape, generator=g) * WALK_STD).to(torch.bfloat16))
        _save(weights, run / f"checkpoint-{step}", tok, cfg)
    shutil.rmtree(root / "tokenizer")
    done.write_text(json.dumps({"shape": shape, "steps": steps, "seed": seed}))
    return {"base": base, "run": run, "steps": steps, "numel": numel(shape)}


def write_eval_data(root: Path, prompts: int = 4, loss_records: int = 8) -> Path:
    """gsm8k prompts and held-out loss records (chat messages of ~100-200 tokens) the bench evaluates."""
    root.mkdir(parents=True, exist_ok=True)
    gsm = [{"question": f"Tom has {i + 3} apples and buys {2 * i + 1} more. How many apples does he have?",
            "answer": f"{i + 3} + {2 * i + 1} = {3 * i + 4}\n#### {3 * i + 4}"} for i in range(prompts)]  # fmt: skip
    story = "The cat sat on the warm mat while the dog watched the birds in the garden. " * 3
    loss = [{"messages": [{"role": "user", "content": f"Question {i}: what did the cat do?"},
                          {"role": "assistant", "content": story + f"Answer {i}: it sat."}]}
            for i in range(loss_records)]  # fmt: skip
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in loss))
    return root
