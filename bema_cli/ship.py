"""`bema ship`: from a run folder to the model folder to ship, in one command: decide (decide/),
then publish (publish/).

It composes the parts that exist and adds no statistics of its own:
1. `bema sweep` judges a search space (DEFAULT_GRID, or the grid flags) in memory, in one engine, at
   the last saved step (or --at);
2. `bema select` picks on one part of the items (--holdout) and reports on the other, with the tie
   rule (vanilla, then the simplest, then the later step);
3. fitted averages (decide/fit.py: simplex weights on held-out loss, a greedy soup on accuracy; --fit), fitted on the pick
   items; one is shipped only if it beats the menu's pick on the report items, beyond the interval;
4. an average is written only if it beats vanilla beyond its interval on the report items; else the
   raw checkpoint is, and the verdict names the averages tested there, none beating vanilla;
5. DIR is written as the model folder (publish/write.py), and pushed with `--push` (publish/push.py).

Records live in `.DIR.bema-ship/` beside DIR while it runs (a killed ship resumes there, evaluating
nothing twice), then move into DIR/.bema-ship/ with the decision (ship.json).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from bema_cli import output, stages
from bema_cli.decide import select
from bema_cli.decide.contest import Contested, contest
from bema_cli.decide.outcome import Decision
from bema_cli.decide.request import ShipOptions, ShipRequest
from bema_cli.errors import InputError, OutputError, UsageError
from bema_cli.eval import timings
from bema_cli.eval.job import EvalConfig
from bema_cli.io.commit import locked
from bema_cli.publish import records as sealed
from bema_cli.publish.write import (
    WORK,
    check_apart_from,
    check_out_path,
    check_target,
    clean_staging,
    model_record,
    place,
    staging,
    write_card,
    write_vector,
)
from bema_cli.stabilize.plan import inputs_of


def ship(stab, config: EvalConfig, engine, ship_opts: ShipOptions, sweep_opts, validated=None) -> dict:
    """The whole loop; returns the --json document (the verdict, the decision and how it was made)."""
    out = Path(ship_opts.out).expanduser()
    if out.is_symlink():  # place() would replace the link by a folder: refused before any work
        raise UsageError(f"--out {out}: a symbolic link (to {os.readlink(out)}); give the folder itself")
    check_out_path(out, "--out")
    # the flags checked, then the one plan of this ship: its inputs, dry run and walk
    request = ShipRequest.of(stab, config, ship_opts, sweep_opts)
    inputs = [*inputs_of(request.run.plan, stab.checkpoint_dir), *config.read_paths(), *ship_opts.reads]
    check_apart_from(out, inputs, "--out")  # before any answer, record or evaluation
    if ship_opts.dry_run:
        from bema_cli.decide.budget import budget

        return budget(request, engine, out.parent / f".{out.name}.bema-ship")
    # one ship into DIR at a time: its records, staging siblings and the final rename are DIR's
    with locked(out.parent, f".{out.name}.bema-lock", label=out):
        return _ship(request, engine, validated, out, inputs)


def _ship(request: ShipRequest, engine, validated, out: Path, inputs: list[Path]) -> dict:
    ship_opts = request.options
    key = sealed.request_key(request, inputs)
    clean_staging(out, out.parent / f".{out.name}.bema-ship")  # what a killed ship left half-written
    if (out / WORK / "ship.json").is_file() and not ship_opts.overwrite:
        return sealed.up_to_date(out, key, ship_opts.push)
    check_target(out, ship_opts.overwrite)
    work = out.parent / f".{out.name}.bema-ship"
    if work.is_dir() and not _has_records(work):  # refused or failed before any record: nothing to resume
        shutil.rmtree(work)
    if work.exists() and (work / sealed.REQUEST).is_file() and (differs := sealed.differences(work, key)):
        if not ship_opts.overwrite:  # its records were made for another request: never reused silently
            raise OutputError(
                f"{work}: records of an earlier, interrupted ship made with another setup (differs in: "
                f"{', '.join(differs)}); --overwrite starts this one afresh"
            )
        shutil.rmtree(work)  # an interrupted ship of another request: --overwrite starts this one afresh
    if ship_opts.overwrite and (out / WORK).is_dir() and not work.exists():
        try:
            sealed.check_sealed(out / WORK)  # records edited by hand (or unsealed) are never reused
            shutil.copytree(out / WORK, work)  # decide again from the records already made
        except InputError as exc:
            output.warn(f"{exc}: its records are not reused; deciding afresh")
    reused = _has_records(work)
    try:
        return _decide(request, engine, validated, work, key)
    except InputError as exc:
        if not (ship_opts.overwrite and reused):
            raise
        # records reused from DIR or an interrupted ship that cannot be decided from (a line another
        # process appended, say): --overwrite always gets a decision, made afresh
        output.warn(f"{exc}: the records reused are set aside; deciding afresh (--overwrite)")
        shutil.rmtree(work, ignore_errors=True)
        return _decide(request, engine, validated, work, key)


def _decide(request: ShipRequest, engine, validated, work: Path, key: dict) -> dict:
    """The decision made (or resumed) in `work`, DIR written from it, pushed when asked."""
    ship_opts, out = request.options, Path(request.options.out).expanduser()
    if not (work / sealed.REQUEST).is_file():  # a resume keeps the request its records were made for
        work.mkdir(parents=True, exist_ok=True)
        sealed.write_request(work, key)
    stages.reset()
    try:
        made = contest(request, engine, work, validated)
    except BaseException:
        if not _has_records(work):  # refused (bad data, an engine that cannot start) before any record
            shutil.rmtree(work, ignore_errors=True)  # the corrected command then starts clean
        raise
    chosen, fitted = made.chosen, made.fitted
    # select's own sentence is select's rule, not the decision: the one verdict is the decision's
    shown = {k: v for k, v in chosen.items() if k not in ("verdict", "notes")}
    doc = {
        "request": key,
        "metric": request.metric.name,
        "step": chosen["winner"]["step"],
        "select": shown,
        "tie_rule": select.TIE_RULE,
        "holdout": ship_opts.holdout,
        "race": made.race,
        "backend": made.backend,
        "memory": made.memory,
    }
    if fitted:
        doc["fitted"] = fitted["doc"]
    doc["decision"], doc["verdict"] = made.decision.doc(), made.verdict
    if made.other_tasks:
        doc["other_tasks"] = made.other_tasks
    if made.guards:
        doc["guards"] = made.guards
    if made.notes:  # why an average may lose: its vector's weight on theta0, a window wider than the run
        doc["notes"] = made.notes
    if made.motion:  # can averaging help here? (motion.py), measured as the walk read the run
        doc["motion"], doc["motion_verdict"] = made.motion["motion"], made.motion["motion_verdict"]
    record = Decision.of(_public(doc))  # the one record every view renders (and report reads again)
    with stages.stage("write"):
        doc["written"] = _write(record, made, request, doc, work)
    if ship_opts.push:
        from bema_cli.publish.push import pushed

        pushed(doc, out, ship_opts.push)
    # where the whole command's time went: engine_start, walk, swap, loss/generate, write, push
    doc["stages"] = stages.report()
    timings.save(made.backend, doc["stages"])  # this machine's floors for the next projection
    return doc


def _has_records(work: Path) -> bool:
    """Whether a work folder holds a record worth resuming from (a non-empty results file)."""
    return any(p.is_file() and p.stat().st_size > 0 for p in work.rglob("*.jsonl"))


def _write(decision: Decision, made: Contested, request: ShipRequest, doc: dict, work: Path) -> dict:
    """DIR as the model folder: the shipped candidate's vector written by the one writer
    (write.write_vector: vanilla, a menu config and a fitted average alike), its card rendered from
    the decision; the records and ship.json go inside (DIR/.bema-ship)."""
    ship_opts, stab = request.options, request.run.stab
    out = Path(ship_opts.out).expanduser()
    step, steps, basis = decision.step, made.steps, made.basis
    folders = dict(zip(["theta0", *map(str, steps)], basis, strict=True))
    if decision.kind == "fitted":
        best = made.fitted["best"]
        cand, settings = best["candidate"], {"method": best["method"]}
        extra = {"ingredients": best["ingredients"]} if best["kind"] == "soup" else {}
    else:
        row = next(c for c in made.chosen["candidates"] if (c["run"], c["step"]) == (decision.shipped, step))
        cand, settings, extra = made.candidates[decision.shipped], row["stabilizer"] or {}, {}
    extra |= {"allow_gaps": True} if stab.allow_gaps else {}
    extra |= {"durations": stab.durations} if stab.durations else {}
    check_target(out, ship_opts.overwrite)
    tmp = staging(out, "ship")
    try:
        folder = tmp / "model"
        record = model_record(cand, step, settings, folders, made.base_source, out, **extra)
        write_vector(cand, folders, folders[str(step)], folder, record)
        write_card(
            folder,
            decision.card_rows(),
            made.base_source,
            folders["theta0"],
            decision.verdict,
            list(decision.notes),
        )
        (work / "ship.json").write_text(output.to_json(_public(doc)) + "\n")
        sealed.seal(work)
        shutil.move(str(work), str(folder / WORK))  # the records and ship.json; no candidate was kept
        place(folder, out, ship_opts.overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    output.log(f"wrote {out} ({decision.shipped} at step {step}) with its model card")
    return {"path": str(out), "run": decision.shipped, "step": step}


def _public(doc: dict) -> dict:
    """The --json document (and ship.json): plain data only (the fitted record's folder as text)."""
    return json.loads(output.to_json(doc))
