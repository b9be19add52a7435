"""Before/after timing of `bema stabilize` in one run: two code trees, interleaved, against the I/O floor.

The machine this project runs on is shared (2 cores, other test suites running), so absolute times
drift by tens of percent between runs; ratios taken side by side, interleaved, repeated, do not.

    .venv/bin/python bench/ab_stabilize.py --old /tmp/bema-old --size-mb 150 --checkpoints 6 --repeats 5

`--old` is a folder holding the old `bema_cli` package (e.g. `git archive BASE bema_cli | tar -x -C DIR`);
the new code is this checkout. Each repeat times: the floor (read inputs + write the output bytes),
old, new (order alternates), each with inputs warm and outputs deleted (and synced) in between.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stabilize import ONE, bema_cmd  # noqa: E402
from measure import read_files, run_measured, set_cache, write_files  # noqa: E402
from synth import make_trajectory  # noqa: E402

NEW = str(Path(__file__).resolve().parents[1])


def timed(traj, out: Path, code: str, extra: list[str], max_memory: str, final_only: bool):
    set_cache(traj.input_files(), "warm")
    env = {**os.environ, "PYTHONPATH": code}
    run = run_measured(bema_cmd(traj, out, ONE, max_memory, final_only) + extra, env=env)
    shutil.rmtree(out)
    cpu = sum(float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", run.stderr))
    return run.seconds, run.max_rss, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="folder holding the old bema_cli package")
    ap.add_argument("--size-mb", type=float, default=150)
    ap.add_argument("--checkpoints", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-memory", default="512MiB")
    ap.add_argument("--final-only", action="store_true")
    ap.add_argument("--new-args", default="", help="extra flags for the new code only (e.g. --no-state)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bema-ab-", dir=args.workdir))
    res: dict = {k: [] for k in ("floor", "old", "new", "old_rss", "new_rss", "old_cpu", "new_cpu")}
    res["load"] = [os.getloadavg()[0]]
    try:
        traj = make_trajectory(work / "traj", int(args.size_mb * 1e6), args.checkpoints)
        n_out = 1 if args.final_only else len(traj.steps)
        out = work / "out"
        for rep in range(args.repeats):
            set_cache(traj.input_files(), "warm")
            sizes = {out / f"c{i}" / "model.safetensors": traj.file_bytes for i in range(n_out)}
            res["floor"].append(read_files(traj.input_files()) + write_files(sizes))
            shutil.rmtree(out)
            order = [("old", args.old, []), ("new", NEW, args.new_args.split())]
            for name, code, extra in order if rep % 2 == 0 else order[::-1]:
                s, rss, cpu = timed(traj, out, code, extra, args.max_memory, args.final_only)
                res[name].append(s)
                res[f"{name}_rss"].append(rss)
                res[f"{name}_cpu"].append(cpu)
            print(
                f"[ab] rep {rep}: floor {res['floor'][-1]:.2f} s, old {res['old'][-1]:.2f} s, "
                f"new {res['new'][-1]:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load"].append(os.getloadavg()[0])
    per = {k: [x / f for x, f in zip(res[k], res["floor"], strict=True)] for k in ("old", "new")}
    ratio = [n / o for n, o in zip(res["new"], res["old"], strict=True)]
    print(
        f"{args.size_mb:.0f} MB x (base + {args.checkpoints}), {'--final-only' if args.final_only else 'every step'}, "
        f"{args.repeats} interleaved repeats, load {res['load'][0]:.1f} -> {res['load'][1]:.1f}"
    )
    for k in ("old", "new"):
        v = per[k]
        print(f"  {k}: wall / floor median {statistics.median(v):.2f} (min {min(v):.2f}, max {max(v):.2f})")
    cpu = [n / o for n, o in zip(res["new_cpu"], res["old_cpu"], strict=True)]
    print(
        f"  new / old CPU time (user + sys): median {statistics.median(cpu):.2f} (min {min(cpu):.2f}, max {max(cpu):.2f})"
    )
    print(
        f"  new / old wall: median {statistics.median(ratio):.2f} (min {min(ratio):.2f}, max {max(ratio):.2f})"
    )
    print(f"  peak RSS: old {max(res['old_rss']) / 2**20:.0f} MiB, new {max(res['new_rss']) / 2**20:.0f} MiB")
    print(json.dumps(res), file=sys.stderr)


if __name__ == "__main__":
    main()
