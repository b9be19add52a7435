"""The per-merge peer of `bema stabilize --method wsm/lawa`: Megatron-LM's weighted_merge, once per output.

Megatron-LM's `tools/checkpoint/weighted_merge.py` writes ONE merge per call and reads each of
the window's n checkpoints whole, so a merge at every saved step reads about N x n checkpoints.
This peer does exactly that for every step of a run: for each output step it loads the last
(up to) K checkpoints with `safetensors.torch.load_file`, one at a time, accumulates
sum_i c_i theta_i in fp32 with the Megatron coefficients (written here from the definition,
not taken from bema), and saves the merge with `save_file`. It prints one JSON line: the bytes
it read and wrote.

    python bench/megatron_peer.py RUN_DIR --out OUT [--window 8] [--schedule minus-sqrt]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DECAY = {
    "linear": lambda x: 1 - x,
    "minus-sqrt": lambda x: 1 - math.sqrt(x),
    "cosine": lambda x: (1 + math.cos(math.pi * x)) / 2,
}


def coefficients(schedule: str, n: int) -> list[float]:
    """d_i = g(i/n); c_(n-1) = d_(n-1); c_i = d_i - d_(i+1); c_0 = 1 - the others (oldest first)."""
    d = [DECAY[schedule](i / n) for i in range(n)]
    c = [d[i] - d[i + 1] for i in range(n - 1)] + [d[-1]]
    c[0] = 1 - sum(c[1:])
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--schedule", default="minus-sqrt")
    ap.add_argument("--run-name", default=None, help="output folder name (default wsm-<schedule>-w<K>)")
    args = ap.parse_args()
    folders = {
        int(m.group(1)): p
        for p in args.checkpoints.iterdir()
        if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
    }
    steps = sorted(folders)
    name = args.run_name or f"wsm-{args.schedule.replace('-', '_')}-w{args.window}"
    read = written = 0
    for i, step in enumerate(steps):
        window = steps[max(0, i - args.window + 1) : i + 1]
        merged: dict[str, torch.Tensor] = {}
        dtypes = {}
        for c, member in zip(coefficients(args.schedule, len(window)), window, strict=True):
            path = folders[member] / "model.safetensors"
            read += path.stat().st_size
            for key, tensor in load_file(path).items():
                dtypes[key] = tensor.dtype
                if key in merged:
                    merged[key].add_(tensor.float(), alpha=c)
                else:
                    merged[key] = tensor.float().mul_(c)
        folder = args.out / name / f"checkpoint-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtypes[k]).contiguous() for k, v in merged.items()}, folder / "model.safetensors")
        written += (folder / "model.safetensors").stat().st_size
        config = folders[step] / "config.json"
        if config.is_file():
            shutil.copy2(config, folder / "config.json")
    print(json.dumps({"read_bytes": read, "written_bytes": written, "outputs": len(steps)}))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
