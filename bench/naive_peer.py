"""The naive peer `bema stabilize` is measured against: what one writes in an afternoon.

`safetensors.torch.load_file` each checkpoint whole, keep the full model's theta0 and
EMA state in fp32, `save_file` each output whole. Same math (bema_cli.recurrence),
same output layout (OUT/<run>/checkpoint-<s>/model.safetensors + config.json), so its
time and peak RSS are a fair baseline. Resident: theta0 + ema + theta_s + output,
i.e. ~4x the fp32 model.

    python bench/naive_peer.py CHECKPOINTS_DIR --base BASE --out OUT [--method bema --kappa 0.5 --eta 0.2]
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bema_cli.recurrence import Stabilizer
from bema_cli.schedule import Schedule, run_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", type=Path)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--method", default="bema")
    ap.add_argument("--kappa", type=float, default=0.5)
    ap.add_argument("--eta", type=float, default=0.2)
    args = ap.parse_args()

    folders = {
        int(m.group(1)): p
        for p in args.checkpoints.iterdir()
        if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
    }
    schedule = Schedule(method=args.method, kappa=args.kappa, eta=args.eta).resolved()
    theta0 = {k: v.float() for k, v in load_file(args.base / "model.safetensors").items()}
    states = {k: Stabilizer(schedule.method, v) for k, v in theta0.items()}
    for event in schedule.plan(sorted(folders)):
        folder = folders[event.step]
        theta = load_file(folder / "model.safetensors")
        out = {}
        for name, tensor in theta.items():
            result = states[name].apply(event, tensor.float())
            if result is not None:
                out[name] = result.to(tensor.dtype).contiguous()
        del theta
        if out:
            dest = args.out / run_name(schedule) / folder.name
            dest.mkdir(parents=True, exist_ok=True)
            save_file(out, str(dest / "model.safetensors"), {"format": "pt"})
            shutil.copy(folder / "config.json", dest / "config.json")
        del out


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
