"""The demo across seeds: which of its findings hold, with the spread (`make demo-seeds`).

Runs `bema demo --seed S` for each seed (data, initialisation and training order all follow the
seed; the numerics are pinned, so a seed gives the same numbers on any machine with the same
software), then prints the headline numbers per seed with their range, each finding the README
states with the number of seeds it holds in, and the stage times.

    python bench/demo_seeds.py [--seeds 0,1,2] [--workdir bench-out/demo-seeds] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BEMA = Path(sys.executable).with_name("bema")
RUNS = ["vanilla", "ema-k0.5", "bema-k0.5-e0.2", "bema-k0.5-e0.5", "lawa-w8", "wsm-minus_sqrt-w8"]


def run_seed(seed: int, out: Path, quick: bool, backend: str) -> dict:
    cmd = [str(BEMA), "demo", "--seed", str(seed), "--out", str(out), "--backend", backend, "--json"]
    t = time.perf_counter()
    done = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bema demo --seed {seed} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout)
    ship = json.loads((out / "ship" / ".bema-ship" / "ship.json").read_text())
    return {"seed": seed, "wall": time.perf_counter() - t, "summary": summary, "ship": ship}


def headline(res: dict) -> dict[str, float]:
    """The numbers the README's findings are about: loss and gsm8k at the first evaluated step
    after 0, a middle one and the last."""
    s = res["summary"]
    steps = [x for x in s["steps"] if x > 0]
    early, middle, last = steps[0], steps[len(steps) * 2 // 5 - 1 if len(steps) >= 5 else 0], steps[-1]
    out = {}
    for run in RUNS:
        for step in (early, middle, last):
            if run in s["loss"]:
                out[f"loss {run} @{step}"] = s["loss"][run][str(step)]  # JSON: steps are string keys
            gsm = s["accuracy"].get("gsm8k", {}).get(run)
            if gsm:
                out[f"gsm8k {run} @{step}"] = gsm[str(step)]
    return out


def findings(res: dict) -> dict[str, bool]:
    """The README's qualitative claims, checked on one seed."""
    s = res["summary"]
    steps = [x for x in s["steps"] if x > 0]
    early, last = steps[0], steps[-1]

    def loss(run, step):
        return s["loss"][run][str(step)]

    late = steps[len(steps) // 2 :]
    decision = res["ship"].get("decision", {})
    return {
        f"EMA lags: its loss at step {early} is above vanilla's": loss("ema-k0.5", early)
        > loss("vanilla", early),
        f"BEMA (eta 0.2) removes most of the lag at step {early}": (
            loss("bema-k0.5-e0.2", early) - loss("vanilla", early)
            < 0.5 * (loss("ema-k0.5", early) - loss("vanilla", early))
        ),
        f"EMA beats vanilla at the last step ({last})": loss("ema-k0.5", last) < loss("vanilla", last),
        f"BEMA (eta 0.5) beats vanilla at the last step ({last})": loss("bema-k0.5-e0.5", last)
        < loss("vanilla", last),
        "EMA beats vanilla at every step of the second half": all(
            loss("ema-k0.5", x) < loss("vanilla", x) for x in late
        ),
        f"LAWA beats vanilla at the last step ({last})": loss("lawa-w8", last) < loss("vanilla", last),
        "ship picks an average, not vanilla": decision.get("run", "vanilla") != "vanilla",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--workdir", default="bench-out/demo-seeds")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--quick", action="store_true", help="the quick demo (a pipeline check, not findings)")
    ap.add_argument("--keep", action="store_true", help="keep the demo folders")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in seeds:
        print(f"seed {seed}: bema demo --seed {seed} ...", file=sys.stderr, flush=True)
        results.append(run_seed(seed, work / f"seed-{seed}", args.quick, args.backend))
        print(f"  {results[-1]['wall']:.0f} s", file=sys.stderr, flush=True)
    numbers = [headline(r) for r in results]
    held = [findings(r) for r in results]
    table = []
    for key in numbers[0]:
        vals = [n[key] for n in numbers if key in n]
        table.append(
            {
                "number": key,
                "per_seed": vals,
                "mean": statistics.fmean(vals),
                "min": min(vals),
                "max": max(vals),
            }
        )
    claims = [{"finding": k, "holds_in": sum(h[k] for h in held), "of": len(held)} for k in held[0]]
    stages = {k: [r["summary"]["seconds"][k] for r in results] for k in results[0]["summary"]["seconds"]}
    doc = {
        "seeds": seeds, "quick": args.quick, "cpus": os.cpu_count(),
        "numbers": table, "findings": claims, "stage_seconds": stages,
        "ship": [{"seed": r["seed"], **{k: r["ship"].get("decision", {}).get(k) for k in ("run", "step")}} for r in results],
        "wall_seconds": [round(r["wall"], 1) for r in results],
    }  # fmt: skip
    out = sys.stderr if args.json else sys.stdout
    print(f"\n{'number':44} " + " ".join(f"seed {s:>3}" for s in seeds) + "   range", file=out)
    for row in table:
        cells = " ".join(f"{v:8.4f}" for v in row["per_seed"])
        print(f"{row['number']:44} {cells}   {row['min']:.4f}-{row['max']:.4f}", file=out)
    print("\nfindings (seeds where it holds):", file=out)
    for c in claims:
        print(f"  {c['holds_in']}/{c['of']}  {c['finding']}", file=out)
    print(
        "\nship's pick: " + ", ".join(f"seed {x['seed']}: {x['run']} @{x['step']}" for x in doc["ship"]),
        file=out,
    )
    print(
        "stage seconds: " + "; ".join(f"{k} {min(v):.0f}-{max(v):.0f}" for k, v in stages.items()), file=out
    )
    print(f"demo wall: {', '.join(f'{w:.0f} s' for w in doc['wall_seconds'])}", file=out)
    (work / "demo_seeds.json").write_text(json.dumps(doc, indent=1) + "\n")
    if not args.keep:
        for r in results:
            shutil.rmtree(work / f"seed-{r['seed']}", ignore_errors=True)
    if args.json:
        print(json.dumps(doc))


if __name__ == "__main__":
    main()
