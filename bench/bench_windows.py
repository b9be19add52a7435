"""Benchmark the window and schedule-weighted averages (issue 21): one table of ratios, one run.

On a synthetic trajectory (bench/synth.py: base + N checkpoints) it measures, with the inputs
warm in the page cache at every timed run and repeats interleaved (ratios: medians of
back-to-back pairs):

1. the grid {bema, ema, lawa w8, wsm minus-sqrt w8, swa, power sr 0.1} written at every step vs
   one bema config written at every step (both --no-state: outputs only), and each against the
   I/O floor of its own bytes (read the inputs once, write as many output bytes);
2. the bytes the grid reads (its --json read_bytes) vs the inputs' tensor bytes;
3. `--method wsm --window 8` at every step vs a Megatron-style per-merge peer
   (bench/megatron_peer.py: each output reads its K window checkpoints whole): bytes read, wall
   time, and the largest difference between the two tools' outputs;
4. peak RSS of the grid vs --max-memory plus the fixed interpreter overhead.

    .venv/bin/python bench/bench_windows.py [--quick] [--size-mb 100] [--checkpoints 24] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stabilize import COLUMNS, MiB, interpreter_overhead, log, max_rel_err, median_ratio, render  # noqa: E402
from measure import common_args, machine, read_files, report, run_measured, set_cache, write_files  # noqa: E402
from synth import Trajectory, make_trajectory  # noqa: E402

from bema_cli.options import parse_size  # noqa: E402

BEMA = Path(sys.executable).with_name("bema")
PEER = Path(__file__).resolve().parent / "megatron_peer.py"
WINDOW = 8
ONE = ["--method", "bema"]
GRID = ["--method", "bema,ema,lawa,wsm,swa,power", "--window", str(WINDOW), "--schedule", "minus-sqrt"]
GRID += ["--sigma-rel", "0.1"]
GRID_RUNS = 6
WSM = ["--method", "wsm", "--window", str(WINDOW), "--schedule", "minus-sqrt"]
GRID_TARGET = 1.5  # grid wall / one config wall
PEER_TIME_TARGET = 0.3  # bema wsm wall / peer wall, at K = 8


def bema(traj: Trajectory, out: Path, flags: list[str], max_memory: str) -> list[str]:
    cmd = [str(BEMA), "stabilize", str(traj.run), "--base", str(traj.base), "--out", str(out)]
    return cmd + flags + ["--max-memory", max_memory, "--no-state", "--json"]


def timed(name: str, cmd: list[str], inputs: list[Path]):
    set_cache(inputs, "warm")
    run = run_measured(cmd)
    log(f"{name}: {run.seconds:.2f} s, peak RSS {run.max_rss / MiB:.0f} MiB")
    return run


def tensor_bytes(files: list[Path]) -> int:
    """Bytes of tensor data in safetensors files: each file less its 8-byte length and JSON header."""
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            total += f.stat().st_size - 8 - int.from_bytes(fh.read(8), "little")
    return total


def measure(traj: Trajectory, work: Path, args) -> dict:
    inputs = traj.input_files()
    checkpoints = inputs[1:]
    res: dict = {
        k: [] for k in ("one", "grid", "wsm", "peer", "floor1", "floor_grid", "write1", "one_fo", "grid_fo")
    }
    res.update(
        grid_rss=0,
        inputs_tensor_bytes=tensor_bytes(inputs),
        checkpoint_tensor_bytes=tensor_bytes(checkpoints),
    )
    out = work / "out"
    n_out = len(traj.steps)
    for rep in range(args.repeats):
        set_cache(inputs, "warm")
        read = read_files(inputs)
        res["write1"].append(write_files({out / f"o{s}": traj.file_bytes for s in range(n_out)}))
        res["floor1"].append(read + res["write1"][-1])
        shutil.rmtree(out)
        set_cache(inputs, "warm")
        read = read_files(inputs)
        res["floor_grid"].append(
            read + write_files({out / f"o{s}": traj.file_bytes for s in range(n_out * GRID_RUNS)})
        )
        shutil.rmtree(out)
        log(f"floors: 1 config {res['floor1'][-1]:.2f} s, grid of {GRID_RUNS} {res['floor_grid'][-1]:.2f} s")
        run = timed("bema, 1 config, every step", bema(traj, out, ONE, args.max_memory), inputs)
        res["one"].append(run.seconds)
        shutil.rmtree(out)
        run = timed("grid of 6, every step", bema(traj, out, GRID, args.max_memory), inputs)
        res["grid"].append(run.seconds)
        res["grid_rss"] = max(res["grid_rss"], run.max_rss)
        res["grid_read_bytes"] = json.loads(run.stdout)["read_bytes"]
        shutil.rmtree(out)
        for key, flags in (("one_fo", ONE), ("grid_fo", GRID)):  # the pass itself: one output per run
            run = timed(
                f"{key}: --final-only", bema(traj, out, [*flags, "--final-only"], args.max_memory), inputs
            )
            res[key].append(run.seconds)
            shutil.rmtree(out)
        run = timed("bema wsm w8, every step", bema(traj, out, WSM, args.max_memory), inputs)
        res["wsm"].append(run.seconds)
        res["wsm_read_bytes"] = json.loads(run.stdout)["read_bytes"]
        peer_out = work / "peer"
        run = timed(
            "Megatron-style peer, every step",
            [sys.executable, str(PEER), str(traj.run), "--out", str(peer_out)],
            inputs,
        )
        res["peer"].append(run.seconds)
        res["peer_read_bytes"] = json.loads(run.stdout)["read_bytes"]
        if rep == 0:
            name = f"wsm-minus_sqrt-w{WINDOW}"
            res["max_rel_err"] = max(
                max_rel_err(out / name / f"checkpoint-{s}" / "model.safetensors",
                            peer_out / name / f"checkpoint-{s}" / "model.safetensors")
                for s in traj.steps
            )  # fmt: skip
        shutil.rmtree(out)
        shutil.rmtree(peer_out)
    return res


def rows(r: dict, args, overhead: int) -> list[tuple[str, str, str, str]]:
    out: list[tuple[str, str, str, str]] = []

    def add(check: str, measured: str, target: str = "(info)", ok: bool | None = None) -> None:
        out.append((check, measured, target, "" if ok is None else ("PASS" if ok else "FAIL")))

    grid = median_ratio(r["grid"], r["one"])
    add(
        f"grid of {GRID_RUNS} / 1 bema config (every step)",
        f"{grid:.2f}  ({min(r['grid']):.2f} / {min(r['one']):.2f} s)",
        f"<= {GRID_TARGET}",
        grid <= GRID_TARGET,
    )
    add(
        "  I/O floor of the grid's bytes / of one config's",
        f"{median_ratio(r['floor_grid'], r['floor1']):.2f}",
    )
    add("  grid wall / its I/O floor", f"{median_ratio(r['grid'], r['floor_grid']):.2f}")
    add("  1 config wall / its I/O floor", f"{median_ratio(r['one'], r['floor1']):.2f}")
    add(
        "  grid / 1 config, --final-only (the pass without the writes)",
        f"{median_ratio(r['grid_fo'], r['one_fo']):.2f}  ({min(r['grid_fo']):.2f} / {min(r['one_fo']):.2f} s)",
    )
    same = r["grid_read_bytes"] == r["inputs_tensor_bytes"]
    add(
        "grid bytes read = inputs' tensor bytes",
        f"{r['grid_read_bytes']} vs {r['inputs_tensor_bytes']}",
        "equal",
        same,
    )
    k, n = WINDOW, args.checkpoints
    ratio = r["wsm_read_bytes"] / r["peer_read_bytes"]
    bound = n / sum(min(k, i) for i in range(1, n + 1))  # each input once vs sum_i min(K, i) loads
    add(
        f"wsm w{k}: bytes read / Megatron-style peer's",
        f"{ratio:.4f}  ({r['wsm_read_bytes'] / 1e9:.2f} / {r['peer_read_bytes'] / 1e9:.2f} GB)",
        f"<= 1/K = {1 / k:.4f}",
        ratio <= 1 / k,
    )
    add("  one-read-pass bound N / sum_i min(K, i) at this N", f"{bound:.4f}")
    time_ratio = median_ratio(r["wsm"], r["peer"])
    add(
        f"wsm w{k}: wall / Megatron-style peer's",
        f"{time_ratio:.2f}  ({min(r['wsm']):.2f} / {min(r['peer']):.2f} s)",
        f"<= {PEER_TIME_TARGET}",
        time_ratio <= PEER_TIME_TARGET,
    )
    net = median_ratio(
        [w - f for w, f in zip(r["wsm"], r["write1"], strict=True)],
        [p - f for p, f in zip(r["peer"], r["write1"], strict=True)],
    )
    add(
        "  same, both net of writing the outputs (the write floor)",
        f"{net:.2f}  (write floor {min(r['write1']):.2f} s)",
    )
    add(
        "  max relative difference, bema vs peer outputs",
        f"{r['max_rel_err']:.2e}",
        "<= 1e-5",
        r["max_rel_err"] <= 1e-5,
    )
    bound_rss = parse_size(args.max_memory, "--max-memory") + overhead
    add(
        "grid peak RSS",
        f"{r['grid_rss'] / MiB:.0f} MiB",
        f"<= {bound_rss / MiB:.0f} MiB (--max-memory + fixed overhead)",
        r["grid_rss"] <= bound_rss,
    )
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, size_mb=100, checkpoints=24)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.checkpoints, args.repeats, args.max_memory = 4, 10, 1, "64MiB"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bema-bench-windows-", dir=args.workdir))
    res: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    res["machine"] = machine()
    res["loadavg_start"] = os.getloadavg()
    try:
        res["overhead_rss"], _ = interpreter_overhead(work, 1)
        traj = make_trajectory(work / "x1", int(args.size_mb * 1e6), args.checkpoints, args.dtype)
        log(
            f"trajectory: base + {args.checkpoints} checkpoints of {traj.file_bytes / 1e6:.0f} MB ({args.dtype})"
        )
        res["x1"] = measure(traj, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    table = rows(res["x1"], args, max(res["overhead_rss"].values()))
    res["rows"] = [dict(zip(COLUMNS, row, strict=True)) for row in table]
    header = [
        f"bema window averages benchmark — {res['machine']['date']}, {res['machine']['cpus']} CPUs",
        f"trajectory: base + {args.checkpoints} checkpoints x {res['x1']['checkpoint_tensor_bytes'] / args.checkpoints / 1e6:.0f} MB"
        f" {args.dtype}; --max-memory {args.max_memory}; K = {WINDOW}; inputs warm; {args.repeats} interleaved repeats;"
        f" load avg {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
        "",
    ]
    report(render(table, header), res, args.json)


if __name__ == "__main__":
    main()
