"""What `--fingerprint full` (a digest of every byte of each consumed weight file) costs against
`sampled` (header and the first and last 64 KiB), on one run of `bema stabilize`.

bench/synth.py's trajectory (base + 6 checkpoints of 84 MB fp32), `--method ema,bema`, inputs warm,
the two modes interleaved --repeats times; medians of wall time and of user CPU (the steady number
on a shared VM), and the digests' own throughput on one file's bytes in memory.

    .venv/bin/python bench/bench_fingerprints.py [--quick] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import common_args, machine, report, set_cache  # noqa: E402
from synth import make_trajectory  # noqa: E402

BEMA = str(Path(sys.executable).with_name("bema"))
MODES = ("sampled", "full")


def throughput(data: bytes) -> dict:
    """GB/s of each digest over `data` (best of 3)."""
    import xxhash

    out = {}
    for name, fn in (("xxh3_128", lambda: xxhash.xxh3_128(data).digest()),
                     ("sha256", lambda: hashlib.sha256(data).digest())):  # fmt: skip
        best = min(_timed(fn) for _ in range(3))
        out[name] = round(len(data) / best / 1e9, 2)
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_once(traj, mode: str, out: Path) -> tuple[float, float]:
    """(wall s, user CPU s) of one whole `bema stabilize` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    t = time.perf_counter()
    subprocess.run([BEMA, "stabilize", traj.run, "--base", traj.base, "--method", "ema,bema", "--out", out,
                    "--fingerprint", mode, "--overwrite"], check=True, capture_output=True)  # fmt: skip
    wall = time.perf_counter() - t
    shutil.rmtree(out)
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - before


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, size_mb=84, checkpoints=6)
    ap.set_defaults(repeats=5)
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.checkpoints, args.repeats = 4, 2, 1
    root = Path(tempfile.mkdtemp(prefix="bema-bench-fp-", dir=args.workdir))
    try:
        traj = make_trajectory(root, int(args.size_mb * 1e6), args.checkpoints)
        files = [traj.base / "model.safetensors"] + [
            traj.checkpoint(s) / "model.safetensors" for s in traj.steps
        ]
        set_cache(files, "warm")
        runs = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(run_once(traj, mode, root / "out"))
        speeds = throughput(files[0].read_bytes())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {
        m: (statistics.median(w for w, _ in r), statistics.median(u for _, u in r)) for m, r in runs.items()
    }
    doc = {"machine": machine(), "size_mb": args.size_mb, "checkpoints": args.checkpoints,
           "repeats": args.repeats, "median_wall_s": {m: round(v[0], 2) for m, v in med.items()},
           "median_user_cpu_s": {m: round(v[1], 2) for m, v in med.items()}, "digest_gbps": speeds}  # fmt: skip
    cost_cpu = med["full"][1] / med["sampled"][1] - 1
    cost_wall = med["full"][0] / med["sampled"][0] - 1
    table = "\n".join([
        f"--fingerprint full vs sampled: base + {args.checkpoints} x {args.size_mb:g} MB fp32, ema,bema, "
        f"inputs warm, {args.repeats} interleaved runs each, medians",
        f"  sampled: wall {med['sampled'][0]:.2f} s, user CPU {med['sampled'][1]:.2f} s",
        f"  full:    wall {med['full'][0]:.2f} s, user CPU {med['full'][1]:.2f} s",
        f"  full's cost: {cost_cpu:+.0%} user CPU, {cost_wall:+.0%} wall",
        f"  digest throughput, one file in memory: xxh3_128 {speeds['xxh3_128']} GB/s, sha256 {speeds['sha256']} GB/s",
    ])  # fmt: skip
    report(table, doc, args.json)


if __name__ == "__main__":
    main()
