"""Two runs with a known answer for `bema ship`, built from the tiny model and real training.

theta* is the tiny model trained on the held-out records themselves (its held-out loss is low).
- `noisy_run`: every checkpoint is theta* plus fresh noise: averaging removes noise, so an average
  beats the last checkpoint (the regime the paper's averages are for);
- `drift_run`: noise-free steps along the line from theta0 toward theta*, stopped at 3/4 of the way
  while the held-out loss still falls steeply (measured: 1.22 at 5/8, 0.88 at 3/4; the line flattens
  near theta*, where a blend of the last two checkpoints beat the end on one machine): the last
  checkpoint is the best point seen and every average, a point behind it on the line, lags.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

STEPS = [10, 20, 30, 40, 50, 60, 70, 80]


def heldout(path: Path, n: int = 40) -> Path:
    """n held-out chats of one pattern (the optimum learns it; noise in the weights hurts it)."""
    chats = [{"messages": [{"role": "user", "content": f"count {i}"},
                           {"role": "assistant", "content": f"{i} and {i + 1} and {i + 2}"}]} for i in range(n)]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return path


def optimum(base: Path, heldout: Path, dst: Path, steps: int = 60) -> Path:
    """The base fine-tuned (Adam, lr 1e-2) on the held-out chats: a point of low held-out loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    texts = [
        tok.apply_chat_template(json.loads(x)["messages"], tokenize=False)
        for x in heldout.read_text().splitlines()
    ]
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(steps):
        ids = tok(texts[i % len(texts)], add_special_tokens=False, return_tensors="pt").input_ids
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


def _write(base: Path, run: Path, weights_of, steps=STEPS) -> Path:
    from safetensors.torch import save_file

    for step in steps:
        folder = run / f"checkpoint-{step}"
        shutil.copytree(base, folder)
        save_file(weights_of(step), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return run


def noisy_run(base: Path, star: Path, run: Path, scale: float = 0.03) -> Path:
    import torch
    from safetensors.torch import load_file

    opt = load_file(str(star / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    return _write(
        base, run, lambda s: {k: v + scale * torch.randn(v.shape, generator=g) for k, v in opt.items()}
    )


def drift_run(base: Path, star: Path, run: Path, reach: float = 0.75) -> Path:
    from safetensors.torch import load_file

    b, opt = load_file(str(base / "model.safetensors")), load_file(str(star / "model.safetensors"))
    last = STEPS[-1]
    return _write(base, run, lambda s: {k: b[k] + (reach * s / last) * (opt[k] - b[k]) for k in opt})


def converged_run(
    base: Path, star: Path, run: Path, steps=tuple(range(100, 1300, 100)), reach_at: int = 3
) -> Path:
    """A fine-tune that converged early: checkpoint i is theta0 + min(1, i/reach_at)(theta* - theta0),
    so from checkpoint `reach_at` on every checkpoint is theta*: the last 4 are equal, and any uniform
    window over them (LAWA-w4, the simplex search's start) is the same vector of weights as vanilla's
    neighbours, the case where a fitted vector equals a menu config's."""
    from safetensors.torch import load_file

    b, opt = load_file(str(base / "model.safetensors")), load_file(str(star / "model.safetensors"))
    index = {s: i + 1 for i, s in enumerate(steps)}

    def weights(s):
        t = min(1.0, index[s] / reach_at)
        return {k: b[k] + t * (opt[k] - b[k]) for k in opt}

    return _write(base, run, weights, steps)
