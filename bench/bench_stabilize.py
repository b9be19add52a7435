"""Benchmark `bema stabilize` (issue 2): one table of ratios, all measured in one run.

On a synthetic trajectory (base + N checkpoints, one tensor >= 100 MB) it measures
the I/O floor (read every input once + write as many output bytes), `bema stabilize`
(one config, all steps), a naive load_file/save_file peer (bench/naive_peer.py), a
6-config grid vs 1 config (both --final-only, which keeps no state), and peak RSS at 1x and a larger size.
Every timed run starts from the same page-cache state (default: inputs warm, i.e.
read once just before; `--cache cold` drops them). Repeats are interleaved; ratios are medians of back-to-back pairs.

    .venv/bin/python bench/bench_stabilize.py [--quick] [--size-mb 250] [--json]
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

from bema_cli.options import parse_size
from bema_cli.recurrence import Stabilizer
from bema_cli.schedule import Schedule, run_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import Run, machine, read_files, report, run_measured, set_cache, write_files  # noqa: E402
from synth import Trajectory, make_trajectory  # noqa: E402

BEMA = Path(sys.executable).with_name("bema")
PEER = Path(__file__).resolve().parent / "naive_peer.py"
ONE = {"method": "bema", "kappa": "0.5", "eta": "0.2"}
GRID = {"method": "bema", "kappa": "0.2,0.5", "eta": "0.2,0.4,inf"}  # 6 configs
# Fixed memory cost = peak RSS of importing what `bema stabilize` imports, and of a run on a tiny model.
ENGINE_IMPORTS = "import torch, safetensors.torch, bema_cli.cli, bema_cli.stabilize"
OVERHEAD_CMDS = {
    "imports of bema stabilize": [sys.executable, "-c", ENGINE_IMPORTS],
    "bema stabilize --help": [str(BEMA), "stabilize", "--help"],
}
MiB = 2**20
COLUMNS = ("check", "measured", "target", "result")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bema_cmd(traj: Trajectory, out: Path, config: dict, max_memory: str, final_only: bool) -> list[str]:
    cmd = [str(BEMA), "stabilize", str(traj.run), "--base", str(traj.base), "--out", str(out)]
    cmd += ["--method", config["method"], "--kappa", config["kappa"], "--eta", config["eta"]]
    cmd += ["--max-memory", max_memory, "--json"] + (["--final-only"] if final_only else [])
    return cmd


def peer_cmd(traj: Trajectory, out: Path) -> list[str]:
    return [sys.executable, str(PEER), str(traj.run), "--base", str(traj.base), "--out", str(out)] + [
        f"--{k}={v}" for k, v in ONE.items()
    ]


def final_output(out: Path, traj: Trajectory) -> Path:
    return out / run_name(schedules(ONE)[0]) / f"checkpoint-{traj.steps[-1]}" / "model.safetensors"


def max_rel_err(path: Path, ref: Path) -> float:
    """max over tensors of max|a - b| / max|b|, tensor by tensor (bounded memory)."""
    from safetensors import safe_open

    worst = 0.0
    with safe_open(str(path), "pt") as a, safe_open(str(ref), "pt") as b:
        if set(a.keys()) != set(b.keys()):
            return float("inf")
        for key in a.keys():
            x, y = a.get_tensor(key).double(), b.get_tensor(key).double()
            worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    return worst


def timed_tool(name: str, cmd: list[str], inputs: list[Path], cache: str) -> Run:
    set_cache(inputs, cache)
    log(f"{name} ...")
    run = run_measured(cmd)
    log(f"{name}: {run.seconds:.2f} s, peak RSS {run.max_rss / MiB:.0f} MiB")
    return run


def schedules(config: dict) -> list[Schedule]:
    return [
        Schedule(method=config["method"], kappa=float(k), eta=float(e))
        for k in config["kappa"].split(",")
        for e in config["eta"].split(",")
    ]


def compute_floor(numel: int, steps: int, config: dict, every_step: bool = True, chunk: int = 2**23) -> float:
    """Seconds of the recurrence alone (no I/O) on in-memory fp32 chunks covering `numel` elements, as
    the engine's inner loop runs it: every config's state advances at every step; its output is
    computed at every step (`every_step`) or only at the last (--final-only)."""
    import torch

    from bema_cli.schedule import PlannedStep, state_key

    gen = torch.Generator().manual_seed(0)
    theta0, theta = torch.randn(chunk, generator=gen), torch.randn(chunk, generator=gen)
    n_chunks = -(-numel // chunk)
    event = PlannedStep(1, "update", 0.3, 0.1)
    drift, out = torch.empty_like(theta), torch.empty_like(theta)
    configs = schedules(config)
    t0 = time.perf_counter()
    for _ in range(n_chunks):
        # one state per distinct state_key, as the engine keeps (bema at one kappa shares its EMA)
        stabs = {state_key(s): Stabilizer(s.method, theta0) for s in configs}
        for i in range(steps):
            emit = every_step or i == steps - 1
            for stab in stabs.values():
                stab.advance(event, theta)
            if emit:
                torch.sub(theta, theta0, out=drift)
                for s in configs:
                    stabs[state_key(s)].estimate(event, theta, drift=drift, out=out, method=s.method)
    return (time.perf_counter() - t0) * numel / (n_chunks * chunk)


def bench_size(traj: Trajectory, work: Path, args, full: bool) -> dict:
    """All measurements on one trajectory; `full` adds the floor, the grid and repeats."""
    inputs = traj.input_files()
    res: dict = {
        "file_bytes": traj.file_bytes,
        "big_tensor_bytes": traj.big_tensor_bytes,
        "inputs": len(inputs),
    }
    res.update(
        {
            k: []
            for k in (
                "floor_read",
                "floor_write",
                "compute1",
                "compute1f",
                "compute6",
                "bema",
                "bema_engine",
                "peer",
                "grid1",
                "grid6",
            )
        }
    )
    res.update({"bema_rss": 0, "peer_rss": 0, "grid1_rss": 0, "grid6_rss": 0})
    out = work / "out"
    for rep in range(args.repeats if full else 1):
        if full:
            set_cache(inputs, args.cache)
            res["floor_read"].append(read_files(inputs))
            sizes = {out / f"checkpoint-{s}" / "model.safetensors": traj.file_bytes for s in traj.steps}
            res["floor_write"].append(write_files(sizes))
            shutil.rmtree(out)
            log(f"floor: read {res['floor_read'][-1]:.2f} s + write {res['floor_write'][-1]:.2f} s")
            res["compute1"].append(compute_floor(traj.numel, len(traj.steps), ONE))
            res["compute1f"].append(compute_floor(traj.numel, len(traj.steps), ONE, every_step=False))
            res["compute6"].append(compute_floor(traj.numel, len(traj.steps), GRID, every_step=False))
            log(
                f"compute only: 1 config {res['compute1'][-1]:.2f} s; --final-only: 1 config "
                f"{res['compute1f'][-1]:.2f} s, 6 configs {res['compute6'][-1]:.2f} s"
            )
        run = timed_tool(
            "bema stabilize, 1 config", bema_cmd(traj, out, ONE, args.max_memory, False), inputs, args.cache
        )
        res["bema"].append(run.seconds)
        res["bema_engine"].append(json.loads(run.stdout).get("seconds"))
        res["bema_rss"] = max(res["bema_rss"], run.max_rss)
        kept = work / "bema-final.safetensors"
        if rep == 0:
            os.replace(final_output(out, traj), kept)
        shutil.rmtree(out)
        if full or args.peer_large:
            run = timed_tool("naive peer", peer_cmd(traj, out), inputs, args.cache)
            res["peer"].append(run.seconds)
            res["peer_rss"] = max(res["peer_rss"], run.max_rss)
            if rep == 0:
                res["max_rel_err"] = max_rel_err(kept, final_output(out, traj))
            shutil.rmtree(out)
        kept.unlink(missing_ok=True)
        if full:
            for name, config in (("grid1", ONE), ("grid6", GRID)):
                run = timed_tool(
                    f"{name} --final-only",
                    bema_cmd(
                        traj, out, config, args.max_memory, True
                    ),  # --final-only: no state (a one-off sweep)
                    inputs,
                    args.cache,
                )
                res[name].append(run.seconds)
                res[f"{name}_rss"] = max(res[f"{name}_rss"], run.max_rss)
                shutil.rmtree(out)
    return res


def interpreter_overhead(work: Path, repeats: int) -> tuple[dict[str, int], list[float]]:
    """Peak RSS that does not grow with the model: the imports, and a whole `bema stabilize` run on
    a 64 kB model (torch's first-op allocations, the progress/JSON machinery, the state writer).
    The memory bound is --max-memory on top of the largest of these. The 64 kB run's wall times are
    the start-up (interpreter, torch import, planning, commit, exit) every run pays whatever its size."""
    tiny = make_trajectory(work / "overhead", 64_000, 2)
    runs = {name: run_measured(cmd).max_rss for name, cmd in OVERHEAD_CMDS.items()}
    # the grid's own fixed cost (a state writer and buffers per config) does not grow with the model
    # either: the 6-config bound must not charge it to --max-memory (it sat within 2 MiB of the bound)
    run = run_measured(bema_cmd(tiny, work / "overhead-out", GRID, "16MiB", final_only=True))
    runs["bema stabilize, grid of 6, on a 64 kB model"] = run.max_rss
    shutil.rmtree(work / "overhead-out")
    startup = []
    for _ in range(repeats):
        run = run_measured(bema_cmd(tiny, work / "overhead-out", ONE, "16MiB", final_only=False))
        runs["bema stabilize on a 64 kB model"] = max(
            runs.get("bema stabilize on a 64 kB model", 0), run.max_rss
        )
        startup.append(run.seconds)
        shutil.rmtree(work / "overhead-out")
    shutil.rmtree(work / "overhead")
    return runs, startup


def median_ratio(xs: list[float], ys: list[float]) -> float:
    """Median over repeats of x_i / y_i: each pair was measured back to back, so a slow moment of the
    shared machine (the page-cache write speed here moves by 3x between minutes) hits both."""
    return statistics.median(x / y for x, y in zip(xs, ys, strict=True))


def rows(r: dict, args) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, PASS/FAIL; '' for information rows) for the table."""
    out: list[tuple[str, str, str, str]] = []

    def add(check: str, measured: str, target: str = "(info)", ok: bool | None = None) -> None:
        out.append((check, measured, target, "" if ok is None else ("PASS" if ok else "FAIL")))

    a, big, k = r["x1"], r.get("xL"), args.large_factor
    floors = [x + y for x, y in zip(a["floor_read"], a["floor_write"], strict=True)]
    floor = statistics.median(floors)
    bema, peer = statistics.median(a["bema"]), statistics.median(a["peer"])
    c1, c1f, c6 = min(a["compute1"]), min(a["compute1f"]), min(a["compute6"])
    engine = [x for x in a["bema_engine"] if x is not None]
    startup = min(r["startup"])
    bound = parse_size(args.max_memory, "--max-memory") + max(r["overhead_rss"].values())
    gb = a["file_bytes"] / 1e9
    read_s, write_s = statistics.median(a["floor_read"]), statistics.median(a["floor_write"])
    n_in = a["inputs"]
    spread = f"{min(floors):.2f}-{max(floors):.2f}"
    add(
        "I/O floor: read inputs + write outputs (median)",
        f"{floor:.2f} s ({n_in * gb:.2f} GB in {read_s:.2f} s + {(n_in - 1) * gb:.2f} GB out {write_s:.2f} s; range {spread})",
        "",
    )
    add("start-up: a whole bema stabilize on a 64 kB model (best)", f"{startup:.2f} s")
    net = median_ratio([b - startup for b in a["bema"]], floors)
    add(
        "bema stabilize 1 config, all steps: (wall - start-up) / floor",
        f"{net:.2f}  ({bema:.2f} - {startup:.2f} s)",
        "<= 1.6",  # issue 16 (its measurement was net of start-up)
        net <= 1.6,
    )
    add("  same, wall / floor", f"{median_ratio(a['bema'], floors):.2f}  ({bema:.2f} s)")
    if len(engine) == len(floors):
        add("  same, engine time (--json seconds) / floor", f"{median_ratio(engine, floors):.2f}")
    add("  compute floor (the recurrence alone, in memory)", f"{c1:.2f} s")
    to_peer = median_ratio(a["bema"], a["peer"])
    add(
        "naive peer: bema wall / peer wall",
        f"{to_peer:.2f}  (peer {peer:.2f} s)",
        "<= 0.5",  # issue 16
        to_peer <= 0.5,
    )
    add(
        "  peer wall / floor (the peer's own distance to the floor)", f"{median_ratio(a['peer'], floors):.2f}"
    )
    # no tool that imports torch, reads the inputs and writes the outputs can go below this
    least = median_ratio([f + startup for f in floors], a["peer"])
    add("  lower bound for any tool: (floor + start-up) / peer wall", f"{least:.2f}")
    if big and big["peer"]:
        b, p = big["bema"][0], big["peer"][0]
        add(f"  same at {k}x model size", f"{b / p:.2f}  ({b:.2f} / {p:.2f} s)")
    ratio1 = a["bema_rss"] / a["peer_rss"]
    rss = f"{a['bema_rss'] / MiB:.0f} / {a['peer_rss'] / MiB:.0f} MiB"
    add("naive peer: bema peak RSS / peer peak RSS", f"{ratio1:.2f}  ({rss})", "<= 0.5", ratio1 <= 0.5)
    if big and big["peer_rss"]:
        ratio = big["bema_rss"] / big["peer_rss"]
        rss = f"{big['bema_rss'] / MiB:.0f} / {big['peer_rss'] / MiB:.0f} MiB"
        add(
            f"  same at {k}x model size",
            f"{ratio:.2f}  ({rss})",
            f"<= 0.5, < {ratio1:.2f}",
            ratio <= 0.5 and ratio < ratio1,
        )
    g1, g6 = statistics.median(a["grid1"]), statistics.median(a["grid6"])
    grid = median_ratio(a["grid6"], a["grid1"])
    add(
        "grid 6 configs / 1 config (--final-only)",
        f"{grid:.2f}  ({g6:.2f} / {g1:.2f} s)",
        "<= 1.5",
        grid <= 1.5,
    )
    add("  compute floor, 6 configs / 1 config (--final-only)", f"{c6 / c1f:.2f}  ({c6:.2f} / {c1f:.2f} s)")
    target = f"<= {bound / MiB:.0f} MiB"
    add(
        "bema peak RSS, 1x (1 config, all steps)",
        f"{a['bema_rss'] / MiB:.0f} MiB",
        target,
        a["bema_rss"] <= bound,
    )
    add(
        "bema peak RSS, 1x grid of 6 (--final-only)",
        f"{a['grid6_rss'] / MiB:.0f} MiB",
        target,
        a["grid6_rss"] <= bound,
    )
    if big:
        add(
            f"bema peak RSS, {k}x (1 config, all steps)",
            f"{big['bema_rss'] / MiB:.0f} MiB",
            target,
            big["bema_rss"] <= bound,
        )
    tol = 1e-6 if args.dtype == "float32" else 1e-2
    err = a.get("max_rel_err", float("nan"))
    add("bema final output vs naive peer: max rel err", f"{err:.1e}", f"<= {tol:g}", err <= tol)
    return out


def render(table: list[tuple[str, str, str, str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [COLUMNS, *table]) for i in range(len(COLUMNS))]

    def fmt(row: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([*header, fmt(COLUMNS), fmt(tuple("-" * w for w in widths)), *map(fmt, table)])


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes, 1 repeat: a smoke run (numbers mean nothing)"
    )
    ap.add_argument(
        "--size-mb", type=float, default=250, help="bytes of one checkpoint's model.safetensors, in MB"
    )
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--max-memory",
        default="512MiB",
        help="bema --max-memory (small enough that the big tensor is chunked)",
    )
    ap.add_argument(
        "--large-factor", type=int, default=4, help="size multiplier of the peak-RSS run (0: skip it)"
    )
    ap.add_argument(
        "--no-peer-large", dest="peer_large", action="store_false", help="skip the peer at the large size"
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs per tool at 1x, interleaved; medians are reported"
    )
    ap.add_argument(
        "--cache", choices=["warm", "cold"], default="warm", help="page-cache state of the inputs at each run"
    )
    ap.add_argument("--workdir", type=Path, default=None, help="scratch parent (default: $TMPDIR or /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument(
        "--json", action="store_true", help="raw numbers as one JSON document on stdout (table on stderr)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.checkpoints, args.repeats, args.max_memory = 8, 4, 1, "16MiB"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bema-bench-", dir=args.workdir))
    res: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    res["machine"] = machine()
    res["loadavg_start"] = os.getloadavg()
    t0 = time.perf_counter()
    try:
        res["overhead_rss"], res["startup"] = interpreter_overhead(work, max(args.repeats, 3))
        size = int(args.size_mb * 1e6)
        log(
            f"writing base + {args.checkpoints} checkpoints of {size / 1e6:.0f} MB ({args.dtype}) under {work}"
        )
        traj = make_trajectory(work / "x1", size, args.checkpoints, args.dtype)
        res["x1"] = bench_size(traj, work, args, full=True)
        shutil.rmtree(work / "x1")
        if args.large_factor:
            log(f"writing the {args.large_factor}x trajectory")
            traj = make_trajectory(work / "xL", size * args.large_factor, args.checkpoints, args.dtype)
            res["xL"] = bench_size(traj, work, args, full=False)
            shutil.rmtree(work / "xL")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    res["bench_seconds"] = time.perf_counter() - t0
    table = rows(res, args)
    res["rows"] = [dict(zip(COLUMNS, r, strict=True)) for r in table]
    a = res["x1"]
    header = [
        f"bema stabilize benchmark — {res['machine']['date']}, {res['machine']['cpus']} CPUs, {res['machine']['mem_gib']} GiB RAM",
        f"trajectory: base + {args.checkpoints} checkpoints x {a['file_bytes'] / 1e6:.0f} MB {args.dtype}"
        f" (largest tensor {a['big_tensor_bytes'] / 1e6:.0f} MB); --max-memory {args.max_memory};"
        f" fixed overhead (imports, 64 kB runs) {max(res['overhead_rss'].values()) / MiB:.0f} MiB",
        f"page cache: inputs {args.cache.upper()} at every timed run; outputs not fsynced; {args.repeats} interleaved"
        " repeats, ratios are medians of back-to-back pairs;"
        f" load avg {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
        "",
    ]
    report(render(table, header), res, args.json)


if __name__ == "__main__":
    main()
