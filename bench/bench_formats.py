"""Benchmark the input formats of `bema stabilize`: one table of ratios, all measured in one run.

1. One synthetic trajectory (bench/synth.py) saved as safetensors, as `.bin` (torch.save) and as
   DCP (torch.distributed.checkpoint.save, accelerate's `{"model": ...}` nesting). Each is
   stabilized with the same --max-memory; targets: `.bin` and DCP wall time within 1.5x of
   safetensors; their working set (peak RSS minus the RSS of the imports alone, which for DCP
   include torch.distributed.checkpoint) within 10% of the larger of --max-memory and
   safetensors' own; outputs byte-identical to the safetensors run's.
2. A LoRA run of the same base model (rank --lora-r on every linear weight but the embedding),
   `--lora-output merged`, against the full-weight safetensors run: time and RSS (information).

Inputs are warm in the page cache at every timed run; times are best of --repeats.

    .venv/bin/python bench/bench_formats.py [--quick] [--size-mb 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bema_cli.options import parse_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stabilize import COLUMNS, ENGINE_IMPORTS, MiB, interpreter_overhead, log, render, timed_tool  # noqa: E402
from measure import report, run_measured, tensor_bytes  # noqa: E402
from synth import Trajectory, make_trajectory  # noqa: E402

BEMA = Path(sys.executable).with_name("bema")
FORMATS = ("safetensors", "bin", "dcp")
WALL_TARGET = 1.5  # .bin / DCP wall time over safetensors
RSS_SLACK = 1.1  # .bin / DCP working set over max(safetensors' working set, --max-memory)


def convert(traj: Trajectory, work: Path, fmt: str) -> tuple[Path, Path, list[Path]]:
    """(run dir, base dir, input files) of the trajectory re-saved as fmt; one model in memory at a time."""
    if fmt == "safetensors":
        return traj.run, traj.base, traj.input_files()
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    pairs = [(traj.base, work / fmt / "base")]
    pairs += [(traj.checkpoint(s), work / fmt / "run" / f"checkpoint-{s}") for s in traj.steps]
    files = []
    for src, dst in pairs:
        dst.mkdir(parents=True)
        shutil.copy2(src / "config.json", dst / "config.json")
        state = load_file(src / "model.safetensors")
        if fmt == "bin":
            torch.save(state, dst / "pytorch_model.bin")
            files.append(dst / "pytorch_model.bin")
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
                dcp.save({"model": state}, checkpoint_id=str(dst / "pytorch_model_fsdp_0"), no_dist=True)
            files += sorted((dst / "pytorch_model_fsdp_0").iterdir())
    return work / fmt / "run", work / fmt / "base", files


def lora_run(traj: Trajectory, work: Path, rank: int) -> tuple[Path, list[Path]]:
    """PEFT-layout adapter checkpoints (adapter_config.json + adapter_model.safetensors) on traj.base:
    every 2-D linear weight adapted at `rank`, factors taking a random walk."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(traj.base / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    modules = {k: s for k, s in shapes.items() if len(s) == 2 and "embed" not in k}
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "base_model_name_or_path": str(traj.base),
    }
    config["target_modules"] = sorted({k.split(".")[-2] for k in modules})
    gen = torch.Generator().manual_seed(1)
    state = {}
    for k, (out_dim, in_dim) in modules.items():
        key = "base_model.model." + k.removesuffix(".weight")
        state[key + ".lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) / in_dim**0.5
        state[key + ".lora_B.weight"] = torch.zeros(out_dim, rank)
    files = [traj.base / "model.safetensors"]
    for s in traj.steps:
        for t in state.values():
            t.add_(torch.randn(t.shape, generator=gen), alpha=1e-3)
        folder = work / "lora" / f"checkpoint-{s}"
        folder.mkdir(parents=True)
        save_file(state, folder / "adapter_model.safetensors", {"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps(config))
        files.append(folder / "adapter_model.safetensors")
    return work / "lora", files


def stabilize_cmd(run: Path, base: Path, out: Path, max_memory: str) -> list[str]:
    return [
        str(BEMA),
        "stabilize",
        str(run),
        "--base",
        str(base),
        "--out",
        str(out),
        "--max-memory",
        max_memory,
    ]


def best(name: str, cmd: list[str], inputs: list[Path], out: Path, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        runs.append(timed_tool(name, cmd, inputs, "warm"))
    return {"seconds": min(r.seconds for r in runs), "rss": max(r.max_rss for r in runs)}


def same_outputs(out: Path, ref: Path) -> bool:
    """Every safetensors file of every output bitwise the reference run's tensors (measure.tensor_bytes)."""
    files = sorted(
        p.relative_to(ref)
        for p in ref.rglob("*.safetensors")
        if not p.relative_to(ref).parts[0].startswith(".")
    )  # the run folders; hidden state (follow mode's .bema-state) is keyed by the inputs' fingerprints
    return bool(files) and all(tensor_bytes(out / f) == tensor_bytes(ref / f) for f in files)


def rows(res: dict, args) -> list[tuple[str, str, str, str]]:
    table = []

    def add(check: str, measured: str, target: str = "(info)", ok: bool | None = None) -> None:
        table.append((check, measured, target, "" if ok is None else ("PASS" if ok else "FAIL")))

    st, lo = res["safetensors"], res["lora"]
    budget = parse_size(args.max_memory, "--max-memory")
    imports = {"safetensors": max(res["overhead_rss"].values()), "dcp": res["dcp_overhead_rss"]}
    imports["bin"] = imports["safetensors"]
    work = {fmt: res[fmt]["rss"] - imports[fmt] for fmt in FORMATS}  # peak RSS above the imports alone
    limit = max(work["safetensors"], budget) * RSS_SLACK
    add("safetensors: wall", f"{st['seconds']:.2f} s")
    for fmt in ("bin", "dcp"):
        ratio = res[fmt]["seconds"] / st["seconds"]
        measured = f"{ratio:.2f}  ({res[fmt]['seconds']:.2f} s)"
        add(f"{fmt}: wall / safetensors wall", measured, f"<= {WALL_TARGET}", ratio <= WALL_TARGET)
    add(
        "safetensors: peak RSS (working set)",
        f"{st['rss'] / MiB:.0f} MiB  ({work['safetensors'] / MiB:.0f} MiB)",
    )
    for fmt in ("bin", "dcp"):
        measured = f"{res[fmt]['rss'] / MiB:.0f} MiB  ({work[fmt] / MiB:.0f} MiB)"
        add(f"{fmt}: peak RSS (working set)", measured, f"<= {limit / MiB:.0f} MiB", work[fmt] <= limit)
    for fmt in ("bin", "dcp"):
        same = res[fmt]["identical"]
        add(f"{fmt}: outputs identical to safetensors", "yes" if same else "no", "yes", same)
    add(
        "LoRA merged: wall / full-weight wall",
        f"{lo['seconds'] / st['seconds']:.2f}  ({lo['seconds']:.2f} s)",
    )
    add("LoRA merged: peak RSS / full-weight", f"{lo['rss'] / st['rss']:.2f}  ({lo['rss'] / MiB:.0f} MiB)")
    return table


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes, 1 repeat: a smoke run (numbers mean nothing)"
    )
    ap.add_argument("--size-mb", type=float, default=100, help="bytes of one checkpoint's weights, in MB")
    ap.add_argument("--checkpoints", type=int, default=5)
    ap.add_argument(
        "--max-memory", default="64MiB", help="bema --max-memory (small enough to chunk the big tensor)"
    )
    ap.add_argument("--lora-r", type=int, default=16, help="rank of the LoRA run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per input; the best is reported")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch parent (default: $TMPDIR or /tmp)")
    ap.add_argument(
        "--json", action="store_true", help="raw numbers as one JSON document on stdout (table on stderr)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.checkpoints, args.repeats, args.max_memory, args.lora_r = 8, 3, 1, "16MiB", 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bema-bench-formats-", dir=args.workdir))
    res: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    res["loadavg_start"] = os.getloadavg()
    t0 = time.perf_counter()
    try:
        res["overhead_rss"], _ = interpreter_overhead(work, 1)
        # reading DCP imports torch.distributed.checkpoint: a fixed cost, whatever the model size
        dcp_imports = [sys.executable, "-c", ENGINE_IMPORTS + ", torch.distributed.checkpoint"]
        res["dcp_overhead_rss"] = max(run_measured(dcp_imports).max_rss, *res["overhead_rss"].values())
        traj = make_trajectory(work / "st", int(args.size_mb * 1e6), args.checkpoints)
        for fmt in FORMATS:
            log(f"{fmt}: writing the trajectory")
            run, base, inputs = convert(traj, work, fmt)
            out = work / f"out-{fmt}"
            res[fmt] = best(
                f"bema stabilize ({fmt})",
                stabilize_cmd(run, base, out, args.max_memory),
                inputs,
                out,
                args.repeats,
            )
            if fmt != "safetensors":
                res[fmt]["identical"] = same_outputs(out, work / "out-safetensors")
                shutil.rmtree(work / fmt)
        log("LoRA: writing adapter checkpoints")
        run, inputs = lora_run(traj, work, args.lora_r)
        out = work / "out-lora"
        res["lora"] = best(
            "bema stabilize (LoRA merged)",
            stabilize_cmd(run, traj.base, out, args.max_memory),
            inputs,
            out,
            args.repeats,
        )
        res["lora"]["adapter_bytes"] = sum(f.stat().st_size for f in inputs[1:]) // len(traj.steps)
        res["file_bytes"] = traj.file_bytes
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    res["bench_seconds"] = time.perf_counter() - t0
    table = rows(res, args)
    res["rows"] = [dict(zip(COLUMNS, r, strict=True)) for r in table]
    header = [
        f"bema stabilize input formats — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs",
        f"trajectory: base + {args.checkpoints} checkpoints x {res['file_bytes'] / 1e6:.0f} MB float32;"
        f" LoRA r={args.lora_r} adapters {res['lora']['adapter_bytes'] / 1e6:.1f} MB each; --max-memory {args.max_memory};"
        f" interpreter overhead {max(res['overhead_rss'].values()) / MiB:.0f} MiB"
        f" ({res['dcp_overhead_rss'] / MiB:.0f} MiB with torch.distributed.checkpoint for DCP)",
        f"inputs warm; best of {args.repeats}; load avg {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
        "",
    ]
    report(render(table, header), res, args.json)


if __name__ == "__main__":
    main()
