"""A candidate of `bema ship`: a name and the coefficient vector it is over (theta0, the run's steps).

Every average bema computes is linear in the iterates: at step S it is sum_j c_j theta_j over theta0
and the checkpoints up to S (sum c = 1). A menu config (ema, bema, lawa, ...), vanilla (a unit
vector), a window and a fitted average (soup, simplex) are all such a vector, so they are one type:
one digest identifies a vector whatever its name, equal vectors are one candidate (scored once),
and one record shape names it, the vector keyed by "theta0" and each step (zeros left out).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

THETA0 = "theta0"
# Weight on theta0 above this (either sign) is what makes an average lag the run, said beside the
# numbers: docs/math.md's table has the EMA at ~78% theta0 after 10 checkpoints 400 steps apart.
THETA0_NOTE = 0.05
KAPPA_METHODS = ("ema", "bema", "dema", "ouema")  # whose decay --kappa sets


@dataclass(frozen=True)
class Candidate:
    name: str
    vector: tuple[tuple[str, float], ...]  # (key, c) in basis order: "theta0", then steps; no zeros

    @classmethod
    def of(cls, name: str, c: Sequence[float], steps: Sequence[int]) -> Candidate:
        """From a coefficient list over (theta0, *steps)."""
        keys = [THETA0, *map(str, steps)]
        return cls(name, tuple((k, float(x)) for k, x in zip(keys, c, strict=True) if x))

    @classmethod
    def keyed(cls, name: str, record: dict[str, float]) -> Candidate:
        """From the record shape {"theta0": c0, "<step>": c_j} (any order: theta0, then by step)."""
        order = sorted(record, key=lambda k: (k != THETA0, int(k) if k != THETA0 else 0))
        return cls(name, tuple((k, float(record[k])) for k in order if record[k]))

    @property
    def record(self) -> dict[str, float]:
        return dict(self.vector)

    @property
    def digest(self) -> str:
        return digest(self.record)

    def coefficients(self, steps: Sequence[int]) -> list[float]:
        """The vector as a list over (theta0, *steps)."""
        got = self.record
        unknown = set(got) - {THETA0, *map(str, steps)}
        if unknown:
            raise ValueError(f"{self.name}: coefficients on steps outside the basis ({sorted(unknown)[:3]})")
        return [got.get(k, 0.0) for k in (THETA0, *map(str, steps))]

    def steps(self) -> list[int]:
        """The checkpoints' steps with a non-zero weight, in order."""
        return [int(k) for k, _ in self.vector if k != THETA0]


def digest(record: dict[str, float]) -> str:
    """One vector's identity: its non-zero coefficients by key, rounded at 1e-12."""
    items = sorted((k, round(float(v), 12)) for k, v in record.items() if round(float(v), 12))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:10]


def vanilla(step: int) -> Candidate:
    return Candidate("vanilla", ((str(step), 1.0),))


def menu(plan, step: int) -> dict[str, Candidate]:
    """Vanilla and each config of the plan evaluated at `step` (those its cadence does not skip), as
    their vectors: computed by the stabilize pass's own update in float64 on a basis
    (stabilize.vectors.coefficient_vectors), the same code that writes them into every output's header."""
    from dataclasses import replace

    from bema_cli.stabilize.vectors import coefficient_vectors

    runs = [replace(r, out_steps=[step]) for r in plan.runs if r.events[step].action != "skip"]
    vectors = coefficient_vectors(replace(plan, runs=runs)) if runs else {}
    return {"vanilla": vanilla(step)} | {r.name: Candidate.keyed(r.name, vectors[r.name, step]) for r in runs}


def record_options(settings: dict, source: Path, out: Path | None, base: str | None, **more):
    """The stabilize options a record's settings (method, hyperparameters, accumulation dtype, gaps
    allowed) describe on the run of checkpoint `source`: the one mapping from a record to a run,
    for its vector (`of_settings`), verify's walk and verify's rebuild. `out`: where verify's
    rebuild writes (its `write`: stabilize.Output); None for a plan that writes nothing."""
    from bema_cli.io.checkpoints import run_of
    from bema_cli.schedule import Schedule
    from bema_cli.stabilize import Options

    return Options(
        checkpoint_dir=str(run_of(source)),
        schedules=[Schedule.from_record(settings).resolved()],
        out=None if out is None else str(out),
        base=base,
        accum_dtype=settings.get("accum_dtype", "float32"),
        allow_gaps=bool(settings.get("allow_gaps")),
        **more,
    )


def of_settings(
    name: str, settings: dict, source: Path, base: str | None, step: int, allow_gaps: bool = False
):
    """A config named by its record (`settings`: method and hyperparameters) at checkpoint `source`'s
    `step` of its run: (its Candidate, the folders of its basis keyed as the vector is, theta0's
    source), computed as ship's menu is (`menu` on the run's plan). Vanilla needs no plan."""
    from bema_cli.sweep.walk import plan_sweep

    if settings.get("method", "vanilla") == "vanilla":
        return Candidate(name, vanilla(step).vector), {str(step): Path(source)}, base or "first"

    opts = record_options({**settings, "allow_gaps": allow_gaps}, source, None, base)
    plan = plan_sweep(opts)
    (cand,) = [c for key, c in menu(plan, step).items() if key != "vanilla"]
    folders = {THETA0: plan.base_index.folder, **{str(c.step): c.path for c in plan.checkpoints}}
    return Candidate(name, cand.vector), folders, plan.base_source


def lag_notes(plan, menu: dict[str, Candidate], step: int) -> list[str]:
    """Why an average may lose to the last checkpoint, read off its vector: the weight it still puts
    on theta0 (an EMA over few checkpoints), or a window wider than the checkpoints there are."""
    from bema_cli.schedule import last_members

    out = []
    saved = sum(1 for c in plan.checkpoints if c.step <= step)
    for run in plan.runs:
        cand = menu.get(run.name)
        if cand is None:
            continue
        c0 = cand.record.get(THETA0, 0.0)
        window = run.schedule.window
        lever = (
            "save more often or lower --kappa" if run.schedule.method in KAPPA_METHODS else "save more often"
        )
        if c0 >= THETA0_NOTE:
            out.append(
                f"{run.name} still weighs theta0 at {c0:.3g} at step {step}: with {saved} checkpoints, {lever}"
            )
        elif c0 <= -THETA0_NOTE:  # BEMA's correction overshoots: it extrapolates away from theta0
            out.append(
                f"{run.name} weighs theta0 at {c0:.3g} at step {step}: its bias correction extrapolates past "
                f"the last checkpoint; with {saved} checkpoints, {lever}"
            )
        members = len(last_members(run.events, step, window)) if window else 0
        if window and members < window:
            out.append(
                f"{run.name} averages {members} checkpoints, not {window}: the run has {saved} up to "
                f"step {step}"
            )
    return out
