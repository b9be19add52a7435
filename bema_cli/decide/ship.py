"""`bema ship`: from a run folder to the model folder to ship, in one command.

It composes the parts that exist and adds no statistics of its own:
1. `bema sweep` judges a search space (DEFAULT_GRID, or the grid flags) in memory, in one engine, at
   the last saved step (or --at);
2. `bema select` picks on one part of the items (--holdout) and reports on the other, with the tie
   rule (vanilla, then the simplest, then the later step);
3. fitted averages (fit.py: greedy soup, then simplex weights on held-out loss), fitted on the pick
   items; one is shipped only if it beats the menu's pick on the report items, beyond the interval;
4. an average is written only if it beats vanilla beyond its interval on the report items; else the
   raw checkpoint is, and the verdict says that no average beats vanilla;
5. DIR is written as the model folder (write.py), and pushed with `--push` (push.py).

Records live in `.DIR.bema-ship/` beside DIR while it runs (a killed ship resumes there, evaluating
nothing twice), then move into DIR/.bema-ship/ with the decision (ship.json).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from bema_cli import output, stages
from bema_cli.decide import fit, select, verdict
from bema_cli.decide import records as sealed
from bema_cli.decide.write import (
    WORK,
    check_apart_from,
    check_target,
    clean_staging,
    evaluation_rows,
    place,
    staging,
    write_card,
    write_winner,
)
from bema_cli.errors import InputError, OutputError, UsageError
from bema_cli.eval.evaluate import Evaluation, StaleRecords
from bema_cli.eval.job import EvalConfig, run_job
from bema_cli.eval.results import read_jsonl
from bema_cli.eval.targets import expand_inputs
from bema_cli.io.commit import locked

# The default search space (docs/math.md, "Which average when"): EMA and BEMA at the language-model
# defaults (kappa 0.5; eta 0.2, the paper's, and 0.5, a stronger correction), LAWA and WSM windows
# of 4 and 8 checkpoints. Vanilla is always a candidate.
DEFAULT_GRID = {"methods": ["ema", "bema", "lawa", "wsm"], "kappas": [0.5], "etas": [0.2, 0.5],
                "windows": [4, 8], "schedules": ["minus-sqrt"]}  # fmt: skip
FITS = ("soup", "simplex")
SOUP_CHECKPOINTS = 4  # the last saved checkpoints that join the menu as soup ingredients
SIMPLEX_K = 4  # the simplex weights span the last K checkpoints
# Fewer report items than this and the paired bootstrap's "95% interval" means nothing (one item
# gives one resample value: an interval of zero width); ship then writes vanilla and says it cannot
# decide. A floor against degenerate intervals, not a power guarantee: with 10 items a percentile
# bootstrap of a mean covers 0.90 at 10 items, 0.93 at 20 (simulated: docs/eval-protocol.md).
MIN_REPORT_ITEMS = 10


@dataclass
class ShipOptions:
    out: Path
    metric: str | None = None  # None: loss with --loss-data, else the first task
    holdout: float = 0.5
    at: str = "last"
    fits: tuple[str, ...] = FITS
    resamples: int = select.RESAMPLES
    seed: int = 0
    card_paths: str = "short"
    overwrite: bool = False
    push: str | None = None


def default_metric(config: EvalConfig) -> str:
    """Held-out loss when it is evaluated (--loss-data adds the task), else the first task."""
    return "loss" if "loss" in config.tasks else next(t for t in config.tasks if t != "train_loss")


def check(ship_opts: ShipOptions, config: EvalConfig) -> select.Metric:
    """The flags alone, before anything is read."""
    if ship_opts.holdout is None:
        raise UsageError("--holdout: ship picks on one part of the items and reports on the other")
    select.check_flags("last", ship_opts.holdout, ship_opts.resamples)
    bad = sorted(set(ship_opts.fits) - set(FITS))
    if bad:
        raise UsageError(f"--fit: unknown fit {bad[0]!r} (choose from {', '.join(FITS)}, or none)")
    metric = select.parse_metric(ship_opts.metric or default_metric(config))
    if metric.task not in config.tasks:
        raise UsageError(f"--metric {metric.name}: not among the evaluated tasks ({', '.join(config.tasks)})")
    return metric


def ship(stab, config: EvalConfig, engine, ship_opts: ShipOptions, sweep_opts, validated=None) -> dict:
    """The whole loop; returns the --json document (the verdict, the decision and how it was made)."""
    metric = check(ship_opts, config)
    out = Path(ship_opts.out).expanduser()
    inputs = _inputs(stab)
    check_apart_from(out, inputs, "--out")  # before any answer, record or evaluation
    # one ship into DIR at a time: its records, staging siblings and the final rename are DIR's
    with locked(out.parent, f".{out.name}.bema-lock", label=out):
        return _ship(stab, config, engine, ship_opts, sweep_opts, validated, metric, out, inputs)


def _ship(
    stab, config, engine, ship_opts, sweep_opts, validated, metric, out: Path, inputs: list[Path]
) -> dict:
    from bema_cli.sweep.run import sweep

    request = sealed.request(stab, config, ship_opts, inputs, metric)
    clean_staging(out, out.parent / f".{out.name}.bema-ship")  # what a killed ship left half-written
    if (out / WORK / "ship.json").is_file() and not ship_opts.overwrite:
        return sealed.up_to_date(out, request, ship_opts.push)
    check_target(out, ship_opts.overwrite)
    work = out.parent / f".{out.name}.bema-ship"
    if ship_opts.overwrite and work.exists() and not sealed.same_request(work, request):
        shutil.rmtree(work)  # an interrupted ship of another request: --overwrite starts this one afresh
    if ship_opts.overwrite and (out / WORK).is_dir() and not work.exists():
        try:
            sealed.check_sealed(out / WORK)  # records edited by hand (or unsealed) are never reused
            shutil.copytree(out / WORK, work)  # decide again from the records already made
        except InputError as exc:
            output.warn(f"{exc}: its records are not reused; deciding afresh")
    if not (work / sealed.REQUEST).is_file():  # a resume keeps the request its records were made for
        work.mkdir(parents=True, exist_ok=True)
        sealed.write_request(work, request)
    try:
        swept = sweep(stab, replace(config, out=str(work / "sweep")), engine,
                      replace(sweep_opts, at=ship_opts.at), validated=validated)  # fmt: skip
    except StaleRecords as exc:
        raise OutputError(
            f"{work}: records of an earlier, interrupted ship made with another setup ({exc.detail}); "
            "--overwrite starts this one afresh"
        ) from None
    records = _records(work / "sweep" / "results.jsonl")
    chosen = select.select(records, metric, "last", ship_opts.holdout, ship_opts.resamples, ship_opts.seed)
    step = chosen["winner"]["step"]
    doc = {"request": request, "metric": metric.name, "step": step, "select": chosen, "tie_rule": select.TIE_RULE,
           "holdout": ship_opts.holdout, "sweep": {k: swept[k] for k in ("runs", "evaluated", "backend")}}  # fmt: skip
    fitted = None
    if ship_opts.fits:
        fitted = _fit(stab, config, engine, ship_opts, metric, chosen, records, work)
        doc["fitted"] = fitted["doc"]
    decision, why = _decide(chosen, fitted, metric, ship_opts, records)
    doc["decision"], doc["verdict"] = decision, why
    with stages.stage("write"), stages.kept():  # stabilize's own reset would drop the sweep's stages
        doc["written"] = _write(decision, chosen, fitted, records, metric, ship_opts, doc, work)
    if ship_opts.push:
        from bema_cli.decide.push import push

        with stages.stage("push"):
            doc["pushed"] = push(out, ship_opts.push)
    # where the whole command's time went: the sweep's stages (from its start), then the fits'
    # (`combine`: candidates written; their evaluation adds to engine_start, swap, loss, generate)
    doc["stages"] = stages.report()
    return doc


def _inputs(stab) -> list[Path]:
    """What ship reads: the run folder, every checkpoint, the base and their weight files."""
    from bema_cli.stabilize.plan import inputs_of
    from bema_cli.stabilize.prepare import prepare
    from bema_cli.sweep.walk import sweep_options

    return inputs_of(prepare(sweep_options(stab)), stab.checkpoint_dir)


def _records(path: Path) -> list[dict]:
    return [{**r, "_where": f"{path} ({r.get('run')}@{r.get('step')})"} for r in read_jsonl(path)]


def _fit(stab, config, engine, ship_opts, metric, chosen, records, work) -> dict:
    """Greedy soup over the menu at the chosen step and the last checkpoints, then (loss) simplex
    weights over the last K checkpoints; each candidate written (fit.combine) and evaluated on disk
    with `bema eval`'s own code in one engine, scored on the pick items only."""
    from bema_cli.stabilize.prepare import prepare
    from bema_cli.sweep.walk import sweep_options

    plan = prepare(sweep_options(stab))
    step = chosen["winner"]["step"]
    folders = [c.path for c in plan.checkpoints if c.step <= step]
    steps = [c.step for c in plan.checkpoints if c.step <= step]
    with stages.stage("fit_basis"), stages.kept():  # a stabilize on the basis: keep the sweep's stages
        menu = fit.coefficients(stab.schedules, steps, step, work / "basis")
    n = len(steps) + 1
    basis = [plan.base_index.folder, *folders]
    evaluation = Evaluation(replace(config, out=str(work / "fit"), log_samples=False), engine)
    backend, scores, made = None, {}, []
    kept: dict[str, tuple[float, Path]] = {}  # per fit: its best written candidate so far (the rest go)

    def write(c: list[float], name: str, method: str, **extra) -> Path:
        """`c` as a model folder: a saved checkpoint (one-hot c) where it is, any other vector written
        (fit.combine, deterministic: a rewrite is the same bytes) into the work folder."""
        key = fit.digest(c)
        folder = work / "fit" / "models" / f"{name}-{key}"
        if c.count(0.0) == n - 1 and c.count(1.0) == 1 and c[0] != 1.0:
            return basis[c.index(1.0)]  # a checkpoint of the run: nothing to write
        if not (folder / "bema.json").is_file():
            tmp = staging(folder, "fit")
            try:  # an error or a signal leaves no half-written candidate
                record = fit.fitted_record(f"{name}-{key}", method, step, c, folders, plan.base_source,
                                           folders[-1], **extra)  # fmt: skip
                with stages.stage("combine"):
                    fit.combine([(basis[j], w) for j, w in enumerate(c)], folders[-1], tmp / "m", record)
                folder.parent.mkdir(parents=True, exist_ok=True)
                (tmp / "m").rename(folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return folder

    def score(c: list[float], name: str, method: str, **extra) -> float:
        """`c`'s pick score, evaluated from its model folder (`write`)."""
        nonlocal backend
        key = fit.digest(c)
        if key in scores:
            return scores[key][0]
        folder = write(c, name, method, **extra)
        target = expand_inputs([str(folder)])
        if backend is None:
            backend = evaluation.start(lambda b: b.load(folder))
        for job in evaluation.plan(target):
            for recs, samples in run_job(backend, job):
                evaluation.write(recs, samples)
        where = str(target[0].path)
        rec = [
            r for r in evaluation.results.records if r["model_path"] == where and r["task"] == metric.task
        ][-1]
        value = select.pick_value(rec, metric, ship_opts.holdout, ship_opts.seed)
        scores[key] = (value, folder, rec)
        made.append({"run": rec["run"], "step": rec["step"], "pick_value": value})
        if folder.parent == work / "fit" / "models":  # a written candidate: keep its fit's best only
            prev = kept.get(name)
            if prev is None or sign * value > sign * prev[0]:
                kept[name] = (value, folder)
                folder = prev[1] if prev is not None else None
            if folder is not None:  # a resume rewrites it (its records stand: nothing is evaluated twice)
                shutil.rmtree(folder, ignore_errors=True)
        return value

    sign = 1.0 if metric.higher_is_better else -1.0
    picked = {c["run"]: c["picked_value"] for c in chosen["candidates"] if c["step"] == step}
    ingredients = [(run, menu[run], picked[run]) for run in menu if run in picked]
    ingredients.append(("vanilla", [0.0] * (n - 1) + [1.0], picked["vanilla"]))
    for j in range(max(1, n - SOUP_CHECKPOINTS), n - 1):  # earlier saved checkpoints, scored from disk
        e = [0.0] * n
        e[j] = 1.0
        ingredients.append((f"checkpoint-{steps[j - 1]}", e, score(e, "checkpoint", "vanilla")))
    try:
        result = {"candidates": made}
        best = None
        if "soup" in ship_opts.fits:
            names, c, value = fit.greedy_soup(ingredients, lambda c: score(c, "soup", "soup"), sign)
            if len(names) > 1:  # a soup of one ingredient is that ingredient
                score(c, "soup", "soup", ingredients=names)
                best = ("soup", c, value, "soup")
            result["soup"] = {"ingredients": names, "pick_value": value}
        if "simplex" in ship_opts.fits and metric.key == "loss" and n > 2:
            k = min(SIMPLEX_K, n - 1)
            c, value, calls = fit.simplex_fit(k, n, lambda c: score(c, "simplex", f"simplex-k{k}"))
            result["simplex"] = {
                "k": k,
                "evaluations": calls,
                "pick_value": value,
                "search": "coordinate search on softmax logits",
            }
            if best is None or sign * value > sign * best[2]:
                best = ("simplex", c, value, f"simplex-k{k}")
    finally:
        if backend is not None:
            backend.close()
    out = {"doc": result, "best": None}
    if best is not None:
        value, folder, rec = scores[fit.digest(best[1])]
        if not folder.is_dir():  # removed as a fit's non-best (a tie): written again, the same bytes
            folder = write(best[1], best[0], best[3])
        out["best"] = {"kind": best[0], "coefficients": best[1], "folder": folder, "record": rec}
        result["best"] = {"kind": best[0], "run": rec["run"], "pick_value": value}
    return out


def _decide(chosen: dict, fitted: dict | None, metric, ship_opts, records: list[dict]) -> tuple[dict, str]:
    """What is shipped, and the one-line verdict. Menu: the select winner if it beats vanilla beyond
    its interval on the report items, else vanilla. A fitted average replaces it only if it beats it
    (and vanilla) beyond the interval on the report items."""
    w = chosen["winner"]
    vanilla_row = next(c for c in chosen["candidates"] if c["run"] == "vanilla" and c["step"] == w["step"])
    reported = chosen["selection"]["reported_on"]
    if reported < MIN_REPORT_ITEMS:  # no interval to trust: the raw checkpoint, and why
        return (
            {
                "run": "vanilla",
                "step": w["step"],
                "kind": "vanilla",
                "value": vanilla_row["value"],
                "undecided": f"{reported} report items, fewer than {MIN_REPORT_ITEMS}",
            },  # fmt: skip
            f"ship vanilla at step {w['step']}: cannot decide on {reported} report item(s) (at least "
            f"{MIN_REPORT_ITEMS} are needed for an interval; give more held-out records or a larger --holdout)",
        )
    menu = w if verdict.beats_vanilla(chosen) else vanilla_row
    name = metric.name if metric.name != "loss" else "held-out loss"
    fmt_v, fmt_d = verdict.fmt_value, verdict.fmt_diff
    if fitted and fitted.get("best"):
        rec = fitted["best"]["record"]
        menu_rec = _record_of(records, menu, metric)
        vanilla_rec = _record_of(records, vanilla_row, metric)
        vs_menu = select.versus(rec, menu_rec, metric, ship_opts.holdout, ship_opts.seed, ship_opts.resamples)
        vs_vanilla = select.versus(
            rec, vanilla_rec, metric, ship_opts.holdout, ship_opts.seed, ship_opts.resamples
        )
        fitted["doc"]["best"].update(vs_menu=vs_menu, vs_vanilla=vs_vanilla)
        better = metric.higher_is_better
        if verdict.is_better(vs_menu, better) and verdict.is_better(vs_vanilla, better):
            value = vanilla_row["value"] + vs_vanilla["value"]  # both on the report items
            return (
                {
                    "run": rec["run"],
                    "step": w["step"],
                    "kind": "fitted",
                    "value": value,
                    "vs_vanilla": vs_vanilla,
                },
                f"ship {rec['run']} at step {w['step']}: {name} {fmt_v(value)} vs vanilla "
                f"{fmt_v(value - vs_vanilla['value'])} ({fmt_d(vs_vanilla)}); it beats {menu['run']} "
                f"({fmt_d(vs_menu)}), the best of the menu",
            )
    if menu is vanilla_row:
        best = w if w["run"] != "vanilla" else None
        best = best or min(
            (c for c in chosen["candidates"] if c["run"] != "vanilla" and c["vs_vanilla"]),
            key=lambda c: (-1 if metric.higher_is_better else 1) * c["value"], default=None,
        )  # fmt: skip
        closest = f" (the best, {best['run']}: {fmt_d(best['vs_vanilla'])})" if best else ""
        return (
            {"run": "vanilla", "step": w["step"], "kind": "vanilla", "value": vanilla_row["value"]},
            f"ship vanilla at step {w['step']}: {name} {fmt_v(vanilla_row['value'])}; no average beats "
            f"vanilla beyond its interval{closest}",
        )
    return (
        {
            "run": menu["run"],
            "step": w["step"],
            "kind": "menu",
            "value": menu["value"],
            "vs_vanilla": menu["vs_vanilla"],
        },
        chosen["verdict"],
    )


def _record_of(records: list[dict], row: dict, metric) -> dict:
    """The newest record of a select row (run, step) on the metric's task."""
    return [r for r in records if (r["run"], r["step"], r["task"]) == (row["run"], row["step"], metric.task)][
        -1
    ]


def _write(decision, chosen, fitted, records, metric, ship_opts, doc, work) -> dict:
    """DIR as the model folder: the menu's pick or vanilla through the streaming stabilize engine,
    a fitted average through fit.combine; the records and ship.json go inside (DIR/.bema-ship)."""

    out = Path(ship_opts.out).expanduser()

    def keep(folder: Path) -> None:
        # what stays (docs/eval-protocol.md): the records and ship.json, never a fitted model (DIR is the
        # shipped one; an --overwrite that needs a candidate again rewrites it, evaluating nothing twice)
        shutil.rmtree(work / "fit" / "models", ignore_errors=True)
        (work / "ship.json").write_text(output.to_json(_public(doc)) + "\n")
        sealed.seal(work)
        shutil.move(str(work), str(folder / WORK))

    if decision["kind"] != "fitted":
        row = next(
            c for c in chosen["candidates"] if (c["run"], c["step"]) == (decision["run"], decision["step"])
        )
        one = {**chosen, "winner": {k: row[k] for k in select.WINNER_KEYS}}
        return write_winner(one, records, out, ship_opts.card_paths, ship_opts.overwrite, keep=keep)
    best = fitted["best"]
    tmp = staging(out, "ship")
    try:
        folder = tmp / "model"
        shutil.move(str(best["folder"]), str(folder))  # the shipped candidate itself, not a copy
        rec = best["record"]
        lo_hi = select.report_interval(rec, metric, ship_opts.holdout, ship_opts.seed)
        write_card(folder, chosen, evaluation_rows(chosen, decision["value"], lo_hi, decision["vs_vanilla"]),
                   ship_opts.card_paths)  # fmt: skip
        keep(folder)
        place(folder, out, ship_opts.overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    output.log(f"wrote {out} ({decision['run']} at step {decision['step']}) with its model card")
    return {"path": str(out), "run": decision["run"], "step": decision["step"]}


def _public(doc: dict) -> dict:
    """The --json document (and ship.json): plain data only (the fitted record's folder as text)."""
    return json.loads(output.to_json(doc))
