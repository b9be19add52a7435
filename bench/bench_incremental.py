"""Benchmark incremental `bema stabilize` and `--follow`: one table, every number measured in one run.

1. Incremental cost: on a synthetic trajectory (bench/synth.py, base + 10 checkpoints), a
   one-shot run over all 10 vs a re-run that finds OUT's state after 9 and processes only
   the 10th (state read + write, theta0, the new checkpoint, its output). Target: <= 0.3x the
   one-shot wall time, peak RSS within the same bound (--max-memory + interpreter overhead),
   and the 10th output byte-identical to the one-shot's.
2. `--follow`, idle: CPU time the follower process uses over --idle-seconds (60) with nothing
   new to do (it sleeps between polls). Target: ~0 (<= 1% of one core).
3. `--follow` latency: from the moment a new checkpoint is complete (trainer_state.json written
   last, as the HF Trainer does) to its JSON line on stdout, minus the time the same work
   time the follower itself logs for processing it. Target: <= one --poll interval (2 s).

Inputs are warm in the page cache at every timed run; times are best of --repeats.

    .venv/bin/python bench/bench_incremental.py [--quick] [--size-mb 250] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stabilize import COLUMNS, MiB, interpreter_overhead, log, render  # noqa: E402
from measure import run_measured, set_cache, tensor_bytes  # noqa: E402
from synth import Trajectory, make_trajectory  # noqa: E402

BEMA = Path(sys.executable).with_name("bema")
RUN = "bema-k0.5-e0.2"
COST_TARGET = 0.3  # incremental wall / one-shot wall
IDLE_TARGET = 0.01  # CPU seconds per wall second while idle (1% of one core)


def cmd(run: Path, traj: Trajectory, out: Path, max_memory: str, *extra: str) -> list[str]:
    return [str(BEMA), "stabilize", str(run), "--base", str(traj.base), "--out", str(out)] + [
        "--max-memory",
        max_memory,
        "--json",
        *extra,
    ]


def linked_run(traj: Trajectory, root: Path, steps: list[int]) -> Path:
    """A run folder holding symlinks to some of the trajectory's checkpoints (no copies)."""
    root.mkdir(parents=True)
    for s in steps:
        (root / f"checkpoint-{s}").symlink_to(traj.checkpoint(s), target_is_directory=True)
    return root


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_cost(traj: Trajectory, work: Path, args) -> dict:
    run9 = linked_run(traj, work / "run9", traj.steps[:-1])
    run10 = linked_run(traj, work / "run10", traj.steps)
    state9 = work / "state9"
    run_measured(cmd(run9, traj, state9, args.max_memory))  # OUT's state after 9 checkpoints
    res: dict = {"one_shot": [], "incremental": [], "one_shot_rss": 0, "incremental_rss": 0}
    for i in range(args.repeats):
        for name in ("one_shot", "incremental"):
            out = work / f"out-{name}"
            if name == "incremental":
                shutil.copytree(state9, out, symlinks=True)
            set_cache(traj.input_files(), "warm")
            log(f"{name} #{i + 1} ...")
            run = run_measured(cmd(run10, traj, out, args.max_memory))
            doc = json.loads(run.stdout)
            res[name].append(run.seconds)
            res[f"{name}_engine"] = min(res.get(f"{name}_engine", 1e9), doc["seconds"])
            res[f"{name}_rss"] = max(res[f"{name}_rss"], run.max_rss)
            res[f"{name}_doc"] = {k: doc[k] for k in ("read_bytes", "written_bytes", "state_bytes")}
            res[f"{name}_outputs"] = len(doc["outputs"])
            log(f"{name}: {run.seconds:.2f} s, peak RSS {run.max_rss / MiB:.0f} MiB")
            if i == args.repeats - 1:
                last = out / RUN / f"checkpoint-{traj.steps[-1]}" / "model.safetensors"
                res[f"{name}_last"] = tensor_bytes(last) if name == "incremental" else None
                if name == "one_shot":
                    res["one_shot_last_path"] = str(last)
                continue
            shutil.rmtree(out)
    res["identical"] = res.pop("incremental_last") == tensor_bytes(Path(res["one_shot_last_path"]))
    res.pop("one_shot_last")
    return res


def bench_follow(traj: Trajectory, work: Path, args) -> dict:
    """Idle CPU and latency of `--follow --poll P` on a run whose 9 checkpoints OUT already holds."""
    run = linked_run(traj, work / "follow-run", traj.steps[:-1])
    out = work / "follow-out"
    run_measured(cmd(run, traj, out, args.max_memory))
    proc = subprocess.Popen(
        cmd(run, traj, out, args.max_memory, "--follow", "--poll", str(args.poll)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[tuple[float, str]] = []
    errors: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), x) for x in proc.stdout), daemon=True
    )
    reader.start()
    err_reader = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
    err_reader.start()
    try:
        time.sleep(args.settle)  # imports done, first (empty) round done: now it only polls
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        log(f"follower idle for {args.idle_seconds:g} s ...")
        time.sleep(args.idle_seconds)
        idle_cpu, idle_wall = cpu_seconds(proc.pid) - c0, time.monotonic() - t0
        step = traj.steps[-1]
        staging = work / "staging" / f"checkpoint-{step}"
        staging.parent.mkdir()
        shutil.copytree(traj.checkpoint(step), staging)
        set_cache(traj.input_files(), "warm")
        os.rename(staging, run / staging.name)  # the folder appears whole, then the trainer's last file
        (run / staging.name / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        complete = time.monotonic()
        deadline = complete + 600
        while not lines and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        latency = lines[0][0] - complete if lines else float("nan")
        # the follower logs each round's own processing time ("processed step(s) 1000 in 3.21 s") just
        # after its output line: wait for it before stopping the follower
        while time.monotonic() < deadline and not any(
            x.startswith(f"processed step(s) {step}") for x in errors
        ):
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    err_reader.join(timeout=10)
    rounds = [line.strip() for line in errors if line.startswith("processed step(s)")]
    processing = float(rounds[-1].rsplit(" in ", 1)[1].split()[0]) if rounds else float("nan")
    return {
        "idle_cpu": idle_cpu,
        "idle_wall": idle_wall,
        "latency": latency,
        "processing": processing,
        "added": latency - processing,
    }


def rows(r: dict, args) -> list[tuple[str, str, str, str]]:
    out: list[tuple[str, str, str, str]] = []

    def add(check: str, measured: str, target: str = "(info)", ok: bool | None = None) -> None:
        out.append((check, measured, target, "" if ok is None else ("PASS" if ok else "FAIL")))

    c, f = r["cost"], r["follow"]
    one, inc = min(c["one_shot"]), min(c["incremental"])
    bound = r["max_memory"] + max(r["overhead_rss"].values())
    add(
        "1 new checkpoint after 9 / one-shot over 10: wall",
        f"{inc / one:.2f}  ({inc:.2f} / {one:.2f} s)",
        f"<= {COST_TARGET}",
        inc / one <= COST_TARGET,
    )
    add("  same, engine time (--json seconds)", f"{c['incremental_engine'] / c['one_shot_engine']:.2f}")
    d = c["incremental_doc"]
    add(
        "  incremental: read / state / written",
        f"{d['read_bytes'] / 1e6:.0f} / {d['state_bytes'] / 1e6:.0f} / {d['written_bytes'] / 1e6:.0f} MB",
    )
    d = c["one_shot_doc"]
    add(
        "  one-shot: read / state written / written",
        f"{d['read_bytes'] / 1e6:.0f} / {d['state_bytes'] / 1e6:.0f} / {d['written_bytes'] / 1e6:.0f} MB",
    )
    for name in ("one_shot", "incremental"):
        rss = c[f"{name}_rss"]
        add(
            f"peak RSS, {name.replace('_', '-')}",
            f"{rss / MiB:.0f} MiB",
            f"<= {bound / MiB:.0f} MiB",
            rss <= bound,
        )
    add(
        "10th output, incremental vs one-shot",
        "byte-identical" if c["identical"] else "DIFFERENT",
        "identical",
        c["identical"],
    )
    rate = f["idle_cpu"] / f["idle_wall"]
    add(
        f"--follow idle: CPU over {f['idle_wall']:.0f} s (--poll {args.poll:g})",
        f"{f['idle_cpu']:.3f} s ({100 * rate:.2f}% of a core)",
        f"<= {100 * IDLE_TARGET:g}%",
        rate <= IDLE_TARGET,
    )
    add("--follow latency: complete -> JSON line", f"{f['latency']:.2f} s")
    add(
        "  minus the follower's own processing time",
        f"{f['added']:.2f} s",
        f"<= {args.poll:g} s",
        f["added"] <= args.poll,
    )
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes, short idle: a smoke run (numbers mean nothing)"
    )
    ap.add_argument(
        "--size-mb", type=float, default=250, help="bytes of one checkpoint's model.safetensors, in MB"
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--max-memory", default="512MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--poll", type=float, default=2.0, help="--follow --poll (seconds)")
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument(
        "--settle", type=float, default=15.0, help="seconds for the follower to start before measuring"
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="raw numbers as JSON on stdout (table on stderr)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.repeats, args.max_memory, args.idle_seconds, args.settle = 8, 1, "16MiB", 5, 8
    return args


def main(argv=None) -> None:
    from bema_cli.options import parse_size

    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bema-bench-inc-", dir=args.workdir))
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    try:
        res["overhead_rss"], _ = interpreter_overhead(work, 1)
        res["max_memory"] = parse_size(args.max_memory, "--max-memory")
        log(f"writing base + 10 checkpoints of {args.size_mb:g} MB under {work}")
        traj = make_trajectory(work / "traj", int(args.size_mb * 1e6), 10, args.dtype)
        res["file_bytes"] = traj.file_bytes
        res["cost"] = bench_cost(traj, work, args)
        res["follow"] = bench_follow(traj, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    table = rows(res, args)
    res["rows"] = [dict(zip(COLUMNS, r, strict=True)) for r in table]
    header = [
        f"bema incremental/--follow benchmark — {res['date']}, {res['cpus']} CPUs",
        f"trajectory: base + 10 checkpoints x {res['file_bytes'] / 1e6:.0f} MB {args.dtype}; one config (bema); "
        f"--max-memory {args.max_memory}; interpreter overhead {max(res['overhead_rss'].values()) / MiB:.0f} MiB",
        f"inputs WARM; best of {args.repeats}; load avg {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
        "",
    ]
    print(render(table, header), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
