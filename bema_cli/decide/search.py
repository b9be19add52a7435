"""`bema ship`'s fitted averages: the search on the pick items, raced, from memory.

The fits --fit names (request.fits_for: the simplex on loss, the soup on accuracy by default): a greedy
soup over the menu at the chosen step and the last checkpoints, then (loss) simplex weights over the
last K checkpoints (fit.py). Each candidate is a coefficient vector evaluated from memory
(scorer.ItemScorer: nothing written) on the metric's task alone and on the pick items alone; each
"does it improve" is a race on them (race.duel). The best is evaluated on the report items, as a
finalist beside the menu's pick and vanilla (decision.py compares them there).
"""

from __future__ import annotations

from bema_cli import output
from bema_cli.card import recipe
from bema_cli.decide import fit, race
from bema_cli.decide.candidate import Candidate, digest
from bema_cli.decide.metric import metric_value

FITS = ("soup", "simplex")
SOUP_CHECKPOINTS = 4  # the last saved checkpoints that join the menu as soup ingredients
SIMPLEX_K = 4  # the simplex weights span the last K checkpoints
RANK_ITEMS = 32  # the soup's ingredients are ordered by their mean on the first pick items alone


def search(
    scorer,
    menu: dict,
    steps: list[int],
    survivors: list[str],
    pick_ids: list,
    report_ids: list,
    ship_opts,
    metric,
    duel=race.duel,
    progress: bool = True,
) -> dict:
    """The fits at the decision's step over (theta0, `steps`), scored by `scorer` (the arena's
    engine: nothing written) on the pick items, raced; the best of them then on the report items (a
    finalist). `menu`: {name: Candidate} (the vectors the race scored: not evaluated again)."""
    n = len(steps) + 1
    vectors = {name: c.coefficients(steps) for name, c in menu.items() if name != "vanilla"}
    ingredients = ingredients_of(vectors, set(survivors), steps)  # the race's dropped configs are worse

    def scores(c, ids, name):
        return scorer.scores(Candidate.of(name, c, steps), ids)

    def say(kind: str, c: list[float]) -> None:  # a trial named by what it is: its weights
        output.log(f"{metric.task}: {kind} trial: {recipe(Candidate.of(kind, c, steps).record, most=4)}")

    loss = metric.key == "loss"
    result, found, best = fit_search(
        scores,
        ingredients,
        pick_ids,
        ship_opts.fits,
        n,
        loss,
        duel=duel,
        report_n=len(report_ids),
        say=say if progress else None,
        name_of=lambda c: Candidate.of("", c, steps).digest,
    )
    digests = {cand.digest: name for name, cand in menu.items()}
    for kind, c, _ in found:  # in the metric's units, on every pick item
        fitted = Candidate.of(kind, c, steps)
        result[kind]["pick_value"] = metric_value(scorer.record(fitted, pick_ids), metric)
        same = digests.get(fitted.digest)  # the search may end where it started: a menu config
        result[kind]["equals"] = same
        if progress:  # what the fit found, in one line (its trials each had one)
            output.log(
                f"{metric.task}: {kind} found {recipe(fitted.record, most=4)}: {metric.name} "
                f"{result[kind]['pick_value']:.4g} on the {len(pick_ids)} pick items"
                + (f", the menu's {same} itself" if same else "")
            )
    out = {"doc": result, "best": None, "found": [kind for kind, _, _ in found]}
    if best is not None:
        kind, c, method = best
        cand = Candidate.of(kind, c, steps)
        cand = Candidate(f"{kind}-{cand.digest}", cand.vector)  # named by the one digest of its vector
        rec = scorer.record(cand, report_ids)  # the finalist on the report items
        out["best"] = {
            "kind": kind,
            "candidate": cand,
            "method": method,
            "record": rec,
            "ingredients": result.get("soup", {}).get("ingredients"),
        }
        result["best"] = {
            "kind": kind,
            "run": cand.name,
            "pick_value": result[kind]["pick_value"],
            "coefficients": cand.record,
        }  # what verify holds a shipped fit to
    return out


def fit_search(
    scores,
    ingredients,
    pick_ids: list,
    fits,
    n: int,
    loss: bool,
    duel=race.duel,
    report_n=None,
    say=None,
    name_of=None,
):
    """The search itself on any `scores(c, ids, name)` (oriented per-item scores, higher is better):
    the engine's (ship) or a simulated world's (bench/bench_decide.py). `ingredients`: (name, c).
    `duel` decides each "does it improve" (race.duel; race.exhaustive: every pick item, as before).
    Returns (the search's document, the fits found as (kind, c, method), the best of them on every
    pick item or None)."""
    trials: list[dict] = []

    def better(kind: str):
        def compare(trial: list[float], incumbent: list[float]) -> bool:
            name = f"{kind}-{(name_of or _index_digest)(trial)}"
            if say is not None:
                say(kind, trial)
            won, used, diff = duel(
                lambda ids: scores(trial, ids, name),
                lambda ids: scores(incumbent, ids, name),
                pick_ids,
                report_n=report_n,
            )
            trials.append({"run": name, "pick_items": used, "better": won, "mean_item_difference": diff})
            return won

        return compare

    result: dict = {"candidates": trials, "pick_items": len(pick_ids), "race": RACE_NOTE}
    found = []
    if "soup" in fits:  # only the soup ranks ingredients: the simplex alone loads no earlier checkpoint
        # the order the soup tries them in, from the first RANK_ITEMS pick items (the menu's are scored
        # already; an earlier checkpoint is scored further only inside a soup that tries it); the
        # exhaustive design orders them on every pick item, as before
        first = pick_ids if duel is race.exhaustive else pick_ids[:RANK_ITEMS]
        scored = [(name, c, sum(scores(c, first, name))) for name, c in ingredients]
        names, c = fit.greedy_soup(scored, better("soup"))
        if len(names) > 1:  # a soup of one ingredient is that ingredient
            found.append(("soup", c, "soup"))
        result["soup"] = {"ingredients": names}
    if "simplex" in fits and loss and n > 2:
        k = min(SIMPLEX_K, n - 1)
        c, calls = fit.simplex_fit(k, n, better("simplex"))
        result["simplex"] = {"k": k, "trials": calls, "search": "coordinate search on softmax logits"}
        found.append(("simplex", c, f"simplex-k{k}"))
    best = max(found, key=lambda f: sum(scores(f[1], pick_ids, f[0])), default=None)  # the first of equals
    return result, found, best


def _index_digest(c: list[float]) -> str:
    """A vector's digest keyed by basis index (fit_search on a world with no steps)."""
    return digest({str(i): x for i, x in enumerate(c)})


def ingredients_of(
    menu: dict[str, list[float]], picked: set, steps: list[int]
) -> list[tuple[str, list[float]]]:
    """The soup's ingredients: the menu's configs evaluated at the step, vanilla, and the last
    SOUP_CHECKPOINTS saved checkpoints before it, each as (name, coefficient vector)."""
    n = len(steps) + 1
    out = [(run, menu[run]) for run in menu if run in picked] + [
        ("vanilla", [float(i == n - 1) for i in range(n)])
    ]
    for j in range(max(1, n - SOUP_CHECKPOINTS), n - 1):
        out.append((f"checkpoint-{steps[j - 1]}", [float(i == j) for i in range(n)]))
    return out


RACE_NOTE = (
    "each trial raced against the incumbent on the pick items, looking after 16, 32, 64, ... of them; "
    "stopped when an anytime-valid confidence sequence (Waudby-Smith et al. 2024) told them apart"
)
