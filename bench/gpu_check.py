"""`make gpu-check`: the GPU path on a Qwen2.5-0.5B shape, whenever a CUDA device exists, in one run
of about 3 minutes. Needs torch with CUDA, transformers, safetensors and bema; no vLLM, no network.

For a 2-config stabilize (bema,ema) and a 16-config grid (ema, bema, dema, ouema at four kappas,
--final-only: 16 distinct states), each on --device cpu, cuda and auto, inputs dropped from the page
cache before every run:
- the disk floor for the same bytes (inputs read cold, the outputs' bytes written past the page cache);
- wall time, its ratio to the floor and to the other device, the per-stage seconds, the
  host-to-device GB/s (the probe's, and the pipeline's input rate);
- what auto chose and why, and whether it is within 5% of the faster device;
- cuda against cpu, element by element: bitwise, or at most 1 bf16 ulp (the GPU may fuse a
  multiply-add into one rounding before the cast to bf16);
then `bema sweep --backend transformers --device cuda`: the walk's GB/s and the seconds per swap.
The targets (cuda <= cpu and <= 1.3x the floor for 2 configs; cuda <= 0.7x cpu for the grid; auto
within 5%) are printed as met or not; only a correctness failure exits non-zero.

    .venv/bin/python bench/gpu_check.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realshape  # noqa: E402
from measure import read_files, set_cache, write_files_direct  # noqa: E402

_SCRIPT = Path(sys.executable).parent / "bema"
BEMA = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "bema_cli"]  # a bare GPU image
GRIDS = {
    "2 configs": ["--method", "bema,ema"],
    "16 configs": ["--method", "ema,bema,dema,ouema", "--kappa", "0.3,0.5,0.7,0.9", "--final-only"],
}


def bema(*args) -> dict:
    proc = subprocess.run([*BEMA, *map(str, args), "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bema {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


def inputs(world: dict) -> list[Path]:
    return sorted(world["base"].glob("*.safetensors")) + sorted(world["run"].glob("*/*.safetensors"))


def disk_floor(files: list[Path], written: int, scratch: Path) -> float:
    """Read the inputs cold, write `written` bytes past the page cache: the same bytes as the run."""
    set_cache(files, "cold")
    seconds = read_files(files)
    seconds += write_files_direct({scratch / f"floor{i}.bin": written // 4 for i in range(4)})
    shutil.rmtree(scratch, ignore_errors=True)
    return seconds


F32_ULPS = 16  # float32 roundings of the tensor's scale a fused multiply-add may move an output by


def compare(a: Path, b: Path) -> tuple[int, int, int, int]:
    """Every output of two OUTs, element by element: (elements differing, elements, largest distance
    in bf16 ulps, elements beyond the bound). The bound: 1 bf16 ulp of the element, or F32_ULPS
    float32 roundings at the tensor's largest magnitude, whichever is larger. The GPU may contract
    a*b + c into one rounding; where an average cancels (DEMA's 2 e1 - e2, a weight crossing zero)
    that float32 difference is many bf16 ulps of a small output, but never more than the float32
    rounding of the tensor's own scale."""
    import torch
    from safetensors.torch import load_file

    differing = total = worst = beyond = 0
    for folder in sorted(a.glob("*/checkpoint-*")):
        other = load_file(str(b / folder.relative_to(a) / "model.safetensors"))
        for name, t in load_file(str(folder / "model.safetensors")).items():
            u = other[name]
            differing += int((t != u).sum())
            total += t.numel()
            if t.dtype != torch.bfloat16 or torch.equal(t, u):
                continue
            worst = max(worst, int((t.view(torch.int16).int() - u.view(torch.int16).int()).abs().max()))
            x, y = t.float(), u.float()
            ulp = torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 8)  # bf16 spacing at |x|
            scale = F32_ULPS * 2.0**-24 * float(x.abs().max())
            beyond += int(((x - y).abs() > torch.clamp(ulp, min=scale)).sum())
    return differing, total, worst, beyond


def stage_text(doc: dict) -> str:
    keep = ("setup", "read", "compute", "wait", "write", "state", "commit")
    return ", ".join(f"{k} {v['seconds']:.1f}" for k, v in doc["stages"].items() if k in keep)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bema-gpu-check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing checked (run it on a GPU machine)")
        return
    t0 = time.perf_counter()
    print(f"gpu-check on {torch.cuda.get_device_name(0)}, {os.cpu_count()} cores, torch {torch.__version__}")
    world = realshape.build(args.workdir / "0.5b", "0.5b", [100, 200, 300])
    files = inputs(world)
    print(f"0.5B shape built: {sum(f.stat().st_size for f in files) / 1e9:.1f} GB of inputs "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    failed, rows, targets = [], [], []
    for grid, flags in GRIDS.items():
        docs = {}
        for device in ("cpu", "cuda", "auto"):
            out = args.workdir / f"{grid.split()[0]}-{device}"
            set_cache(files, "cold")
            docs[device] = bema("stabilize", world["run"], "--base", world["base"], *flags, "--out", out,
                                "--device", device, "--overwrite", "--no-state")  # fmt: skip
        floor = disk_floor(files, docs["cpu"]["written_bytes"], args.workdir / "floor")
        cpu_s, cuda_s = docs["cpu"]["seconds"], docs["cuda"]["seconds"]
        for device, doc in docs.items():
            s = doc["seconds"]
            chose = doc["device"]
            speeds = chose.get("gpu_speeds") or {}
            rows.append(
                f"{grid:10} {device:4} -> {chose['device']:4} {s:6.1f} s  floor {s / floor:4.2f}x  "
                f"vs {'cuda' if device == 'cpu' else 'cpu'} {s / (cuda_s if device == 'cpu' else cpu_s):4.2f}x  "
                f"in {doc['read_bytes'] / s / 1e9:5.2f} GB/s"
                + (f"  probe h2d {speeds['h2d'] / 1e9:.1f} GB/s" if speeds else "")
                + f"  [{stage_text(doc)}]"
            )
            if device == "auto":
                rows.append(f"{'':10} auto: {chose['reason']}")
        out = {d: args.workdir / f"{grid.split()[0]}-{d}" for d in docs}
        differing, total, worst, beyond = compare(out["cpu"], out["cuda"])
        rows.append(f"{grid:10} cuda vs cpu: {differing} of {total} elements differ, by at most {worst} bf16 "
                    f"ulp; {beyond} beyond max(1 bf16 ulp, {F32_ULPS} float32 ulps of the tensor's scale)")  # fmt: skip
        if beyond:
            failed.append(f"{grid}: {beyond} elements of cuda differ from cpu beyond the bound")
        best = min(cpu_s, cuda_s)
        targets.append((f"{grid}: auto within 5% of the faster ({docs['auto']['seconds']:.1f} vs {best:.1f} s)",
                        docs["auto"]["seconds"] <= 1.05 * best))  # fmt: skip
        if grid == "2 configs":
            targets.append((f"2 configs: cuda <= cpu ({cuda_s / cpu_s:.2f})", cuda_s <= cpu_s))
            targets.append(
                (f"2 configs: cuda <= 1.3x the disk floor ({cuda_s / floor:.2f})", cuda_s <= 1.3 * floor)
            )
        else:
            targets.append((f"16 configs: cuda <= 0.7x cpu ({cuda_s / cpu_s:.2f})", cuda_s <= 0.7 * cpu_s))
        rows.append(
            f"{grid:10} disk floor {floor:.1f} s ({docs['cpu']['written_bytes'] / 1e9:.1f} GB written)"
        )
        for d in out.values():
            shutil.rmtree(d, ignore_errors=True)
    data = realshape.write_eval_data(args.workdir / "data")
    doc = bema("sweep", world["run"], "--base", world["base"], "--method", "bema,ema", "--at", "300",
               "--tasks", "loss", "--loss-data", data / "heldout.jsonl", "--backend", "transformers",
               "--device", "cuda", "--out", args.workdir / "sweep")  # fmt: skip
    walk, swap = doc["stages"].get("walk", {}), doc["stages"].get("swap", {})
    swaps = max(1, len(doc["records"]))
    memory = doc["memory"]
    host, device = memory["peak_rss"] / world["numel"], (memory.get("peak_device") or 0) / world["numel"]
    rows.append(f"sweep --backend transformers --device cuda, states on {memory['states_device']}: "
                f"{doc['seconds']:.1f} s, walk {walk.get('gb_per_s') or 0:.2f} GB/s, "
                f"{(swap.get('seconds') or 0) / swaps:.2f} s per swap ({swaps} records); peak host RSS "
                f"{host:.1f} B/param (estimate {memory['estimate'] / world['numel']:.1f}), GPU {device:.1f} B/param")  # fmt: skip
    targets.append((f"sweep's peak host RSS <= 12 B/param ({host:.1f})", host <= 12))
    if memory["states_device"] != "cuda":
        failed.append("sweep: the states are not on the GPU")
    print("\n".join(rows))
    print("targets: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in targets))
    print(f"gpu-check: {time.perf_counter() - t0:.0f} s")
    if failed:
        sys.exit("gpu-check: FAILED: " + "; ".join(failed))
    print("gpu-check: passed")


if __name__ == "__main__":
    main()
