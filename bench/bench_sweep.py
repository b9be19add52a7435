"""Benchmark `bema sweep` against the disk path (`bema stabilize` then `bema eval`): one table, one run.

A demo-size model (bema demo's Qwen2: 2 layers x 128 hidden) walks a noisy trajectory of
--checkpoints checkpoints (one every 10 steps); a grid of 4 configs (bema, ema, lawa w8,
wsm minus-sqrt w8) is evaluated at 5 steps on held-out loss and one generation task (gsm8k,
sampled), on one backend (vllm when it imports, else transformers). Both paths run as real
`bema` processes under /usr/bin/time (wall, peak RSS); measured:

1. bytes of weights written (the sweep's must be 0);
2. wall time of the sweep vs the disk path, and the part outside the engine's generate and
   loss calls (wall minus the records' `seconds`: reads, state updates, weight loads, engine
   start-ups, writes), whose ratio must be <= 0.5;
3. engine starts of each path (the sweep: one);
4. the sweep's peak RSS against the estimate it made before reading anything.

    .venv/bin/python bench/bench_sweep.py [--quick] [--checkpoints 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stabilize import COLUMNS, MiB, log, render  # noqa: E402
from measure import machine, report, run_measured  # noqa: E402

BEMA = Path(sys.executable).with_name("bema")
GRID = ["--method", "bema,ema,lawa,wsm", "--window", "8", "--schedule", "minus-sqrt"]
OUTSIDE_TARGET = 0.5  # sweep's time outside generate/loss / the disk path's


SIZES = {  # make_tiny_model's arguments; head_dim 32 or 64 (vLLM's CPU attention)
    "quick": {"hidden_size": 64, "num_heads": 2},
    "demo": {"hidden_size": 128, "num_heads": 4, "intermediate_size": 384},  # bema demo's model
    "medium": {"hidden_size": 512, "num_heads": 8, "num_layers": 4, "intermediate_size": 1536},  # ~56 MB fp32
}


def make_world(root: Path, checkpoints: int, quick: bool, model: str = "demo") -> dict:
    """The demo's model shape, a noisy trajectory away from it, task data and held-out loss records."""
    import torch
    from safetensors.torch import load_file, save_file

    from bema_cli.demo.tinymodel import make_tiny_model

    size = SIZES["quick" if quick else model]
    base = make_tiny_model(root / "base", seed=0, **size)
    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for i in range(1, checkpoints + 1):
        weights = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
        folder = root / "run" / f"checkpoint-{10 * i}"
        shutil.copytree(base, folder)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    data = root / "data"
    data.mkdir()
    gsm = [
        {"question": f"what is {i} plus {i + 1}", "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}
        for i in range(16)
    ]
    (data / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    chat = [{"messages": [{"role": "user", "content": f"count from {i}"},
                          {"role": "assistant", "content": " ".join(str(i + j) for j in range(8))}]} for i in range(32)]  # fmt: skip
    (data / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    return {
        "base": base,
        "run": root / "run",
        "data": data,
        "mb": (base / "model.safetensors").stat().st_size / 1e6,
    }


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors")) if folder.exists() else 0


def in_records(results: Path) -> float:
    """Seconds the records say their generate/loss calls (and scoring) took."""
    return sum(json.loads(line)["seconds"] for line in results.read_text().splitlines() if line.strip())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (numbers mean nothing)")
    ap.add_argument("--checkpoints", type=int, default=50)
    ap.add_argument("--model", default="demo", choices=["demo", "medium"], help="the model's size (SIZES)")
    ap.add_argument("--backend", default="auto", choices=["auto", "vllm", "transformers"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="raw numbers on stdout (table on stderr)")
    args = ap.parse_args(argv)
    if args.quick:
        args.checkpoints, args.repeats = 10, 1
    return args


def one_pair(world: dict, root: Path, at: list[int], protocol: list, i: int) -> dict:
    """One sweep, then one disk path (stabilize + eval), back to back; their numbers."""
    steps = ",".join(map(str, at))
    started = time.time()
    sweep = run_measured([BEMA, "sweep", world["run"], "--base", world["base"], "--out", root / f"sweep{i}",
                          *GRID, "--at", steps, *protocol, "--json"])  # fmt: skip
    doc = json.loads(sweep.stdout)
    stab = run_measured([BEMA, "stabilize", world["run"], "--base", world["base"], "--out", root / f"stab{i}",
                         *GRID, "--steps", steps, "--json"])  # fmt: skip
    raw = [world["run"] / f"checkpoint-{s}" for s in at]
    ev = run_measured([BEMA, "eval", root / f"stab{i}", *raw, "--out", root / f"disk{i}", *protocol])
    sweep_in, disk_in = (
        in_records(root / f"sweep{i}" / "results.jsonl"),
        in_records(root / f"disk{i}" / "results.jsonl"),
    )
    # the one-time start-up (interpreter, imports, engine start) and the engine's teardown at exit are
    # the same on both paths: also compared without them (the sweep's, measured, taken off both)
    fixed = (doc["engine_ready_at"] - started) + (started + sweep.seconds - doc["finished_at"])
    pair = {
        "sweep_s": sweep.seconds, "disk_s": stab.seconds + ev.seconds, "stabilize_s": stab.seconds, "eval_s": ev.seconds,
        "sweep_in": sweep_in, "disk_in": disk_in, "sweep_out": sweep.seconds - sweep_in,
        "disk_out": stab.seconds + ev.seconds - disk_in, "fixed": fixed, "max_rss": sweep.max_rss,
        "estimate": doc["memory"]["estimate"], "parts": doc["memory"]["parts"], "walk_s": doc["walk_s"],
        "starts": {"sweep": sweep.stderr.count("starting vLLM engine") or doc["engine_starts"],
                   "disk": ev.stderr.count("starting vLLM engine") or 1},
        "written": {"sweep": weight_bytes(root / f"sweep{i}"), "disk": weight_bytes(root / f"stab{i}")},
    }  # fmt: skip
    log(f"pair {i}: sweep {sweep.seconds:.1f} s (peak RSS {sweep.max_rss / MiB:.0f} MiB); "
        f"stabilize {stab.seconds:.1f} s + eval {ev.seconds:.1f} s")  # fmt: skip
    return pair


def main(argv=None) -> None:
    args = parse_args(argv)
    from bema_cli.eval.backends.base import vllm_usable

    backend = args.backend if args.backend != "auto" else ("vllm" if vllm_usable() else "transformers")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    root = Path(tempfile.mkdtemp(prefix="bema-bench-sweep-", dir=args.workdir))
    try:
        world = make_world(root, args.checkpoints, args.quick, args.model)
        last = 10 * args.checkpoints
        at = [last * k // 5 // 10 * 10 for k in range(1, 6)]  # 5 evaluation steps, the last one included
        protocol = ["--tasks", "gsm8k,loss", "--data-dir", world["data"], "--loss-data", world["data"] / "heldout.jsonl",
                    "--n-samples", "2", "--max-new-tokens", "16", "--limit", "16", "--backend", backend]  # fmt: skip
        log(f"trajectory: {args.checkpoints} checkpoints; grid of 4 at steps {at}; backend {backend}")
        pairs = [one_pair(world, root, at, protocol, i) for i in range(args.repeats)]
        med = {k: statistics.median(p[k] for p in pairs) for k in ("sweep_s", "disk_s", "sweep_in", "disk_in",
                                                                 "sweep_out", "disk_out", "fixed")}  # fmt: skip
        wall = statistics.median(p["sweep_s"] / p["disk_s"] for p in pairs)
        outside = statistics.median(p["sweep_out"] / p["disk_out"] for p in pairs)
        variable = statistics.median(
            (p["sweep_out"] - p["fixed"]) / (p["disk_out"] - p["fixed"]) for p in pairs
        )
        last_pair = pairs[-1]
        rss, estimate = max(p["max_rss"] for p in pairs), last_pair["estimate"]
        written, starts = last_pair["written"], last_pair["starts"]
        table = [
            ("weights written: sweep", f"{written['sweep']} B (disk path {written['disk'] / 1e6:.1f} MB)", "0",
             "PASS" if all(p["written"]["sweep"] == 0 for p in pairs) else "FAIL"),
            ("wall: sweep / disk path", f"{med['sweep_s']:.1f} s / {med['disk_s']:.1f} s -> {wall:.2f}", "< 1",
             "PASS" if wall < 1 else "FAIL"),
            ("  in generate + loss", f"{med['sweep_in']:.1f} s / {med['disk_in']:.1f} s", "-", "-"),
            ("  outside them", f"{med['sweep_out']:.1f} s / {med['disk_out']:.1f} s -> {outside:.2f}",
             f"<= {OUTSIDE_TARGET}", "PASS" if outside <= OUTSIDE_TARGET else "FAIL"),
            ("  outside, start-up/exit excluded", f"{med['sweep_out'] - med['fixed']:.1f} s / "
             f"{med['disk_out'] - med['fixed']:.1f} s -> {variable:.2f} (start-up + exit {med['fixed']:.1f} s)",
             f"<= {OUTSIDE_TARGET}", "PASS" if variable <= OUTSIDE_TARGET else "FAIL"),
            ("resume cost: the walk alone", f"{statistics.median(p['walk_s'] for p in pairs):.2f} s for "
             f"{args.checkpoints} checkpoints (reads + state updates)", "-", "-"),
            ("engine starts", f"sweep {starts['sweep']}, disk path {starts['disk']}", "sweep 1",
             "PASS" if all(p["starts"]["sweep"] == 1 for p in pairs) else "FAIL"),
            ("peak RSS vs estimate", f"{rss / MiB:.0f} MiB vs {estimate / MiB:.0f} MiB ({rss / estimate:.2f})",
             "<= 1", "PASS" if rss <= estimate else "FAIL"),
        ]  # fmt: skip
        res = {"machine": machine(), "backend": backend, "model": args.model, "model_mb": world["mb"],
               "checkpoints": args.checkpoints, "steps": at, "pairs": pairs,
               "rows": [dict(zip(COLUMNS, r, strict=True)) for r in table]}  # fmt: skip
        header = [
            f"bema sweep benchmark — {res['machine']['date']}, {res['machine']['cpus']} CPUs, {res['machine']['mem_gib']} GiB RAM",
            f"{args.checkpoints} checkpoints of a {args.model}-size model ({world['mb']:.1f} MB fp32); 4 configs + vanilla"
            f" at 5 steps; gsm8k (16 prompts x 2 samples, 16 tokens) + held-out loss (32 records); backend {backend};"
            f" {args.repeats} back-to-back pairs, ratios are medians of the pairs'",
            "",
        ]
        report(render(table, header), res, args.json)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
