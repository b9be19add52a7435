"""`bema ship`: a run folder in, the model folder to ship out (bema_cli/ship.py)."""

from __future__ import annotations

from bema_cli import output, stages
from bema_cli.commands.eval_options import eval_settings
from bema_cli.commands.flags import EngineFlags, EvalFlags, GridFlags, InputFlags, WalkFlags, with_flags
from bema_cli.options import JsonOpt, argument, option, parse_str_list


@with_flags(grid=GridFlags, inputs=InputFlags, walk=WalkFlags, ev=EvalFlags, eng=EngineFlags)
def ship(
    checkpoint_dir: argument(str, help="Training output folder (checkpoint-N folders)."),
    out: option(str, "--out", "-o", help="The model folder to write (weights, config, tokenizer, card)."),
    at: option(str, "--at", help="The step to judge: last (the last saved) or a step.") = "last",
    metric: option(
        str | None,
        "--metric",
        help="Default: loss with --loss-data, else the first task (gsm8k:strict, ...).",
    ) = None,
    dry_run: option(
        bool,
        "--dry-run",
        help="Say what the decision will cost (evaluations at most, generated tokens, projected time) "
        "and the smallest difference its report items can resolve; evaluate nothing.",
    ) = False,
    holdout: option(
        float, "--holdout", help="Pick on this seeded fraction of the items, report every number on the rest."
    ) = 0.5,
    fit: option(
        str,
        "--fit",
        help="Fitted averages after the menu: soup, simplex (loss only), both, or none "
        "(default: simplex on loss, soup on accuracy).",
        show_default=False,
    ) = "auto",
    resamples: option(int, "--resamples", help="Paired bootstrap resamples.") = 2000,
    select_seed: option(int, "--select-seed", help="Seed of the pick/report split and the bootstrap.") = 0,
    max_evaluations: option(
        int | None,
        "--max-evaluations",
        help="Stop the menu's race before a candidate would pass this many (candidate, item) pairs, and "
        "decide on what it has (no fits); vanilla always runs on every pick item.",
        min=1,
    ) = None,
    min_effect: option(
        float,
        "--min-effect",
        help="Ship an average only if its interval against vanilla lies beyond this difference (the "
        "metric's units: nats/token for loss); the race stops early once no candidate can reach it.",
    ) = 0.0,
    guard_margin: option(
        float | None,
        "--guard-margin",
        help="With several tasks, the ones --metric does not name guard the decision: an average ships only "
        "if shown not worse than vanilla on each by more than this (default: 0.03 accuracy, 0.02 nats/token).",
    ) = None,
    method: option(
        str | None,
        "--method",
        help="Replace the menu: bema, ema, dema, ouema, lawa, wsm, swa, power, vanilla; comma list for a grid (default: the menu: vanilla, ema, bema at eta 0.2 and 0.5, lawa and wsm over 4 and 8 checkpoints).",
    ) = None,
    tasks: option(
        str | None,
        "--tasks",
        help="Comma list of tasks, as bema eval takes them (default: loss alone with --loss-data, which then decides; else gsm8k).",
    ) = None,
    overwrite: option(
        bool, "--overwrite", help="Decide again and replace the model folder bema wrote at --out."
    ) = False,
    push: option(str | None, "--push", help="Then upload it to this Hub model repo (ORG/NAME).") = None,
    trust_held_out: option(
        bool,
        "--trust-held-out",
        help="Ship even when vanilla's held-out loss is far above the run's training loss and above "
        "theta0's (held-out rows in another shape than the run trained on): refused without it.",
    ) = False,
    json_: JsonOpt = False,
    *,
    grid: GridFlags,
    inputs: InputFlags,
    walk: WalkFlags,
    ev: EvalFlags,
    eng: EngineFlags,
) -> None:
    """Judge the run's averages in memory, pick with intervals, fit an average, and write the one to ship.

    The menu (default: vanilla, EMA, BEMA at eta 0.2 and 0.5, LAWA and WSM over 4 and 8 checkpoints, or all of a shorter run) is judged at the last saved step in one engine; the pick is made on --holdout of the items and every number reported on the rest. An average is written only if it beats vanilla beyond its 95% interval; else the raw checkpoint is, and the verdict says so. Ties go to vanilla, then the simplest config, then the later step.
    """
    from dataclasses import replace
    from pathlib import Path

    from bema_cli.decide.request import DEFAULT_GRID, ShipOptions, check
    from bema_cli.errors import BemaError, HubAuthError, InputError, UsageError
    from bema_cli.eval.evaluate import LIBRARY_LOG
    from bema_cli.publish.push import check_repo_id, check_token, token_missing
    from bema_cli.ship import ship as run
    from bema_cli.stabilize import grid as menu
    from bema_cli.sweep.session import parse_at

    parse_at(at)
    if push:
        check_repo_id(push)
        if (missing := token_missing()) is not None:  # before the race, not after an hour of it
            if not dry_run:
                raise HubAuthError(f"--push {push}: {missing}")
            output.warn(f"--push {push}: {missing}")
        elif (unchecked := check_token(push)) is not None:  # a refused token raises here, exit 6
            output.warn(unchecked)
    fits = _fits(fit)
    defaulted = tasks is None and ev.loss_data is None
    if tasks is None:  # the decision is made on loss when there is held-out data: no generation task
        tasks = "loss" if ev.loss_data is not None else "gsm8k"
    race = str(Path(out).parent / f".{Path(out).name}.bema-ship" / "race")
    evaluation, engine = eval_settings(ev, eng, tasks, race)
    if guard_margin is not None and not guard_margin >= 0:
        raise UsageError(f"--guard-margin: a difference in the guard's units, >= 0; got {guard_margin}")
    if not min_effect >= 0:
        raise UsageError(f"--min-effect: a difference in the metric's units, >= 0; got {min_effect}")
    ship_opts = ShipOptions(
        Path(out),
        metric,
        holdout,
        at,
        fits,
        resamples,
        select_seed,
        overwrite,
        push,
        max_evaluations,
        dry_run=dry_run,
        min_effect=min_effect,
        guard_margin=guard_margin,
        reads=(Path(grid.config).expanduser(),) if grid.config else (),
        trust_held_out=trust_held_out,
    )
    check(ship_opts, evaluation)
    found = _listed(checkpoint_dir)  # once: the menu's windows, the grid's durations and the plan read it
    if grid.given(method):
        schedules, durations = grid.schedules(method, checkpoint_dir, found)
    else:  # the menu, its windows no wider than the run: 3 checkpoints make lawa-w3, not lawa-w4 of 3
        windows = _windows(len(found) if found else None)
        schedules, durations = menu(**{**DEFAULT_GRID, "windows": windows}, **grid.common()), {}
    opts = replace(walk.options(checkpoint_dir, schedules, race, durations, inputs), checkpoints=found)
    try:
        doc = run(
            opts,
            evaluation,
            engine,
            ship_opts,
            walk.sweep_options(at),
            validated=lambda: output.send_library_output(Path(race) / LIBRARY_LOG),
        )
    except InputError as exc:
        if defaulted and str(exc).startswith("no data"):  # the user never named gsm8k: say why it is there
            raise InputError(
                f"ship decides on --loss-data FILE (held-out loss) or on --tasks; with neither "
                f"it decides on gsm8k, and found {exc}"
            ) from None
        raise
    except BemaError as exc:  # a refused push: the decision is made and the model written; say it first
        if getattr(exc, "document", None) is not None and not json_:  # --json: the error's document holds it
            _say(exc.document, json_)
        raise
    _say(doc, json_)


def _fits(text: str) -> tuple[str, ...] | None:
    """--fit: None for auto (decide/request.fits_for says it per metric), () for none, else the list."""
    word = text.strip()
    return None if word == "auto" else () if word == "none" else tuple(parse_str_list(text, "--fit"))


def _listed(checkpoint_dir: str):
    """The run's checkpoints, listed once for the whole ship; None where the listing fails (the plan
    then says why, with its fix, as for any run)."""
    from bema_cli.errors import BemaError
    from bema_cli.io.checkpoints import find_checkpoints

    try:
        return find_checkpoints(checkpoint_dir)
    except BemaError:
        return None


def _windows(count: int | None) -> list[int]:
    """The menu's windows (DEFAULT_GRID's), each at most the run's checkpoint count: a window wider
    than the run averages what there is, under the name of what it averages."""
    from bema_cli.decide.request import DEFAULT_GRID

    if not count or count < 2:
        return DEFAULT_GRID["windows"]
    return sorted({min(w, count) for w in DEFAULT_GRID["windows"]})


def _say(doc: dict, json_: bool) -> None:
    """The --json document, or the verdict (or the dry run's budget) and its notes."""
    from bema_cli.decide.budget import budget_line

    if doc.get("stages"):
        output.log(stages.line(doc["stages"]))
    if json_:
        output.print_json(doc)
    elif doc.get("dry_run"):
        output.stdout.print(budget_line(doc), highlight=False, markup=False)
    else:  # the decision's own record, as the card and `bema report DIR` render it
        from bema_cli.decide.outcome import Decision

        for line in Decision.of(doc).lines():
            output.stdout.print(line, highlight=False, markup=False)
