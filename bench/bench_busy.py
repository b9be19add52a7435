"""Benchmark `bema demo --quick` on a busy machine: idle, then beside N busy processes (a CPU hog).

A newcomer's laptop or a shared box runs other jobs. The demo's training is pinned to 2 OpenMP
threads (bit-equal results on any machine); threads that spin at barriers on cores taken by other
jobs collapse it. `bema demo` makes them sleep (demo/pins.py, OMP_WAIT_POLICY=PASSIVE). In one run:

1. idle: the demo, nothing else running (apart from what the machine already runs);
2. busy: the same beside --hogs pure-Python busy loops (default 2, one per core here);
3. busy, spinning (unless --no-spinning): the same with libgomp's default spin before sleeping
   (GOMP_SPINCOUNT=300000, about 3 ms: what the demo did before), for the effect of the pin.

Each prints its wall time, the demo's own stage seconds and the ratio to idle. Target: busy <= 3x idle.
The weights trained in each arm are compared bit for bit (the wait policy must not change them).

    .venv/bin/python bench/bench_busy.py [--hogs 2] [--full] [--no-spinning] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BEMA = Path(sys.executable).with_name("bema")
TARGET = 3.0
SPINNING = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}  # libgomp's unset default, ~3 ms


def demo(out: Path, args: list[str], env: dict) -> tuple[float, dict, str]:
    """One `bema demo` run: wall seconds, its summary, a digest of the fine-tuned last checkpoint."""
    t = time.perf_counter()
    r = subprocess.run(
        [str(BEMA), "demo", "--out", str(out), "--json", *args], capture_output=True, text=True, env=env
    )
    seconds = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"bema demo failed ({r.returncode}): {r.stderr[-2000:]}")
    last = max((out / "sft").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    digest = hashlib.sha256((last / "model.safetensors").read_bytes()).hexdigest()[:16]
    return seconds, json.loads(r.stdout), digest


def beside_hogs(n: int, work):
    """Run work() while n pure-Python busy loops hold the CPUs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # let them take their cores
        return work()
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=2, help="busy processes beside the demo (default 2)")
    ap.add_argument("--full", action="store_true", help="the full demo instead of --quick (5-30 min)")
    ap.add_argument("--no-spinning", action="store_true", help="skip the arm with libgomp's default spin")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    args = [] if a.full else ["--quick"]
    base_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    arms = [("idle", 0, base_env), (f"beside {a.hogs} hogs", a.hogs, base_env)]
    if not a.no_spinning:
        arms.append((f"beside {a.hogs} hogs, spinning", a.hogs, base_env | SPINNING))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bema-busy-") as tmp:
        for i, (name, hogs, env) in enumerate(arms):
            out = Path(tmp) / f"demo{i}"
            seconds, summary, digest = beside_hogs(hogs, lambda out=out, env=env: demo(out, args, env))
            rows.append({"arm": name, "hogs": hogs, "seconds": round(seconds, 1), "stages": summary["seconds"],
                         "weights": digest, "pins": summary["environment"]["pins"]})  # fmt: skip
            print(f"{name:>28}: {seconds:6.1f} s  {summary['seconds']}", file=sys.stderr, flush=True)
    idle = rows[0]["seconds"]
    for row in rows:
        row["ratio_to_idle"] = round(row["seconds"] / idle, 2)
    same_weights = len({row["weights"] for row in rows}) == 1
    busy = rows[1]["ratio_to_idle"]
    doc = {"demo": "full" if a.full else "quick", "cpus": os.cpu_count(), "rows": rows, "target": TARGET,
           "busy_ratio": busy, "meets_target": busy <= TARGET, "same_weights": same_weights}  # fmt: skip
    if a.json:
        print(json.dumps(doc, indent=2))
        return
    print(
        f"bema demo {'' if a.full else '--quick '}on {os.cpu_count()} CPUs, idle and beside {a.hogs} busy processes"
    )
    for row in rows:
        print(f"  {row['arm']:>28}: {row['seconds']:7.1f} s  {row['ratio_to_idle']:5.2f}x idle")
    verdict = "meets" if busy <= TARGET else "MISSES"
    print(
        f"  busy / idle {busy:.2f}x: {verdict} the target <= {TARGET}x; weights bit-equal in every arm: {same_weights}"
    )


if __name__ == "__main__":
    main()
