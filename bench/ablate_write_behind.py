"""Ablation of the write-behind (issue 16): the engine as shipped vs synchronous writes vs 2 torch threads.

Each variant is the real `bema stabilize` CLI in a fresh process, patched before it runs; the engine's
own `--json` seconds are compared, interleaved, inputs warm. Results: docs/performance.md.

    .venv/bin/python bench/ablate_write_behind.py [--size-mb 250] [--checkpoints 6] [--repeats 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import set_cache  # noqa: E402
from synth import make_trajectory  # noqa: E402

VARIANT = r"""
import sys
from contextlib import contextmanager

from bema_cli.stabilize import executors, unit

variant, run, base, out = sys.argv[1:5]
if variant == "sync":  # every block written by the main thread, at once
    shipped = unit.WriteBehind
    unit.WriteBehind = lambda block, background=True: shipped(block, background=False)
if variant == "threads2":  # write-behind, but torch keeps all its threads

    @contextmanager
    def unchanged(ws, threads=None):
        yield

    executors.compute_threads = unchanged
from bema_cli.cli import main

sys.argv = ["bema", "stabilize", run, "--base", base, "--out", out, "--max-memory", "512MiB", "--json"]
main()
"""
VARIANTS = ("shipped", "sync", "threads2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=250)
    ap.add_argument("--checkpoints", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bema-ablate-", dir=args.workdir))
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        traj = make_trajectory(work / "traj", int(args.size_mb * 1e6), args.checkpoints)
        out = work / "out"
        for rep in range(args.repeats):
            for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                set_cache(traj.input_files(), "warm")
                cmd = [sys.executable, "-c", VARIANT, variant, str(traj.run), str(traj.base), str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
                if proc.returncode != 0:
                    sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
                seconds[variant].append(json.loads(proc.stdout)["seconds"])
                shutil.rmtree(out)
            print(
                f"[ablate] rep {rep}: " + ", ".join(f"{v} {s[-1]:.2f} s" for v, s in seconds.items()),
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for v, s in seconds.items():
        ratios = [x / y for x, y in zip(s, seconds["shipped"], strict=True)]
        print(
            f"{v:9s} engine s median {statistics.median(s):.2f}; / shipped: {', '.join(f'{r:.2f}' for r in ratios)}"
        )


if __name__ == "__main__":
    main()
