"""`bema ship --dry-run`: what the decision will cost, what its items can resolve, and whether
averaging can help at all, before any engine starts or anything is evaluated.

The evaluations are counted at most (no candidate dropped by the race, every duel run to the last
pick item), beside the design that scored every candidate on every item of every task; generated
tokens bound by n_samples x max_new_tokens per prompt; the wall time projected by the sweep's model
(sweep/project.py: the machine probe, the headers) on those evaluations, in rounds. The minimum
detectable difference of the report items comes from earlier records of this ship when there are
some (a resumed or repeated one), else, for accuracy, from the bound sd(d) <= 1 of a difference
of two scores in [0, 1]. The motion (how far each checkpoint moved from the previous one,
stabilize/motion.py) comes from an earlier attempt's record too, else from one read of the
checkpoints up to the step: the one part of a dry run that reads past the headers.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from bema_cli.decide import guard, power, race, select
from bema_cli.decide.decision import MIN_REPORT_ITEMS, undecidable
from bema_cli.decide.search import SOUP_CHECKPOINTS
from bema_cli.eval.job import Job
from bema_cli.eval.tasks import LOSS_TASKS
from bema_cli.stabilize import motion

SIMPLEX_TRIALS = 12  # fit.SIMPLEX_BUDGET


def budget(request, engine, work: Path) -> dict:
    """The dry run's document on `request` (request.ShipRequest, its run planned by ship)."""
    from bema_cli.decide.contest import item_ids
    from bema_cli.decide.metric import parse_metric
    from bema_cli.decide.scorer import arena_targets
    from bema_cli.eval.evaluate import Evaluation
    from bema_cli.io.probe import probe
    from bema_cli.machine import engine_speeds
    from bema_cli.stabilize.project import probe_sample
    from bema_cli.sweep.project import project

    (stab, plan, folder_of, step), config = request.run, request.config
    ship_opts, metric = request.options, request.metric
    evaluation = Evaluation(replace(config, out=None), engine)  # a dry run writes nothing
    # what the engine cannot serve is said here too (--backend vllm: refused; auto: transformers)
    unservable = evaluation.servable(folder_of[step])
    task = evaluation.inputs[metric.task]
    ids = item_ids(task)
    pick, report = select.sides(ids, ship_opts.holdout, ship_opts.seed)
    targets = arena_targets(plan, stab, step, folder_of)
    menu = len(targets)
    n_ckpt = len([c for c in plan.checkpoints if c.step <= step])
    soup = (
        menu + min(SOUP_CHECKPOINTS, n_ckpt) - 2 if "soup" in ship_opts.fits else 0
    )  # trials: ingredients - 1
    simplex = SIMPLEX_TRIALS if "simplex" in ship_opts.fits and metric.key == "loss" and n_ckpt > 1 else 0
    fits = soup + simplex
    others = guard.guard_tasks(config.tasks, metric.task)
    other_items = sum(len(item_ids(evaluation.inputs[t])) for t in others)
    vanilla_only = undecidable(len(report))  # as contest: nothing could ship, vanilla alone is scored
    loads = 1 if vanilla_only else 2  # the other tasks: vanilla, and the shipped model
    metric_items = len(ids) if vanilla_only else (menu + fits) * len(pick) + (3 if fits else 2) * len(report)
    at_most = metric_items + loads * other_items
    tasks_items = len(ids) + other_items
    exhaustive = (menu + fits + bool(soup) + bool(simplex)) * tasks_items  # each fit found, on every item
    doc = {
        "dry_run": True,
        "metric": metric.name,
        "step": step,
        "candidates": {"menu": menu, "fit_trials_at_most": fits},
        "items": {"pick": len(pick), "report": len(report), "other_tasks": other_items},
        "evaluations": {"at_most": at_most, "exhaustive_design": exhaustive},
        "round_items": race.ROUND_ITEMS,
        "backend": evaluation.backend_name,
    }
    if unservable:
        doc["vllm_cannot_serve"] = unservable
    # what each accuracy guard can show at its items, before anything runs (as ship says it)
    shape = {
        t: (t not in LOSS_TASKS and parse_metric(t).higher_is_better, len(item_ids(evaluation.inputs[t])))
        for t in others
    }
    guards = guard.foreseen(shape, ship_opts.guard_margin, metric.name)
    if guards:
        doc["guards"] = guards
    gen = [t for t in config.tasks if t not in LOSS_TASKS and not t.startswith("lm_eval:")]
    if gen:
        samples = 1 if config.temperature == 0 else config.n_samples
        per = {t: samples * (config.max_new_tokens or _max_new(t)) for t in gen}
        tokens = (per.get(metric.task, 0) * metric_items) + sum(
            loads * per[t] * len(item_ids(evaluation.inputs[t])) for t in gen if t != metric.task
        )
        doc["generated_tokens_at_most"] = tokens
    sample = probe_sample(plan)
    if sample is not None:
        jobs = _jobs(evaluation, targets, task, pick, report, ids, menu + fits, others, vanilla_only)
        speeds = {**probe(sample, work.parent), **engine_speeds()}
        model_bytes = plan.base_index.nbytes
        doc["projection"] = project(plan, evaluation, jobs, model_bytes, speeds)
    shipped = work.parent / work.name.removeprefix(".").removesuffix(".bema-ship") / ".bema-ship"
    doc["mdd"] = _mdd(work if (work / "race").is_dir() else shipped, metric, len(report))
    doc["motion_verdict"], doc["motion_from"] = _motion(plan, step, work, shipped)
    return doc


def _motion(plan, step: int, work: Path, shipped: Path) -> tuple[dict | None, str]:
    """The motion verdict (said on stderr when the last window barely moves): an earlier attempt's
    record, else one read of the checkpoints up to `step`."""
    from bema_cli.io.checkpoints import read_json

    for path in (work / motion.FILE, shipped / motion.FILE):
        rows = read_json(path)["motion"] if path.is_file() else []
        if rows and rows[-1]["step"] >= step:  # walked to this step (or past it)
            return motion.judge_rows([r for r in rows if r["step"] <= step], plan.runs), str(path)
    read = sum(
        plan.indexes[c.step].nbytes for c in plan.checkpoints if c.step <= step and c.step in plan.indexes
    )
    return motion.judge(motion.measure(plan, step), plan.runs)["motion_verdict"], f"{read / 1e9:.2g} GB read"


def _max_new(task: str) -> int:
    from bema_cli.eval.tasks import get_task

    return get_task(task).MAX_NEW_TOKENS


def _jobs(
    evaluation, targets: dict, task, pick, report, ids, candidates: int, others: list, vanilla_only: bool
) -> list[Job]:
    """The evaluations at most, as jobs the sweep's projection reads, a swap each: vanilla once on
    its pick and report items and the other tasks (menu.race_menu, contest), every other candidate
    on the pick items (menu._visit), two more finalists on the report items, the shipped model on
    the other tasks; with `vanilla_only` (decision.undecidable) vanilla's job alone."""
    from bema_cli.decide.scorer import slice_task

    vanilla = targets["vanilla"]

    def sliced(positions):
        return slice_task(task, [ids[i] for i in positions])

    other_inputs = [evaluation.inputs[t] for t in others]
    out = [Job(vanilla, [sliced(pick), sliced(report), *other_inputs], evaluation.config, "")]
    if vanilla_only:
        return out
    out += [Job(vanilla, [sliced(pick)], evaluation.config, "") for _ in range(candidates - 1)]
    out += [Job(vanilla, [sliced(report)], evaluation.config, "") for _ in range(2)]
    out += [Job(vanilla, other_inputs, evaluation.config, "")] if others else []
    return out


def _mdd(work: Path, metric, report_n: int) -> dict:
    """From an earlier attempt's records of vanilla and another candidate on the same report items,
    else the bound for accuracy, else unknown."""
    from bema_cli.eval.results import read_jsonl

    path = work / "race" / metric.task / "results.jsonl"
    if path.is_file():
        key = "nll" if metric.key == "loss" else metric.key
        by_model: dict[str, dict] = {}
        tokens: dict = {}
        for rec in read_jsonl(path):
            items = rec.get("items") or {}
            by_model.setdefault(rec["run"], {}).update(
                zip(items.get("ids", []), items.get(key, []), strict=False)
            )
            tokens.update(zip(items.get("ids", []), items.get("tokens", []), strict=False))
        van = by_model.pop("vanilla", {})
        for scores in by_model.values():
            common = [i for i in van if i in scores]
            if len(common) >= 10:
                diffs = [scores[i] - van[i] for i in common]
                scale = sum(tokens[i] for i in common) / len(common) if metric.key == "loss" else 1.0
                value = power.mdd(diffs, scale) * math.sqrt(len(diffs) / report_n)  # at the report's size
                return {"value": value, "from": f"{len(common)} items of earlier records ({path})"}
    if metric.key != "loss":
        return {"value": (power.Z_TEST + power.Z_POWER) / math.sqrt(report_n), "from": "the bound sd(d) <= 1"}
    return {"value": None, "from": "unknown before any record is evaluated (loss spreads are the data's)"}


def budget_line(doc: dict) -> str:
    """The dry run in one line (stdout without --json)."""
    ev, items = doc["evaluations"], doc["items"]
    parts = (
        [f"{items['report']} report items, fewer than {MIN_REPORT_ITEMS}: vanilla alone is scored"]
        if (undecidable(items["report"]))
        else []
    )
    parts += [
        f"at most {ev['at_most']} (candidate, item) evaluations (every candidate on every item: "
        f"{ev['exhaustive_design']})"
    ]
    if "generated_tokens_at_most" in doc:
        parts.append(f"at most {doc['generated_tokens_at_most']:,} generated tokens")
    if doc.get("projection"):
        unmeasured = doc["projection"].get("measured_floors") is None
        parts.append(
            f"~{doc['projection']['seconds']:.0f} s projected"
            + (
                f" (no {doc['backend']} run measured on this machine yet: it counts arithmetic alone and can read "
                "several times low; it is measured from the first run on)"
                if unmeasured
                else ""
            )
        )
    mdd = doc["mdd"]
    if mdd["value"] is None:
        parts.append(f"{items['report']} report items: what they resolve is {mdd['from']}")
    else:
        value = (
            f"{mdd['value']:.2g} nats/token"
            if doc["metric"] == "loss"
            else f"{100 * mdd['value']:.1f} points"
        )
        parts.append(
            f"{items['report']} report items resolve differences of {value} and up (80% power; {mdd['from']})"
        )
    parts.append(motion.describe(doc["motion_verdict"]))
    return f"ship --dry-run at step {doc['step']}: " + "; ".join(parts)
