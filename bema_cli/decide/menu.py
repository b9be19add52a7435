"""The menu's race on the pick items, and its finalists on the report items.

Every menu config and vanilla is scored at the decision's step, each swapped into the engine once:
vanilla on every pick and report item (it is reported whatever the race does), then each config in
rounds of pick items while it is loaded (race.Race: it is dropped once the evidence that those
scored before it beat it reaches the race's level; vanilla never is). The survivors run to the last
pick item, and `select`'s own rule picks among them on the pick items (best, the paired-bootstrap
tie with it, the tie rule). Only the finalists, the pick and vanilla (and, when the tie rule picked
vanilla, the best average it passed over), are scored on the report items, where `select` reports
every number: vanilla's were scored in its load, so one more swap at most. docs/eval-protocol.md,
"Racing".
"""

from __future__ import annotations

from dataclasses import dataclass

from bema_cli import output
from bema_cli.decide import power, race, select

WITHIN = "within --min-effect"  # how a config retired by --min-effect is recorded in the race's "dropped"


@dataclass(frozen=True)
class Raced:
    """The menu's race: `select`'s document on the finalists (winner: the pick among the survivors),
    what happened (`race`: survivors, dropped, stops; the document's "race"), and the finalists'
    records on every item."""

    chosen: dict
    race: dict
    records: list[dict]


def race_menu(
    scorer, menu: dict, pick_ids: list, report_ids: list, ship_opts, metric, limit=None, progress: bool = True
) -> Raced:
    """`menu`: {name: candidate.Candidate}, vanilla's included."""
    names = ["vanilla", *(n for n in menu if n != "vanilla")]
    contest = race.Race(names, horizon=len(pick_ids), protect=["vanilla"])
    early = _vanilla_first(scorer, menu["vanilla"], pick_ids, report_ids)
    stopped = _visit(contest, scorer, menu, race.rounds(pick_ids), ship_opts, metric, limit, progress, early)
    seen = pick_ids[: min(len(contest.scores[n]) for n in contest.alive)]
    picked = select.select(
        [scorer.record(menu[n], seen) for n in contest.alive],
        metric,
        "last",
        None,
        ship_opts.resamples,
        ship_opts.seed,
    )
    pick = picked["winner"]["run"]
    finalists = ["vanilla"] + ([pick] if pick != "vanilla" else [])
    if pick == "vanilla":  # the best average it passed over (or the race dropped last): the verdict
        sign = 1.0 if metric.higher_is_better else -1.0  # says how it read, and the report's MDD needs a pair
        rows = [r for r in picked["candidates"] if r["run"] != "vanilla"]
        if rows:
            finalists.append(max(rows, key=lambda r: sign * r["value"])["run"])
        elif contest.dropped:
            finalists.append(max(contest.dropped, key=lambda n: contest.dropped[n]["after"]))
    ids = seen + report_ids
    records = [scorer.record(menu[n], ids) for n in finalists]
    for r in records:
        r["_where"] = f"{r['run']}@{r['step']}"
    # each id's side is a hash of (seed, id): `seen` stays the pick side, the report items the other
    chosen = select.select(records, metric, "last", ship_opts.holdout, ship_opts.resamples, ship_opts.seed)
    if chosen["winner"]["run"] != pick:  # the pick among every survivor, not among the finalists alone
        row = next(r for r in chosen["candidates"] if r["run"] == pick)
        chosen["winner"] = {k: row[k] for k in select.WINNER_KEYS} | {"tied_with": []}
        chosen["verdict"] = select.verdict(chosen)
    doc = {
        "survivors": contest.alive,
        "dropped": contest.dropped,
        "pick_items_seen": len(seen),
        "pick_items": len(pick_ids),
        "finalists": finalists,
        "stopped": stopped,
        "pick": [{k: r[k] for k in ("run", "value", "tied_with_best")} for r in picked["candidates"]],
    }
    return Raced(chosen, doc, records)


def _vanilla_first(scorer, vanilla, pick_ids: list, report_ids: list) -> int:
    """Vanilla on every pick and every report item, whatever the race does, in its one load (the race
    reads the pick items alone): the report items evaluated here, which the race does not count."""
    scorer.scores(vanilla, pick_ids)
    before = scorer.evaluated
    scorer.scores(vanilla, report_ids)
    return scorer.evaluated - before


def _visit(contest, scorer, menu, rounds, ship_opts, metric, limit, progress, early=0) -> str | None:
    """Each candidate swapped in once: vanilla on every pick item (scored already: _vanilla_first),
    then each other candidate round by round while it stays loaded, left (dropped) as soon as the
    evidence that those already scored beat it reaches the race's level (race.Race.behind), or
    (--min-effect) within the margin of vanilla; one that completes is a survivor, and the survivors
    before it meet it again on the items they all have. One swap per candidate, where rounds cost
    one per candidate and round (bench/bench_decide.py)."""
    stopped, pick, effect = None, [i for b in rounds for i in b], ship_opts.min_effect
    with output.progress("candidates") as bar:
        task = bar.add_task("racing the menu (pick items)", total=len(contest.alive))
        for k, name in enumerate(list(contest.alive)):
            # vanilla (the first) always runs on every pick item: a pick needs items; the limit counts
            # the race's items, not vanilla's report items (`early`)
            if k and limit is not None and scorer.evaluated - early + len(pick) > limit:
                stopped = f"--max-evaluations {limit} reached after {k} of {len(contest.scores)} candidates"
                contest.alive = [n for n in contest.alive if contest.scores[n]]
                break
            if progress:  # a line per candidate (the benchmark's thousands of races say none)
                output.log(
                    f"{metric.task}: menu candidate {k + 1} of {len(contest.scores)}: {name} on up to "
                    f"{len(pick)} pick items"
                )
            before = set(contest.dropped)
            for batch in rounds:
                contest.add(name, scorer.scores(menu[name], batch))
                if contest.behind(name):
                    break
                if effect and name != "vanilla" and _within(contest, scorer, menu, name, pick, effect):
                    contest.retire(name, f"{WITHIN} {effect:g} of vanilla")
                    break
            contest.completed(name)
            if progress:  # it, or one scored before it that it now beats
                _say_left(contest, [n for n in contest.dropped if n not in before], metric, len(pick))
            bar.advance(task)
    retired = any(d["by"].startswith(WITHIN) for d in contest.dropped.values())
    if stopped is None and retired and contest.alive == ["vanilla"]:
        stopped = (
            f"every candidate's sequence lies within --min-effect {effect:g} of vanilla, or below another's"
        )
    return stopped


def _say_left(contest, names: list[str], metric, items: int) -> None:
    """A line per candidate that left the race: when, and why (the rival whose evidence weighed most)."""
    for n in names:
        d = contest.dropped[n]
        why = (
            d["by"]
            if d["log10_evidence"] is None
            else f"the others beat it beyond the race's level (most clearly {d['by']})"
        )
        output.log(f"{metric.task}: {n} left the race after {d['after']} of {items} pick items: {why}")


def _within(contest, scorer, menu: dict, name: str, pick_ids: list, effect: float) -> bool:
    """`name`'s confidence sequence against vanilla ends below vanilla + effect, so it cannot be worth
    shipping at --min-effect. `effect` is in the metric's units (per token for loss: scaled by the
    items' mean tokens, as the items' scores are summed NLLs).

    Each config's "gains at least E over vanilla" is a fixed hypothesis, so Holm's step-down holds
    their family-wise error at a: after r retirements the others are tested at a / (K - 1 - r),
    the sequence's mixture kept tuned at a / (K - 1) (docs/eval-protocol.md, "Racing")."""
    t = len(contest.scores[name])
    if t < race.MIN_ITEMS:
        return False
    got = scorer.cache[menu["vanilla"].digest]
    scale = sum(got[i][1] for i in pick_ids[:t]) / t  # tokens per item (1 for accuracy)
    family = len(contest.scores) - 1  # every config; vanilla is the reference
    retired = sum(d["by"].startswith(WITHIN) for d in contest.dropped.values())
    a, tuned = contest.alpha / max(family - retired, 1), contest.alpha / max(family, 1)
    diffs = power.paired(contest.scores[name][:t], contest.scores["vanilla"][:t])
    return race.sequence(diffs, a, contest.horizon, tuned)[1] < effect * scale
