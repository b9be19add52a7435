"""Every average bema computes as what it is: a coefficient vector over (theta0, the checkpoints).

The outputs are linear in the iterates, so the fused pass's own recurrences, run in float64 on a
basis (theta0 = e_0, theta_sj = e_j) instead of on weights, give each output's coefficients: what
every header records (io/provenance), what ship's candidates are (decide/candidate.py) and what
verify holds a model to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bema_cli.stabilize.plan import Plan


def coefficient_vectors(plan: Plan) -> dict[tuple[str, int], dict[str, float]]:
    """{(run, step): {"theta0": c0, "<step>": cj, ...}}: every output as the linear combination of
    (theta0, the checkpoints) it is, from the fused pass's own code (state_store.start_unit,
    state_store.step_updates, recurrence.update and recurrence.estimate) run in float64 on a basis (theta0 = e_0, theta_sj = e_j)
    over the whole trajectory: a call continued from a state replays its earlier steps here (the
    coefficients depend on the schedule and the steps only), so its outputs say what a one-shot
    run's say."""
    from dataclasses import replace

    import torch

    from bema_cli.recurrence import estimate, needs_drift, update
    from bema_cli.stabilize import state_store
    from bema_cli.stabilize.state_store import step_updates

    steps = sorted(plan.runs[0].events)
    fresh = [
        replace(t, start=None, source=None, ring_sources={}, last=steps[-1] if steps else t.last)
        for t in plan.tracks
    ]
    basis_plan = replace(plan, tracks=fresh, read_steps=steps)
    n = len(steps) + 1
    eye = torch.eye(n, dtype=torch.float64)
    theta0 = eye[0].clone()
    stabs = state_store.start_unit(basis_plan, [], theta0)
    track_of = {r.name: i for i, t in enumerate(fresh) for r in t.runs}
    tau, names = plan.runs[0].schedule.tau, ["theta0", *map(str, steps)]
    out = {}
    for j, step in enumerate(steps, start=1):
        th = eye[j]
        advancing, after = step_updates(basis_plan, stabs, step)
        if step <= tau:
            theta0.copy_(th)
        update(advancing, 0, n, th, theta0)
        for run in plan.runs:
            if step in run.out_steps:
                event = run.events[step]
                drift = th - theta0 if needs_drift(run.schedule, event) else None
                part = stabs[track_of[run.name]].view(0, n)
                result = estimate(part, run.schedule, event, th, drift, torch.empty(n, dtype=torch.float64))
                out[run.name, step] = {k: float(v) for k, v in zip(names, result.tolist(), strict=True) if v}
        update(after, 0, n, th)
    return out
