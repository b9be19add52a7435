"""What `bema ship` ships, and the one sentence that says why, with numbers that say what they are.

The rule (docs/eval-protocol.md): the menu's pick (select's winner on the pick items, tie rule
included) ships if it beats vanilla beyond its interval on the report items; a fitted average
replaces it only if it beats both beyond their intervals there; else vanilla ships. The verdict
names which candidate was picked on which half and what the report half showed, the smallest
difference the report items can resolve (power.mdd), and beside a shipped difference its
winner's-curse-corrected estimate (power.corrected): it passed a test on the items that report it.
"""

from __future__ import annotations

from bema_cli.decide import power, select, verdict
from bema_cli.decide.metric import restrict
from bema_cli.decide.outcome import Shipped

# Fewer report items than this and the paired bootstrap's "95% interval" means nothing (one item
# gives one resample value: an interval of zero width); ship then writes vanilla and says it cannot
# decide. A floor against degenerate intervals, not a power guarantee: a percentile bootstrap of a
# mean covers 0.90 at 10 items, 0.93 at 20 (simulated: docs/eval-protocol.md).
MIN_REPORT_ITEMS = 10


def undecidable(report_n: int) -> bool:
    """Too few report items for any interval: vanilla ships whatever the averages score, so `contest`
    scores none of them and `--dry-run` projects vanilla alone."""
    return report_n < MIN_REPORT_ITEMS


Z95 = 1.959964


def decide(chosen: dict, fitted: dict | None, metric, ship_opts, records: list[dict]) -> tuple[Shipped, str]:
    """(what ships, the verdict sentence)."""
    w = chosen["winner"]
    step = w["step"]
    vanilla_row = _row(chosen, "vanilla", step)
    reported = chosen["selection"]["reported_on"]
    name = metric.name if metric.name != "loss" else "held-out loss"
    fmt_v, fmt_d = verdict.fmt_value, verdict.fmt_diff
    if undecidable(reported):  # no interval to trust: the raw checkpoint, and why
        return (
            Shipped(
                "vanilla",
                step,
                "vanilla",
                vanilla_row["value"],
                undecided=f"{reported} report items, fewer than {MIN_REPORT_ITEMS}",
            ),
            f"ship vanilla at step {step}: cannot decide on {reported} report item(s) (at least "
            f"{MIN_REPORT_ITEMS} are needed for an interval; {_more_items(chosen, ship_opts)})",
        )
    vanilla_rec = record_of(records, vanilla_row, metric)
    report_ids = _report_ids(vanilla_rec, ship_opts)
    van = restrict(vanilla_rec, report_ids, metric)
    better = metric.higher_is_better
    effect = ship_opts.min_effect
    menu = w if verdict.beats_vanilla(chosen, effect) else vanilla_row
    if fitted and fitted.get("best"):
        rec = fitted["best"]["record"]  # scored on the report items alone
        menu_rec = restrict(record_of(records, menu, metric), report_ids, metric)
        vs_menu = select.versus(rec, menu_rec, metric, None, ship_opts.seed, ship_opts.resamples)
        vs_vanilla = select.versus(rec, van, metric, None, ship_opts.seed, ship_opts.resamples)
        interval = select.report_interval(rec, metric, None, ship_opts.seed, ship_opts.resamples)
        fitted["doc"]["best"].update(vs_menu=vs_menu, vs_vanilla=vs_vanilla, interval=interval)
        if verdict.is_better(vs_menu, better) and verdict.is_better(vs_vanilla, better, effect):
            value = vanilla_row["value"] + vs_vanilla["value"]  # both on the report items
            numbers = resolution(rec, van, metric, vs_vanilla)
            return (
                Shipped(rec["run"], step, "fitted", value, vs_vanilla, **numbers),
                f"ship {rec['run']} at step {step}: {name} {fmt_v(value)} vs vanilla "
                f"{fmt_v(value - vs_vanilla['value'])} ({fmt_d(vs_vanilla)}; {_corrected(numbers)}); it beats "
                f"{menu['run']} ({fmt_d(vs_menu)}), the best of the menu; {_mdd(numbers, reported, metric)}",
            )
    if menu is not vanilla_row:
        numbers = resolution(
            restrict(record_of(records, w, metric), report_ids, metric), van, metric, w["vs_vanilla"]
        )
        vs = w["vs_vanilla"]
        return (
            Shipped(w["run"], step, "menu", w["value"], vs, **numbers),
            f"ship {w['run']} at step {step}: {name} {fmt_v(w['value'])} vs vanilla {fmt_v(w['value'] - vs['value'])} "
            f"({fmt_d(vs)}; {_corrected(numbers)}); {_mdd(numbers, reported, metric)}",
        )
    # vanilla ships: say which candidate each half pointed at
    picked_on = chosen["selection"]["picked_on"]
    best = w if w["run"] != "vanilla" else _best_average(chosen, step, better)
    if w["run"] != "vanilla" and effect and verdict.is_better(w["vs_vanilla"], better):  # not by enough
        why = (
            f"{w['run']} was picked on the {picked_on} pick items, and on the {reported} report items it "
            f"reads {fmt_d(w['vs_vanilla'])} against vanilla: beyond its interval, not beyond --min-effect "
            f"{effect:g}"
        )
    elif w["run"] != "vanilla":  # picked on the pick items, not beyond vanilla on the report items
        why = (
            f"{w['run']} was picked on the {picked_on} pick items, and on the {reported} report items it "
            f"reads {fmt_d(w['vs_vanilla'])} against vanilla, not beyond its interval"
        )
    elif best and best["tied_with_best"]:  # the tie rule chose vanilla on the pick items
        why = (
            f"on the {picked_on} pick items no average was better than vanilla beyond its interval "
            f"({best['run']}, the best there, tied with it: the tie rule picks vanilla)"
        )
    else:
        why = f"vanilla was the best on the {picked_on} pick items"
    beaten = [
        c
        for c in chosen["candidates"]
        if c["step"] == step
        and c["run"] != w["run"]
        and c["vs_vanilla"]
        and verdict.is_better(c["vs_vanilla"], better, effect)
    ]
    if not beaten:  # said of what was tested there: the finalists, not every average of the menu
        tested = [c["run"] for c in chosen["candidates"] if c["step"] == step and c["run"] != "vanilla"]
        if fitted and fitted.get("best"):
            tested.append(fitted["best"]["record"]["run"])
        # the bar the decision applied (decide filters by --min-effect when it is set): said as applied
        bar = f"by more than --min-effect {effect:g}" if effect else "beyond its interval"
        why += (
            f"; none of the averages scored on the report items ({', '.join(tested)}) beats vanilla {bar} "
            "there"
            if tested
            else "; no average reached the report items"
        )
    else:  # what the report half showed, said, and why it does not ship
        b = beaten[0]
        why += (
            f"; on the report items {b['run']} reads {fmt_d(b['vs_vanilla'])} against vanilla, but it was not "
            "picked, and choosing it now would pick on the items that report it"
        )
    if effect and w["run"] != "vanilla" and verdict.equivalent(w["vs_vanilla"], effect):
        why += f"; {w['run']} and vanilla are equivalent within --min-effect {effect:g} (its interval lies inside +-{effect:g})"
    numbers = (
        resolution(restrict(record_of(records, best, metric), report_ids, metric), van, metric)
        if best
        else {}
    )
    tail = f"; {_mdd(numbers, reported, metric)}" if numbers else ""
    return (
        Shipped("vanilla", step, "vanilla", vanilla_row["value"], **numbers),
        f"ship vanilla at step {step}: {name} {fmt_v(vanilla_row['value'])}; {why}{tail}",
    )


def _more_items(chosen: dict, ship_opts) -> str:
    """Advice that helps: the held-out records (or the --holdout) that leave MIN_REPORT_ITEMS to report on."""
    import math

    items, holdout = chosen["items"], ship_opts.holdout
    need = math.ceil(MIN_REPORT_ITEMS / max(1 - holdout, 1e-9))
    most = 1 - MIN_REPORT_ITEMS / items if items > MIN_REPORT_ITEMS else None
    more = f"give at least {need} held-out records at --holdout {holdout:g}"
    if most is not None and most > 0.1:
        return f"{more}, or pick on fewer: --holdout {math.floor(most * 100) / 100:g} leaves about {MIN_REPORT_ITEMS}"
    return more


def resolution(rec: dict, vanilla_rec: dict, metric, vs: dict | None = None) -> dict:
    """The minimum detectable difference of the report items (from the paired item differences of
    `rec` and vanilla), and, for a shipped difference `vs`, its winner's-curse-corrected estimate."""
    a, b = rec["items"], vanilla_rec["items"]
    if metric.key == "loss":
        diffs = [x - y for x, y in zip(a["nll"], b["nll"], strict=True)]
        scale = sum(b["tokens"]) / len(b["tokens"])  # loss = sum(nll) / sum(tokens)
    else:
        diffs = [x - y for x, y in zip(a[metric.key], b[metric.key], strict=True)]
        scale = 1.0
    out = {"mdd": power.mdd(diffs, scale)}
    if vs is not None:
        se = (vs["high"] - vs["low"]) / (2 * Z95)  # the bootstrap interval's width as a standard error
        sign = 1.0 if metric.higher_is_better else -1.0
        out["corrected"] = sign * power.corrected(sign * vs["value"], se)
    return out


def _corrected(numbers: dict) -> str:
    return f"{numbers['corrected']:+.4g} after the winner's-curse correction"


def _mdd(numbers: dict, reported: int, metric) -> str:
    if metric.key == "loss":
        return (
            f"{reported} report items: differences under {numbers['mdd']:.2g} nats/token cannot be told apart"
        )
    return (
        f"{reported} report prompts: differences under {100 * numbers['mdd']:.1f} points cannot be told apart"
    )


def _report_ids(rec: dict, ship_opts) -> list:
    ids = list(rec["items"]["ids"])
    _, report = select.sides(ids, ship_opts.holdout, ship_opts.seed)
    return [ids[i] for i in report]


def _row(chosen: dict, run: str, step: int) -> dict:
    return next(c for c in chosen["candidates"] if c["run"] == run and c["step"] == step)


def _best_average(chosen: dict, step: int, higher_is_better: bool) -> dict | None:
    """The best average on the pick items (what the tie rule passed over for vanilla)."""
    rows = [
        c for c in chosen["candidates"] if c["run"] != "vanilla" and c["step"] == step and c["vs_vanilla"]
    ]
    sign = 1.0 if higher_is_better else -1.0
    return max(rows, key=lambda c: sign * c["picked_value"], default=None)


def record_of(records: list[dict], row: dict, metric) -> dict:
    """The newest record of a select row (run, step) on the metric's task."""
    return [r for r in records if (r["run"], r["step"], r["task"]) == (row["run"], row["step"], metric.task)][
        -1
    ]
