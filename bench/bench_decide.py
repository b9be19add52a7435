"""Benchmark `bema ship`'s decision: the raced fit search against the exhaustive one, on simulated
runs whose truth is known, through ship's own decision code (select, search.fit_search, decision).

A world is a run of 8 checkpoints (steps 10..80) and N held-out records. Record i's loss per token
under the average with coefficients c over (theta0, checkpoints) is
    b_i + sum_j c_j z_ij + 1 + A c_0^2 + lam * sum_{j >= 1} c_j^2
b_i: the record's difficulty; z_ij: how checkpoint j happens to do on record i (the sampling noise
an evaluation sees); A c_0^2: the checkpoints sit near an optimum that theta0 is far from, so
weight on theta0, either sign (BEMA's is negative), moves the average off it; lam * sum c_j^2: the
loss that noise in the weights adds, which averaging removes (the paper's regime). Its NLL is that
times the record's tokens. The truth of c is the population mean (z averages out).
- null world: lam = 0 and every checkpoint equally good: no average beats the last checkpoint,
  so shipping one is a false claim;
- power world: lam > 0: averages over more checkpoints are truly better.

Every repetition draws a world, makes the menu's records (the sweep's, exhaustive in both
designs), and decides twice on the same draw: the fit search raced (race.duel, today) and
exhaustive (every candidate on every pick item, the design before racing; it also evaluated each
fitted candidate on the report items). It prints the evaluations (item x candidate) of each, the
false-claim rate and power with Wilson 95% intervals, and how often both decide the same.

    .venv/bin/python bench/bench_decide.py [--reps 200] [--items 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

STEPS = [10, 20, 30, 40, 50, 60, 70, 80]
SIGMA_ITEM = 0.15  # z_ij's spread (per token)
SIGMA_B = 0.3  # the records' difficulty spread
THETA0_COST = 0.6  # A: the loss per token of moving all the way back to theta0
LAM_POWER = 0.045  # the power world's weight-noise loss (exhaustive power near the paper's 80%)
LAM_HUGE = 0.57  # the huge world's: the menu's averages gain 0.38-0.50 nats/token over vanilla
HUGE_ITEMS = (600, 1500)  # held-out records of the huge world (larger sets hit the clamp more easily)
# --min-effect E (nats/token) on each world: the power world's averages gain 0.02-0.04 (lawa-w8 0.039):
# 0.03 leaves some worth shipping; 0.045 none (every average shipped there is an error)
BOTH_FITS = ("soup", "simplex")  # --fit's default on loss before the soup was left to be asked for
EFFECTS = {"null": ["effect 0.02"], "power": ["effect 0.03", "effect 0.045"]}


def menu_vectors(work: Path) -> dict:
    """The default menu's candidates at the last step (vanilla's included), as ship makes them
    (candidate.menu on the sweep's plan), on a run of one-tensor checkpoints."""
    import torch
    from safetensors.torch import save_file

    from bema_cli.decide import candidate
    from bema_cli.decide.request import DEFAULT_GRID
    from bema_cli.stabilize import Options, grid
    from bema_cli.sweep.walk import plan_sweep

    for folder in [work / "base", *(work / "run" / f"checkpoint-{s}" for s in STEPS)]:
        folder.mkdir(parents=True)
        save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({"model_type": "basis"}))
    opts = Options(checkpoint_dir=str(work / "run"), schedules=grid(**DEFAULT_GRID), out=None,
                   base=str(work / "base"))  # fmt: skip
    return candidate.menu(plan_sweep(opts), STEPS[-1])


class World:
    def __init__(self, rng, items: int, lam: float):
        n = len(STEPS) + 1
        self.ids = list(range(items))
        self.tokens = rng.integers(20, 61, size=items).astype(float)
        self.b = rng.normal(1.0, SIGMA_B, size=items)
        self.z = rng.normal(0.0, SIGMA_ITEM, size=(items, n))
        self.z[:, 0] = 0.0
        self.lam = lam
        self.evaluated: set[tuple] = set()  # (vector, item) pairs a design paid for
        self.loaded, self.swaps = None, 0  # the vector in the "engine"; how often another came in

    def nll(self, c, ids) -> np.ndarray:
        c = np.asarray(c, float)
        ids = np.asarray(ids, int)
        return (self.b[ids] + self.z[ids] @ c + self.mean(c)) * self.tokens[ids]

    def mean(self, c: np.ndarray) -> float:
        return 1.0 + THETA0_COST * c[0] ** 2 + self.lam * float((c[1:] ** 2).sum())

    def truth(self, c) -> float:
        c = np.asarray(c, float)
        return float(self.b.mean()) + self.mean(c)

    def evaluate(self, cand, task, ids) -> list[dict]:
        """What the arena's engine gives ship's scorer (scorer.ItemScorer): the candidate's record on
        `ids`; every (vector, item) paid for is counted."""
        c = cand.coefficients(STEPS)
        self.evaluated.update((cand.digest, i) for i in ids)
        if cand.digest != self.loaded:  # as the arena swaps (scorer.Arena.load)
            self.loaded, self.swaps = cand.digest, self.swaps + 1
        return [self.record(cand.name, c, ids)]

    def record(self, run: str, c, ids) -> dict:
        return {"run": run, "step": STEPS[-1], "task": "loss", "model_path": run, "_where": run, "is_base": False,
                "items": {"ids": list(ids), "nll": self.nll(c, ids).tolist(), "tokens": self.tokens[ids].tolist()},
                "protocol": {}, "seeds": None, "n_samples": 1, "n_prompts": len(ids), "backend": "sim",
                "dtype": "float64"}  # fmt: skip


def decide_once(world: World, menu: dict, raced: bool, opts) -> dict:
    """ship's decision on this world, through ship's own scorer (scorer.ItemScorer: candidates keyed
    by their vector) and code. Raced (today): the menu raced on the pick items, the fits raced, the
    finalists on the report items (menu.race_menu, search.search, decision.decide). Exhaustive (the
    design before): every menu config on every item, select, the fits on every pick item
    (race.exhaustive), each fitted candidate paid on every item, the same rule."""
    from bema_cli.decide import decision, race, search, select
    from bema_cli.decide.menu import race_menu
    from bema_cli.decide.metric import Metric
    from bema_cli.decide.request import fits_for
    from bema_cli.decide.scorer import ItemScorer
    from bema_cli.eval.results import ResultsFile

    metric = Metric("loss", "loss", False)
    opts = fits_for(opts, metric)  # as ship resolves --fit
    scorer = ItemScorer(world.evaluate, None, metric, ResultsFile(None))
    pick, report = select.sides(world.ids, opts.holdout, opts.seed)
    pick_ids, report_ids = [world.ids[i] for i in pick], [world.ids[i] for i in report]
    stopped, by_vanilla = None, 0
    if raced:
        made = race_menu(scorer, menu, pick_ids, report_ids, opts, metric, progress=False)
        chosen, records, survivors = made.chosen, made.records, made.race["survivors"]
        stopped = made.race["stopped"]
        by_vanilla = sum(d["by"] == "vanilla" for d in made.race["dropped"].values())
    else:
        records = [scorer.record(c, world.ids) for c in menu.values()]
        chosen = select.select(records, metric, "last", opts.holdout, opts.resamples, opts.seed)
        survivors = list(menu)
    duel = race.duel if raced else race.exhaustive
    fitted = None  # as contest: a race stopped early (--min-effect) searches no fits
    if stopped is None:
        fitted = search.search(scorer, menu, STEPS, survivors, pick_ids, report_ids, opts, metric, duel=duel,
                               progress=False)  # fmt: skip
    made, why = decision.decide(chosen, fitted, metric, opts, records)
    shipped = (fitted["best"]["candidate"] if made.kind == "fitted" else menu[made.run]).coefficients(STEPS)
    items = scorer.evaluated
    if not raced:  # it also paid every fitted candidate on every item (written, then evaluated whole)
        trials = len(fitted["doc"]["candidates"]) + len(fitted["found"])
        items = len(menu) * len(world.ids) + trials * len(world.ids)
    # a second task (the README's --tasks gsm8k,loss), as many items: before, every candidate ran it;
    # now the shipped model and vanilla only (contest._other_tasks)
    second = items if not raced else 2 * len(world.ids)
    vanilla = menu["vanilla"].coefficients(STEPS)
    return {"kind": made.kind, "average": made.kind != "vanilla", "truth": world.truth(shipped),
            "swaps": world.swaps, "stopped": stopped is not None, "dropped_by_vanilla": by_vanilla,
            "vanilla_truth": world.truth(vanilla), "items": items, "items_two_tasks": items + second,
            "verdict": why}  # fmt: skip


def huge_world(reps: int, items: int, seed: int) -> dict:
    """Averages truly 0.38-0.50 nats/token better than vanilla (LAM_HUGE), beating it on nearly every
    item, decided raced with --fit none: the world where a clamped Phi(x) read vanilla's far-worse
    items as e^300 of evidence and dropped every average "by vanilla". Counts vanilla shipped and the
    averages dropped by vanilla (both must be 0: vanilla is the clearly worst)."""
    from bema_cli.decide.request import ShipOptions

    with tempfile.TemporaryDirectory() as tmp:
        menu = menu_vectors(Path(tmp) / "basis")
    opts = ShipOptions(out=Path("unused"), resamples=1000, fits=())
    rows = [decide_once(World(np.random.default_rng([seed, r, items]), items, LAM_HUGE), menu, True, opts)
            for r in range(reps)]  # fmt: skip
    return {
        "reps": reps,
        "items": items,
        "vanilla_shipped": sum(not r["average"] for r in rows),
        "dropped_by_vanilla": sum(r["dropped_by_vanilla"] > 0 for r in rows),
    }


def guard_passes(true_gap: float, margin: float, items: int, reps: int, seed: int) -> int:
    """How often ship's guard (guard.holds on select.versus, as contest runs it) passes an average
    whose accuracy on a guard task is vanilla's + true_gap; items paired, 10% + |gap| of them
    discordant (averages of one run disagree on few items)."""
    from bema_cli.decide import guard, select
    from bema_cli.decide.metric import Metric

    metric = Metric("gsm8k", "flexible", True)

    def record(run, correct):
        return {"run": run, "step": STEPS[-1], "task": "gsm8k", "model_path": run, "is_base": False, "protocol": {},
                "seeds": None, "n_samples": 1, "n_prompts": items, "backend": "sim", "dtype": "float64",
                "items": {"ids": list(range(items)), "flexible": correct.astype(float).tolist()}}  # fmt: skip

    rng, passed = np.random.default_rng(seed), 0
    share = 0.1 + abs(true_gap)
    for _ in range(reps):
        vanilla = rng.random(items) < 0.5
        discordant, wins = rng.random(items) < share, rng.random(items) < (1 + true_gap / share) / 2
        average, vanilla = np.where(discordant, wins, vanilla), np.where(discordant, ~wins, vanilla)
        vs = select.versus(record("avg", average), record("vanilla", vanilla), metric, None, 0, 1000)
        passed += guard.holds(vs, True, margin)
    return passed


def loss_guard_passes(true_gap: float, margin: float, items: int, reps: int, seed: int) -> int:
    """How often ship's guard passes an average whose loss on a guard's held-out records is
    vanilla's + true_gap nats/token, in this world's noise: the average is LAWA over the last 4
    checkpoints, its per-item difference to vanilla z_i (c - e_last) per token (sd 0.13 nats/token
    with SIGMA_ITEM 0.15), each record 20-60 tokens."""
    from bema_cli.decide import guard, select
    from bema_cli.decide.metric import Metric

    metric = Metric("loss", "loss", False)
    n = len(STEPS) + 1
    c = np.zeros(n)
    c[-4:] = 0.25
    v = np.zeros(n)
    v[-1] = 1.0
    rng, passed = np.random.default_rng(seed), 0
    for _ in range(reps):
        tokens = rng.integers(20, 61, size=items).astype(float)
        b = rng.normal(1.0, SIGMA_B, size=items)
        z = rng.normal(0.0, SIGMA_ITEM, size=(items, n))
        recs = []
        for run, vec, gap in (("avg", c, true_gap), ("vanilla", v, 0.0)):
            nll = ((b + z @ vec + 1.0 + gap) * tokens).tolist()
            recs.append({"run": run, "step": STEPS[-1], "task": "loss", "model_path": run, "is_base": False,
                         "protocol": {}, "seeds": None, "n_samples": 1, "n_prompts": items, "backend": "sim",
                         "dtype": "float64", "items": {"ids": list(range(items)), "nll": nll,
                                                       "tokens": tokens.tolist()}})  # fmt: skip
        vs = select.versus(recs[0], recs[1], metric, None, 0, 1000)
        passed += guard.holds(vs, False, margin)
    return passed


LOSS_GUARD_ITEMS = (100, 200, 600)  # a guard's held-out records


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    z, p = 1.959964, k / n
    mid, half = (
        (p + z * z / (2 * n)) / (1 + z * z / n),
        z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n),
    )
    return mid - half, mid + half


def _rounds_before(contest, scorer, menu, rounds, ship_opts, metric, limit, progress, early=0) -> None:
    """The menu's race before fewer swaps: every alive candidate on each round's items, in the same
    order each round (a swap per candidate and round), then every candidate behind the leader dropped.
    Installed in place of menu._visit by design_of("before"); the package races one way."""
    for batch in rounds:
        for name in contest.alive:
            contest.add(name, scorer.scores(menu[name], batch))
        for name in list(contest.alive):
            contest.behind(name)


@contextmanager
def design_of(design: str):
    """ "before": the race as it was before fewer swaps (`_rounds_before`, vanilla scored by the
    rounds, then again on the report items; both fits); "raced": today's (menu._visit: each candidate
    swapped in once, vanilla on both halves at once: menu._vanilla_first)."""
    from bema_cli.decide import menu

    saved = menu._visit, menu._vanilla_first
    if design == "before":  # vanilla too was scored round by round, then again on the report items
        menu._visit, menu._vanilla_first = _rounds_before, lambda *args: 0
    try:
        yield
    finally:
        menu._visit, menu._vanilla_first = saved


def run(reps: int, items: int, seed: int, lam_power: float = LAM_POWER) -> dict:
    from bema_cli.decide.request import ShipOptions

    opts = ShipOptions(out=Path("unused"), resamples=1000)
    with tempfile.TemporaryDirectory() as tmp:
        menu = menu_vectors(Path(tmp) / "basis")
    from bema_cli.decide.guard import DEFAULT_MARGIN

    m, n = DEFAULT_MARGIN["accuracy"], max(reps, 500)
    out = {"guard": {"reps": n, "margin": m, "worse_by_margin": guard_passes(-m, m, 660, n, seed),
                     "as_good": guard_passes(0.0, m, 660, n, seed + 1)}}  # fmt: skip
    lm = DEFAULT_MARGIN["loss"]
    out["loss_guard"] = [{"items": k, "reps": n, "margin": lm,
                          "worse_by_margin": loss_guard_passes(lm, lm, k, n, seed + 2),
                          "as_good": loss_guard_passes(0.0, lm, k, n, seed + 3)} for k in LOSS_GUARD_ITEMS]  # fmt: skip
    out["huge"] = [huge_world(max(reps // 10, 10), n, seed) for n in HUGE_ITEMS]
    for world_name, lam in (("null", 0.0), ("power", lam_power)):
        rows = []
        for r in range(reps):
            pair = {}
            for design in ("raced", "before", "exhaustive", *EFFECTS[world_name]):
                world = World(np.random.default_rng([seed, r, int(lam * 1e6)]), items, lam)
                effect = float(design.split(" ")[1]) if design.startswith("effect") else 0.0
                # the designs before: both fits on loss; today's: ship's own default (fits_for)
                fits = BOTH_FITS if design in ("before", "exhaustive") else None
                with design_of(design):
                    pair[design] = decide_once(
                        world, menu, design != "exhaustive", replace(opts, min_effect=effect, fits=fits)
                    )
                    pair[design]["min_effect"] = effect
            rows.append(pair)
        out[world_name] = rows
    return out


def summarise(res: dict) -> list[tuple[str, str, str, str]]:
    table = []

    def add(check, measured, target="(info)", ok=None):
        table.append((check, measured, target, "" if ok is None else ("PASS" if ok else "FAIL")))

    g = res["guard"]
    lo, hi = wilson(g["worse_by_margin"], g["reps"])
    rate = g["worse_by_margin"] / g["reps"]
    add(f"guard (gsm8k-sized, 660 items): passes an average worse by its margin {g['margin']:g}",
        f"{rate:.3f} [{lo:.3f}, {hi:.3f}]", "<= 0.05", rate <= 0.05)  # fmt: skip
    lo, hi = wilson(g["as_good"], g["reps"])
    add("  passes one as good as vanilla", f"{g['as_good'] / g['reps']:.3f} [{lo:.3f}, {hi:.3f}]")
    for g in res["loss_guard"]:
        lo, hi = wilson(g["worse_by_margin"], g["reps"])
        rate = g["worse_by_margin"] / g["reps"]
        add(f"loss guard ({g['items']} records): passes an average worse by its margin {g['margin']:g} nats/token",
            f"{rate:.3f} [{lo:.3f}, {hi:.3f}]", "<= 0.05", rate <= 0.05)  # fmt: skip
        lo, hi = wilson(g["as_good"], g["reps"])
        add("  passes one as good as vanilla", f"{g['as_good'] / g['reps']:.3f} [{lo:.3f}, {hi:.3f}]")
    for h in res["huge"]:
        bad = h["vanilla_shipped"] + h["dropped_by_vanilla"]
        add(f"huge world ({h['items']} records, --fit none): vanilla shipped; an average dropped by vanilla",
            f"{h['vanilla_shipped']}/{h['reps']}; {h['dropped_by_vanilla']}/{h['reps']}", "0; 0", bad == 0)  # fmt: skip
    both = res["null"] + res["power"]
    raced = sum(p["raced"]["items"] for p in both)
    whole = raced / sum(p["exhaustive"]["items"] for p in both)
    add("item evaluations, raced / exhaustive (menu, fits, report)", f"{whole:.2f}", "<= 0.33", whole <= 0.33)
    before = sum(p["before"]["items"] for p in both) / sum(p["exhaustive"]["items"] for p in both)
    add("  the same, before fewer swaps (every candidate in each round)", f"{before:.2f}")
    swaps, swaps_before = (np.mean([p[d]["swaps"] for p in both]) for d in ("raced", "before"))
    add("swaps per ship, raced / before fewer swaps", f"{swaps:.1f} / {swaps_before:.1f} = {swaps / swaps_before:.2f}",
        "<= 0.5", swaps / swaps_before <= 0.5)  # fmt: skip
    for world, designs in EFFECTS.items():
        for design in designs:
            rows, e = res[world], float(design.split(" ")[1])
            n = len(rows)
            short = sum(
                p[design]["average"] and p[design]["vanilla_truth"] - p[design]["truth"] < e for p in rows
            )
            lo, hi = wilson(short, n)
            add(f"{world}: --min-effect {e:g}: an average shipped whose true gain is under it",
                f"{short / n:.3f} [{lo:.3f}, {hi:.3f}]", "<= 0.05", short / n <= 0.05)  # fmt: skip
            ships = sum(p[design]["average"] for p in rows)
            stops = sum(p[design]["stopped"] for p in rows)
            add(
                "  averages shipped; races stopped early, no fit searched",
                f"{ships / n:.3f}; {stops / n:.3f}",
            )
    for world in ("null", "power"):
        rows = res[world]
        same = sum(p["raced"]["average"] == p["before"]["average"] for p in rows)
        lo, hi = wilson(same, len(rows))
        add(f"{world}: same decision as before fewer swaps", f"{same / len(rows):.3f} [{lo:.3f}, {hi:.3f}]",
            ">= 0.95", same / len(rows) >= 0.95)  # fmt: skip
    two = sum(p["raced"]["items_two_tasks"] for p in both) / sum(
        p["exhaustive"]["items_two_tasks"] for p in both
    )
    add("  same with a second task (gsm8k,loss)", f"{two:.2f}", "<= 0.3", two <= 0.3)
    for world, rows in ((w, res[w]) for w in ("null", "power")):
        n = len(rows)
        same = sum(p["raced"]["average"] == p["exhaustive"]["average"] for p in rows)
        lo, hi = wilson(same, n)
        add(
            f"{world}: same decision (an average, or vanilla)",
            f"{same / n:.3f} [{lo:.3f}, {hi:.3f}]",
            ">= 0.95",
            same / n >= 0.95,
        )
        gap = [p["raced"]["truth"] - p["exhaustive"]["truth"] for p in rows]
        mean, se = float(np.mean(gap)), float(np.std(gap, ddof=1) / math.sqrt(n)) if n > 1 else 0.0
        add(
            f"{world}: true loss shipped, raced - exhaustive",
            f"{mean:+.2e} (se {se:.1e})",
            "<= 2 se",
            mean <= 2 * se + 1e-15,
        )
        for design in ("raced", "exhaustive"):
            if world == "null":
                k = sum(
                    p[design]["average"] and p[design]["truth"] >= p[design]["vanilla_truth"] - 1e-12
                    for p in rows
                )
                lo, hi = wilson(k, n)
                add(
                    f"null: false claims, {design}",
                    f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]",
                    "<= 0.05",
                    k / n <= 0.05,
                )
            else:
                k = sum(
                    p[design]["average"] and p[design]["truth"] < p[design]["vanilla_truth"] for p in rows
                )
                lo, hi = wilson(k, n)
                add(f"power: ships a truly better average, {design}", f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]")
        if world == "power":
            kr = sum(
                p["raced"]["average"] and p["raced"]["truth"] < p["raced"]["vanilla_truth"] for p in rows
            )
            ke = sum(
                p["exhaustive"]["average"] and p["exhaustive"]["truth"] < p["exhaustive"]["vanilla_truth"]
                for p in rows
            )
            add(
                "power: raced - exhaustive",
                f"{(kr - ke) / n:+.3f}",
                ">= 0 within noise",
                kr >= ke - 2 * math.sqrt(max(ke, 1)),
            )
    return table


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_stabilize import COLUMNS, render

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lam", type=float, default=LAM_POWER, help="the power world's weight-noise loss")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    res = run(a.reps, a.items, a.seed, a.lam)
    table = summarise(res)
    head = (f"bema ship decision benchmark: {a.reps} repetitions per world, {a.items} held-out records "
            f"(holdout 0.5), {time.perf_counter() - t:.0f} s")  # fmt: skip
    text = render(table, [head])
    print(text, file=sys.stderr if a.json else sys.stdout)
    if a.json:
        example = res["power"][0]["raced"]["verdict"]
        print(
            json.dumps(
                {"rows": [dict(zip(COLUMNS, r, strict=True)) for r in table], "example_verdict": example}
            )
        )


if __name__ == "__main__":
    main()
