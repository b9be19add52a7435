"""`make gpu-check`: the GPU path on a Qwen2.5-0.5B shape, whenever a CUDA device exists. Needs
torch with CUDA, transformers, safetensors and bema; no vLLM.

1. `bema stabilize --device cuda` against `--device cpu`: the same recurrence in float32 on two
   devices. Elementwise float32 ops are correctly rounded on both, but the GPU may fuse a
   multiply-add (lerp) into one rounding, so outputs may differ by one float32 rounding before
   the cast to the checkpoint's bf16: at most 1 bf16 ulp per element, and in few elements.
2. `bema sweep --backend transformers --device cuda`: the states on the GPU, loss on held-out records.
3. GB/s read and written for each.

    .venv/bin/python bench/gpu_check.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realshape  # noqa: E402

BEMA = str(Path(sys.executable).parent / "bema")


def bema(*args) -> dict:
    proc = subprocess.run([BEMA, *map(str, args), "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bema {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


def ulps(a, b) -> int:
    """Largest distance in units of the last place between two bf16 tensors."""
    import torch

    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def main() -> None:
    import torch
    from safetensors.torch import load_file

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bema-gpu-check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing checked (run it on a GPU machine)")
        return
    world = realshape.build(args.workdir / "0.5b", "0.5b", [100, 200, 300])
    rates = {}
    for device in ("cpu", "cuda"):
        doc = bema("stabilize", world["run"], "--base", world["base"], "--method", "bema,ema",
                   "--out", args.workdir / f"stab-{device}", "--device", device, "--overwrite")  # fmt: skip
        rates[device] = (
            doc["read_bytes"] / doc["seconds"] / 1e9,
            doc["written_bytes"] / doc["seconds"] / 1e9,
        )
        print(f"stabilize --device {device}: {doc['seconds']:.1f} s, read {rates[device][0]:.2f} GB/s, "
              f"wrote {rates[device][1]:.2f} GB/s")  # fmt: skip
    worst, differing, total = 0, 0, 0
    for folder in sorted((args.workdir / "stab-cpu").glob("*/checkpoint-*")):
        gpu = load_file(
            str(
                args.workdir
                / "stab-cuda"
                / folder.relative_to(args.workdir / "stab-cpu")
                / "model.safetensors"
            )
        )
        for name, t in load_file(str(folder / "model.safetensors")).items():
            worst = max(worst, ulps(t, gpu[name]))
            differing += int((t != gpu[name]).sum())
            total += t.numel()
    print(f"cuda vs cpu: {differing} of {total} elements differ, by at most {worst} bf16 ulp (bound: 1)")
    data = realshape.write_eval_data(args.workdir / "data")
    doc = bema("sweep", world["run"], "--base", world["base"], "--method", "bema,ema", "--at", "300",
               "--tasks", "loss", "--loss-data", data / "heldout.jsonl", "--backend", "transformers",
               "--device", "cuda", "--out", args.workdir / "sweep")  # fmt: skip
    walk = doc["stages"].get("walk", {})
    print(f"sweep --backend transformers, states on {doc['memory']['states_device']}: {doc['seconds']:.1f} s, "
          f"walk {walk.get('gb_per_s') or 0:.2f} GB/s, {len(doc['records'])} records")  # fmt: skip
    if worst > 1 or doc["memory"]["states_device"] != "cuda":
        sys.exit("gpu-check: FAILED")
    print("gpu-check: passed")


if __name__ == "__main__":
    main()
