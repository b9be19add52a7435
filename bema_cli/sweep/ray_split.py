"""`bema sweep --executor ray`: the grid's states split across engine actors.

Each actor starts its own engine and walks every checkpoint itself, for its share of the
grid's distinct states (runs sharing a state stay together; vanilla and theta0 go with the
first share), with the local sweep's code (run.Walk), so its records are the local ones.
Only the driver writes results.jsonl, as each actor's records arrive.
"""

from __future__ import annotations

from dataclasses import replace

from bema_cli import output
from bema_cli.cluster import ExecutorOptions, ray_session, runtime_env, task_error
from bema_cli.eval.ray_pool import actor_resources, engine_env
from bema_cli.stabilize.plan import Options, Plan


class SweepActor:
    """One engine in a Ray actor; `run` is one share of the grid, walked from theta0."""

    def __init__(self, backend_name: str, engine):
        from bema_cli.eval.backends.vllm_backend import route_vllm_logs

        if backend_name == "vllm":
            route_vllm_logs(engine.log_file, engine.debug)
        self.backend_name, self.engine = backend_name, engine

    def run(self, stab: Options, jobs: list, folder_of: dict) -> tuple[list, dict]:
        from bema_cli.sweep.session import Walk
        from bema_cli.sweep.walk import plan_sweep

        results: list = []
        walk = Walk(self.backend_name, self.engine, stab, plan_sweep(stab), folder_of, jobs)
        try:
            walk.run(jobs, lambda records, samples: results.append((records, samples)))
        finally:
            walk.close()
        return results, walk.summary()


def shares(plan: Plan, workers: int) -> list[list[str]]:
    """Run names per actor: the distinct states dealt round-robin (a state's runs stay together)."""
    out: list[list[str]] = [[] for _ in range(min(workers, max(1, len(plan.tracks))))]
    for i, track in enumerate(plan.tracks):
        out[i % len(out)] += [r.name for r in track.runs]
    return out


def run_split(
    plan: Plan, stab: Options, evaluation, jobs: list, folder_of: dict, executor: ExecutorOptions
) -> dict:
    groups = shares(plan, executor.workers)
    schedule = {r.name: r.schedule for r in plan.runs}
    work = []
    for i, names in enumerate(groups):
        mine = [j for j in jobs if j.target.run in names or (i == 0 and j.target.run in ("vanilla", "base"))]
        if mine:
            work.append((replace(stab, schedules=[schedule[n] for n in names]), mine))
    evaluated, starts, motion_sums = 0, 0, {}
    with ray_session(executor) as ray:
        res = actor_resources(ray, len(work), evaluation.engine)
        env = engine_env(ray, res, len(work), evaluation.backend_name)
        actor_class = ray.remote(SweepActor)
        opts = {**res, "max_restarts": 0, "runtime_env": runtime_env(env)}
        actors = [
            actor_class.options(name=f"bema-sweep-{i}", **opts).remote(
                evaluation.backend_name, evaluation.engine
            )
            for i in range(len(work))
        ]
        output.log(f"sweeping {len(plan.runs)} config(s) on {len(actors)} Ray engine actor(s)")
        running = {a.run.remote(s, j, folder_of): a for a, (s, j) in zip(actors, work, strict=True)}
        try:
            while running:
                done, _ = ray.wait(list(running), num_returns=1)
                running.pop(done[0])
                try:
                    results, summary = ray.get(done[0])
                except Exception as exc:
                    raise task_error(exc, "sweeping on a Ray engine actor") from None
                for records, samples in results:
                    evaluation.write(records, samples)
                evaluated += summary["evaluated"]
                starts += summary["engine_starts"]
                # every actor walks every step; one whose share never reads theta0 (windows alone)
                # does not measure the first: the most complete
                motion_sums = max(motion_sums, summary["motion_sums"], key=len)
        finally:
            for actor in actors:
                ray.kill(actor)
    return {
        "evaluated": evaluated,
        "engine_starts": starts,
        "actors": len(actors),
        "motion_sums": motion_sums,
    }
