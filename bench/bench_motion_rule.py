"""How often does the "barely moves" warning (stabilize/motion.py's verdict) say the right thing, on
worlds whose truth is known?

A world is SGD on a quadratic loss 1/2 sum_i h_i (theta_i - theta*_i)^2 with Gaussian gradient
noise (D weights, curvatures spread over two decades), saved every M steps (N checkpoints), under
one learning-rate schedule: constant (the paper's regime), cosine to a floor, warmup-stable-decay
(to zero over the last part of the run), linear to zero. Averaging removes the noise of the last
checkpoints; how much it can still remove at the end depends on the schedule. The truth of a
schedule: the expected loss gain of the best window mean (the last 4 or 8 checkpoints, as the
menu's) over the last checkpoint, as a share of the same gain at a constant learning rate (Monte
Carlo over the repetitions). Averaging "helps" where that share is >= 10%, the rule's own
threshold on the motion; else it "cannot help". Each run is judged by motion.verdict on its
relative step distances, as `bema stabilize` measures them.

It prints, per schedule, the truth, how often the rule warned, and the two error rates with
Wilson 95% intervals: a false alarm (it warned where averaging helps) and a miss (it stayed quiet
where averaging cannot help).

    .venv/bin/python bench/bench_motion_rule.py [--reps 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bema_cli.stabilize.motion import verdict  # noqa: E402

D, N, M = 400, 40, 10  # weights, checkpoints, SGD steps between two saves
ETA, SIGMA = 0.02, 1.0  # the peak learning rate, the gradient noise
WINDOWS = (4, 8)  # the menu's windows
HELPS = 0.1  # the share of the constant rate's averaging gain from which averaging "helps"
SCHEDULES = ("constant", "cos0.5", "cos0.3", "cos0.1", "cos0.0", "wsd0.2", "wsd0.5", "linear0")


def rate(name: str, f: float) -> float:
    """The learning rate at fraction f of the run, as a share of the peak."""
    if name == "constant":
        return 1.0
    if name == "linear0":
        return 1.0 - f
    if name.startswith("wsd"):  # stable, then linear to zero over the last `frac` of the run
        frac = float(name[3:])
        return 1.0 if f < 1 - frac else (1 - f) / frac
    floor = float(name[3:])  # cosine to a floor
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * f))


class World:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.h = np.exp(rng.uniform(math.log(0.05), math.log(5.0), D))
        self.star = rng.normal(0, 1, D)

    def run(self, name: str, rng) -> np.ndarray:
        theta = self.star + rng.normal(0, 0.5, D)
        out = []
        for t in range(N * M):
            eta = ETA * rate(name, t / (N * M))
            theta = theta - eta * (self.h * (theta - self.star) + SIGMA * rng.normal(0, 1, D))
            if (t + 1) % M == 0:
                out.append(theta.copy())
        return np.array(out)

    def loss(self, theta) -> float:
        return 0.5 * float((self.h * (theta - self.star) ** 2).sum())

    def gain(self, ckpts) -> float:
        """The best window mean's loss below the last checkpoint's (negative: every window is worse)."""
        return max(self.loss(ckpts[-1]) - self.loss(ckpts[-k:].mean(0)) for k in WINDOWS)


def motion_rows(ckpts, theta0) -> list[dict]:
    """||theta_s - theta_prev|| / ||theta_s|| per checkpoint (the first from theta0), as bema's rows."""
    prev, out = theta0, []
    for i, theta in enumerate(ckpts):
        out.append(
            {"step": (i + 1) * M, "relative": float(np.linalg.norm(theta - prev) / np.linalg.norm(theta))}
        )
        prev = theta
    return out


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    z, p = 1.959964, k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return mid - half, mid + half


def simulate(reps: int, seed: int = 1) -> dict:
    world, rng = World(), np.random.default_rng(seed)
    rows = {}
    for name in SCHEDULES:
        gains, warned, shares = [], 0, []
        for _ in range(reps):
            ckpts = world.run(name, rng)
            gains.append(world.gain(ckpts))
            v = verdict(motion_rows(ckpts, world.star), max(WINDOWS))
            warned += v["barely_moves"]
            shares.append(v["share"])
        rows[name] = {"gain": float(np.mean(gains)), "warned": warned, "reps": reps,
                      "median_share": float(np.median(shares))}  # fmt: skip
    base = rows["constant"]["gain"]
    for row in rows.values():
        row["gain_share"] = row["gain"] / base
        row["helps"] = row["gain_share"] >= HELPS
    alarms = [r for r in rows.values() if r["helps"]]
    quiet = [r for r in rows.values() if not r["helps"]]
    k_alarm, n_alarm = sum(r["warned"] for r in alarms), sum(r["reps"] for r in alarms)
    k_miss, n_miss = sum(r["reps"] - r["warned"] for r in quiet), sum(r["reps"] for r in quiet)
    return {"schedules": rows,
            "false_alarms": {"k": k_alarm, "n": n_alarm, "interval": wilson(k_alarm, n_alarm)},
            "misses": {"k": k_miss, "n": n_miss, "interval": wilson(k_miss, n_miss)}}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    doc = simulate(a.reps)
    lines = [f"the 'barely moves' rule on {a.reps} SGD runs per schedule ({N} checkpoints, windows {WINDOWS}):",
             f"{'schedule':10s} {'averaging gain vs constant':>27s} {'truth':>14s} {'motion share':>13s} {'warned':>7s}"]  # fmt: skip
    for name, r in doc["schedules"].items():
        truth = "helps" if r["helps"] else "cannot help"
        lines.append(f"{name:10s} {r['gain_share']:>27.3f} {truth:>14s} {r['median_share']:>13.3f} "
                     f"{r['warned'] / r['reps']:>7.2f}")  # fmt: skip
    for key, what in (
        ("false_alarms", "warned where averaging helps"),
        ("misses", "quiet where it cannot help"),
    ):
        e = doc[key]
        lo, hi = e["interval"]
        lines.append(f"{what}: {e['k']}/{e['n']} = {e['k'] / max(e['n'], 1):.3f} [{lo:.3f}, {hi:.3f}]")
    print("\n".join(lines), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(doc))


if __name__ == "__main__":
    main()
