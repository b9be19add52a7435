"""ship's evaluations, spent only where they can change the decision, in one engine.

1. the menu raced on the pick items of the metric's task at the decision's step (menu.py);
2. the fits searched on the pick items, raced too (search.py);
3. the finalists on the report items; the rule (decision.py);
4. every other task for the shipped model and vanilla only, on all their items: reported, and a
   guard (guard.py): an average shown worse than vanilla there by more than the margin is blocked.
   Vanilla's are scored first, in its one load with its pick and report items (menu.race_menu).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from bema_cli import output
from bema_cli.decide import candidate, guard, select
from bema_cli.decide.decision import MIN_REPORT_ITEMS, decide, undecidable
from bema_cli.decide.menu import race_menu
from bema_cli.decide.metric import Metric, flip_note, flips, metric_value, parse_metric
from bema_cli.decide.outcome import Shipped
from bema_cli.decide.request import ShipRequest
from bema_cli.decide.scorer import Arena, ItemScorer, arena_targets
from bema_cli.decide.search import search
from bema_cli.errors import InputError
from bema_cli.eval.evaluate import Evaluation
from bema_cli.eval.results import ResultsFile
from bema_cli.eval.tasks import LOSS_TASKS
from bema_cli.io.checkpoints import read_json


def item_ids(task) -> list:
    """A task's item ids as its records name them (loss: positions in the file's prefix), one per
    distinct item: an interval counts independent items, and 40 copies of one held-out row are one
    (they gave a zero-width "95% interval")."""
    if not task.loss_records:
        return [d["_id"] for d in task.docs]
    seen, ids = set(), []
    for i, rec in enumerate(task.loss_records):
        key = json.dumps(rec, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            ids.append(i)
    if len(ids) < len(task.loss_records):
        output.warn(
            f"{task.name}: {len(task.loss_records) - len(ids)} of the {len(task.loss_records)} held-out "
            f"records repeat another; ship decides on the {len(ids)} distinct ones (an interval counts "
            "independent items)"
        )
    return ids


@dataclass(frozen=True)
class Contested:
    """What `contest` made: the decision and its verdict, everything the document and DIR are built
    from (ship.py), and what writing the shipped vector needs (its candidates, steps and basis)."""

    chosen: dict  # select's table of the menu's finalists on the report items
    fitted: dict | None  # the fits' search: its document and best candidate, or None
    decision: Shipped  # what ships, and what a guard blocked
    verdict: str  # the one sentence
    race: dict  # the menu's race: survivors, stops, evaluations
    other_tasks: dict  # each guard task, for the shipped (or blocked) candidate and vanilla
    guards: list  # each guard's check, the blocking one first
    notes: list  # why an average may lose, the flip tables, the held-out rows' shape
    motion: dict | None  # can averaging help here (motion.py)
    memory: dict
    backend: str
    candidates: dict  # the menu: {name: Candidate}
    steps: list  # the basis's checkpoint steps, and its folders (theta0 first)
    basis: list
    base_source: str


def contest(request: ShipRequest, engine, work, validated=None) -> Contested:
    """The decision on `request`, its records in `work`; `validated()` once the inputs are checked."""
    from bema_cli.sweep.session import check_inputs, memory_doc

    (stab, plan, folder_of, step), config = request.run, request.config
    ship_opts, sweep_opts, metric = request.options, request.sweep, request.metric
    race_config = replace(config, out=str(work / "race"))
    check_inputs(race_config, folder_of, plan, [step])
    if validated is not None:
        validated()
    evaluation = Evaluation(race_config, engine)
    memory, stab = memory_doc(plan, stab, race_config, engine, evaluation, sweep_opts)
    checkpoints = [c for c in plan.checkpoints if c.step <= step]
    steps = [c.step for c in checkpoints]
    basis = [plan.base_index.folder, *(c.path for c in checkpoints)]
    menu = candidate.menu(plan, step)  # every candidate is a vector over (theta0, steps)
    arena = Arena(evaluation, plan, stab, basis, steps, arena_targets(plan, stab, step, folder_of), menu)
    try:
        scorer = scorer_of(arena, metric, work)
        ids = item_ids(scorer.task)
        others, foreseen = _vanilla_on_other_tasks(
            arena, config, metric, menu["vanilla"], work, ship_opts.guard_margin
        )
        pick, report = select.sides(ids, ship_opts.holdout, ship_opts.seed)
        pick_ids, report_ids = [ids[i] for i in pick], [ids[i] for i in report]
        vanilla_only = undecidable(len(report_ids))  # the verdict says so, and how many records would decide
        if vanilla_only:
            output.warn(
                f"{metric.task}: {len(report_ids)} report items, fewer than {MIN_REPORT_ITEMS}: no average "
                "can be shipped on them, so only vanilla is scored"
            )
        racing = {"vanilla": menu["vanilla"]} if vanilla_only else menu
        raced = race_menu(scorer, racing, pick_ids, report_ids, ship_opts, metric, ship_opts.max_evaluations)
        if vanilla_only:
            raced.race["stopped"] = "too few report items to ship an average, so the menu was not raced"
        chosen, records = raced.chosen, raced.records
        fitted = None
        if ship_opts.fits and raced.race["stopped"] is None:
            fitted = search(
                scorer, menu, steps, raced.race["survivors"], pick_ids, report_ids, ship_opts, metric
            )
        decision, why = decide(chosen, fitted, metric, ship_opts, records)
        if raced.race["stopped"]:
            why += f" ({raced.race['stopped']}; the fits were not searched)"
        shipped = fitted["best"]["candidate"] if decision.kind == "fitted" else menu[decision.run]
        # the shipped candidate on the other tasks while it may still be loaded (the best fit, last
        # on the report items), then theta0 for the base note
        others, other_items = _other_tasks(others, shipped, menu["vanilla"])
        flip_notes = _flip_notes(
            others, scorer, shipped, menu["vanilla"], report_ids
        )  # while the engine is up
        base_note = _base_note(scorer, step, report_ids, metric)
        shape_note = _shape_note(plan, chosen, metric)
        if shape_note and base_note and not ship_opts.trust_held_out:  # both say so: confident, refused
            raise InputError(
                f"{config.loss_data}: {shape_note[0]}; and {base_note[0].split(': ', 1)[0]}. Nothing was written: "
                "give held-out rows in the shape the run trained on, or --trust-held-out to ship on these"
            )
        if shape_note:  # in the verdict itself, not only among the notes
            why += "; warning: the held-out rows may not be in the shape the run trained on (see the note)"
        for note in [*shape_note, *base_note]:
            output.warn(note)
        guards = guard.check(others, ship_opts.guard_margin)
        if guards and not guards[0]["passed"]:  # the first is a blocking one, when there is one
            why = guard.blocked_verdict(decision, why, guards[0], foreseen.get(guards[0]["task"]))
            van = next(c for c in chosen["candidates"] if c["run"] == "vanilla" and c["step"] == step)
            decision = decision.blocked_by(guards[0]["task"], van["value"])
    finally:
        arena.close()
    moved = _motion(arena, plan, work)
    trials = len(fitted["doc"]["candidates"]) + 2 if fitted else 0
    tasks = [t for t in config.tasks if t != "train_loss"]
    exhaustive = (len(menu) + trials) * len(ids) * len(tasks)  # every candidate, every item, every task
    raced.race["evaluations"] = {"items": scorer.evaluated + other_items, "exhaustive_design": exhaustive}
    return Contested(
        chosen=chosen,
        fitted=fitted,
        decision=decision,
        verdict=why,
        race=raced.race,
        other_tasks=others,
        guards=guards,
        notes=[*shape_note, *base_note, *flip_notes, *candidate.lag_notes(plan, menu, step)],
        motion=moved,
        memory=memory,
        backend=evaluation.backend_name,
        candidates=menu,
        steps=steps,
        basis=basis,
        base_source=plan.base_source,
    )


def _flip_notes(others: dict, scorer, shipped, vanilla, report_ids: list) -> list[str]:
    """Each accuracy task's flip table for the candidate the decision chose (shipped, or blocked by a
    guard) against vanilla: the metric's on its report items (both were scored there), the other
    tasks' on all their items."""
    if shipped.digest == vanilla.digest:
        return []
    out = []
    if scorer.metric.higher_is_better and report_ids:
        table = flips(scorer.record(shipped, report_ids), scorer.record(vanilla, report_ids), scorer.metric)
        out.append(flip_note(scorer.metric.task, shipped.name, table))
    out += [flip_note(task, doc["candidate"], doc["flips"]) for task, doc in others.items() if "flips" in doc]
    return out


def scorer_of(arena, metric, work) -> ItemScorer:
    """The metric's task scored in the arena, its records in work/race/<task>."""
    return ItemScorer(
        arena.evaluate, arena.evaluation.inputs[metric.task], metric, ResultsFile(work / "race" / metric.task)
    )


SHAPE_FACTOR, SHAPE_GAP = 2.0, 0.5  # held-out loss over twice the last training loss, and half a nat above


def _shape_note(plan, chosen, metric) -> list[str]:
    """Held-out rows in a shape the run did not train on score tokens it never learned (a
    prompt/completion run scored on {"messages"} rows: the user's own turns too): vanilla's held-out
    loss then sits far above the run's last logged training loss. Said (warned by `contest`), with
    the cause; with vanilla also above theta0 (`_base_note`) ship is confident and refuses."""
    if metric.key != "loss":
        return []
    state = max(plan.checkpoints, key=lambda c: c.step).path / "trainer_state.json"
    try:
        history = json.loads(state.read_text()).get("log_history", [])
        train = [
            h["loss"] for h in history if isinstance(h, dict) and isinstance(h.get("loss"), (int, float))
        ][-1]
    except (OSError, ValueError, AttributeError, IndexError):
        return []
    held = next(c["value"] for c in chosen["candidates"] if c["run"] == "vanilla")
    if not (held > SHAPE_FACTOR * train and held > train + SHAPE_GAP):
        return []
    note = (
        f"vanilla's held-out loss {held:.3g} nats/token is far above the run's last training loss "
        f"{train:.3g} ({state.parent.name}/trainer_state.json): the held-out rows may not be in the shape "
        'the run trained on ({"messages"} rows score every turn; prompt/completion training learns the '
        "completions alone): docs/usage.md says which shape matches which training format"
    )
    return [note]


def _base_note(scorer, step: int, ids: list, metric) -> list[str]:
    """Held-out loss that training raised: vanilla above theta0 on the report items means the run
    made these rows less likely (rows in a shape it did not train on, or a run that overfit). Costs
    theta0's loss on the report items; said, and warned, with the likely causes."""
    if metric.key != "loss" or not ids:
        return []
    base = candidate.Candidate.keyed("theta0", {candidate.THETA0: 1.0})
    losses = {}
    for cand in (candidate.vanilla(step), base):
        scorer.scores(cand, ids)
        got = scorer.cache[cand.digest]
        losses[cand.name] = sum(got[i][0] for i in ids) / max(sum(got[i][1] for i in ids), 1)
    held, before = losses["vanilla"], losses["theta0"]
    if held <= before:
        return []
    note = (
        f"vanilla's held-out loss {held:.3g} nats/token is above theta0's {before:.3g} on the same "
        f"{len(ids)} report items: training made these rows less likely. They may not be in the shape "
        "the run trained on (docs/usage.md says which shape matches which training format), or the "
        "run overfit"
    )
    return [note]


def _motion(arena, plan, work) -> dict | None:
    """The walk's motion, kept with the records (work/motion.json: a resumed ship that starts no
    engine, and a later `ship --dry-run`, read it there)."""
    from bema_cli.stabilize import motion

    if arena.motion is not None:
        motion.save(work, plan, arena.motion)
        return arena.motion
    return read_json(work / motion.FILE) if (work / motion.FILE).is_file() else None


def _vanilla_on_other_tasks(arena, config, metric, vanilla, work, guard_margin=None) -> tuple[dict, dict]:
    """({task: (its scorer, its item ids)} of each task other than the metric's, vanilla scored on
    every item; {task: its foresight} of the guards under guard.POWER, warned before anything is
    scored): vanilla's one load, before the race, serves every task it is reported on (whatever
    ships, vanilla is), so only the shipped candidate is swapped in again for them."""
    out = {}
    for task in guard.guard_tasks(config.tasks, metric.task):
        m = Metric(task, "loss", False) if task in LOSS_TASKS else parse_metric(task)
        scorer = scorer_of(arena, m, work)
        out[task] = scorer, item_ids(scorer.task)
    shape = {task: (scorer.metric.higher_is_better, len(ids)) for task, (scorer, ids) in out.items()}
    foreseen = {d["task"]: d for d in guard.foreseen(shape, guard_margin, metric.name) if "said" in d}
    for task, (scorer, ids) in out.items():
        output.log(f"{task}: vanilla on its {len(ids)} items (reported whatever ships; a guard)")
        scorer.scores(vanilla, ids)
    return out, foreseen


def _other_tasks(scorers: dict, shipped, vanilla) -> tuple[dict, int]:
    """Each task other than the metric's, for the shipped candidate and vanilla only: their values and
    the paired difference on every item, which guard.check reads (a guard blocks an average shown
    worse than vanilla there by more than its margin)."""
    out, evaluated = {}, 0
    for task, (scorer, ids) in scorers.items():
        m = scorer.metric
        mine, van = scorer.record(shipped, ids), scorer.record(vanilla, ids)
        evaluated += scorer.evaluated
        same = shipped.digest == vanilla.digest
        out[task] = {
            "metric": m.name,
            "higher_is_better": m.higher_is_better,
            "candidate": shipped.name,
            "shipped": metric_value(mine, m),
            "vanilla": metric_value(van, m),
            "vs_vanilla": None if same else select.versus(mine, van, m, None, 0),
        }
        if not same and (table := flips(mine, van, m)) is not None:
            out[task]["flips"] = table
    return out, evaluated
