"""Benchmark `bema ship` against the same decision made by hand (`bema sweep` + `bema select --write`).

The demo's model shape (2 layers x 128 hidden) is trained to an optimum on held-out chats; the run
is 8 checkpoints of that optimum plus fresh noise (tests/ship_runs.py: averaging helps, so an
average is the right answer). Both paths judge the same menu (decide/request.py's DEFAULT_GRID) at the
last step on held-out loss with --holdout 0.5, as real `bema` processes, back to back:

1. the decision: ship's (--fit none: the menu only, raced on the pick items) against the exhaustive
   one (sweep: every config on every item; select's pick, shipped if it beats vanilla beyond its
   interval), each pair on its own pick/report split (--select-seed i);
2. wall time, ship / by hand, median of --repeats pairs (target <= 1.1);
3. ship with its fitted stage (soup, simplex): its wall and what it shipped, for the record;
4. that ship's dry run (--dry-run), before any ship measured this machine (arithmetic alone) and
   after the pairs' ships kept their floors (eval/timings.py): wall / projection. The projection
   is at most (every duel to its last item), so a ratio under 1 is expected; target: not low by
   more than 2x (wall / projection <= 2; users met 6-12x).

    .venv/bin/python bench/bench_ship.py [--repeats 3] [--backend auto|vllm|transformers] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ship_runs import heldout, noisy_run, optimum  # noqa: E402

BEMA = Path(sys.executable).with_name("bema")
MENU = ["--method", "ema,bema,lawa,wsm", "--kappa", "0.5", "--eta", "0.2,0.5", "--window", "4,8",
        "--schedule", "minus-sqrt"]  # fmt: skip
TARGET = 1.1
PROJECTION_LOW = 2.0  # a dry run's projection may read low by at most this factor


def _projected(args) -> float:
    """The dry run's projected seconds for this ship (whole command: engine start to the last forward)."""
    _, r = timed(*args, "--dry-run")
    return json.loads(r.stdout)["projection"]["seconds"]


def timed(*args) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    r = subprocess.run([str(BEMA), *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bema {args[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
    return time.perf_counter() - t, r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="auto", choices=["auto", "vllm", "transformers"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from bema_cli.decide.verdict import beats_vanilla
    from bema_cli.demo.tinymodel import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bema-bench-ship-"))
    os.environ["BEMA_CACHE"] = str(root / "cache")  # this machine's floors: measured by this run alone
    try:
        base = make_tiny_model(root / "base", seed=0, hidden_size=128, num_heads=4, intermediate_size=384)
        data = heldout(root / "heldout.jsonl")
        run = noisy_run(base, optimum(base, data, root / "star"), root / "run")
        common = ["--base", base, "--tasks", "loss", "--loss-data", data, "--backend", a.backend]
        fitted_args = ["ship", run, "--out", root / "fitted", *common, "--json"]
        projected = {"arithmetic alone": _projected(fitted_args)}
        ratios, rows = [], []
        for i in range(a.repeats):
            seed = str(i)  # each pair on its own pick/report split
            t_ship, r = timed("ship", run, "--out", root / f"ship{i}", *common, "--fit", "none", "--select-seed",
                              seed, "--json")  # fmt: skip
            shipped = json.loads(r.stdout)["decision"]["run"]
            t_sweep, _ = timed("sweep", run, "--out", root / f"sweep{i}", *common, *MENU, "--at", "last")
            t_select, r = timed("select", root / f"sweep{i}", "--metric", "loss", "--holdout", "0.5", "--seed",
                                seed, "--write", root / f"hand{i}", "--json")  # fmt: skip
            chosen = json.loads(r.stdout)
            # the exhaustive decision: select's pick (every config on every item), shipped only if it
            # beats vanilla beyond its interval on the report items (ship's race must agree)
            by_hand = chosen["winner"]["run"] if beats_vanilla(chosen) else "vanilla"
            ratios.append(t_ship / (t_sweep + t_select))
            rows.append({"ship_s": t_ship, "sweep_s": t_sweep, "select_write_s": t_select,
                         "ship_winner": shipped, "by_hand_winner": by_hand})  # fmt: skip
            print(
                f"pair {i}: ship {t_ship:.1f} s ({shipped}) vs sweep {t_sweep:.1f} s + select --write "
                f"{t_select:.1f} s ({by_hand})",
                file=sys.stderr,
            )
        projected["on measured floors"] = _projected(fitted_args)
        t_fit, r = timed(*fitted_args)
        fitted = json.loads(r.stdout)
        over = {k: round(t_fit / v, 2) for k, v in projected.items()}
        doc = {"pairs": rows, "ratio_median": statistics.median(ratios), "target": TARGET,
               "same_winner": all(x["ship_winner"] == x["by_hand_winner"] for x in rows),
               "with_fits": {"seconds": t_fit, "verdict": fitted["verdict"], "projected_seconds": projected,
                             "wall_over_projected": over}}  # fmt: skip
        lines = [
            f"same decision as sweep + select (every config on every item), {sum(x['ship_winner'] == x['by_hand_winner'] for x in rows)}"
            f" of {len(rows)} splits: {'PASS' if doc['same_winner'] else 'FAIL'} ({', '.join(x['ship_winner'] for x in rows)})",
            f"wall, ship / by hand (median of {a.repeats}): {doc['ratio_median']:.2f} (target <= {TARGET}: "
            f"{'PASS' if doc['ratio_median'] <= TARGET else 'FAIL'})",
            f"ship with soup + simplex: {t_fit:.1f} s; {fitted['verdict']}",
            *(
                f"  its dry run, {k}: {projected[k]:.1f} s projected, wall / projection {x} (target <= "
                f"{PROJECTION_LOW}: {'PASS' if x <= PROJECTION_LOW else 'FAIL'})"
                for k, x in over.items()
            ),
        ]
        print("\n".join(lines), file=sys.stderr)
        if a.json:
            print(json.dumps(doc, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
