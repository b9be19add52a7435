"""Executors of `bema stabilize`'s work units: in this process, or one Ray task per unit.

Both run the same `unit.process_unit`, so outputs are bitwise identical whichever runs
them. A Ray task reads its unit's slices from the shared filesystem and writes its bytes
into the files the driver pre-created; it is idempotent, so Ray may retry it on a lost
worker (`max_retries`). See docs/scale-out.md.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bema_cli.cluster import ExecutorOptions, cluster_cpus, ray_session, runtime_env, task_error
from bema_cli.errors import UsageError
from bema_cli.stabilize import motion
from bema_cli.stabilize.plan import Options, Plan
from bema_cli.stabilize.unit import Outputs, process_unit, unit_bytes
from bema_cli.stabilize.workspace import Workspace, compute_threads

CANCEL_GRACE_S = 10  # seconds in-flight units get to finish when a run stops
RETRIES = 3  # Ray re-runs a unit whose worker died this many times (safe: units are idempotent)


def run_units(
    plan: Plan, opts: Options, outputs: Outputs, executor: ExecutorOptions, advance: Callable[[int], None]
) -> dict:
    """Run every unit of `plan` into `outputs`; `advance(bytes)` after each unit (progress). Returns
    the units' motion sums, merged (motion.py)."""
    if executor.executor == "ray":
        return _run_ray(plan, opts, outputs, executor, advance)
    ws = Workspace.for_plan(plan, opts)  # one set of buffers for every unit
    # the walk makes ~10^5 short-lived tensor views and no reference cycles; the collections they would
    # trigger each traverse torch's ~10^5 long-lived objects (~2% of a run's CPU, measured): off meanwhile
    enabled = gc.isenabled()
    gc.disable()
    sums: dict = {}
    try:
        with compute_threads(ws), ws.batch():
            for unit in plan.units:
                motion.merge(sums, process_unit(plan, opts, unit, outputs, ws))
                advance(unit_bytes(unit))
    finally:
        ws.close()
        if enabled:
            gc.enable()
    return sums


@contextmanager
def session(executor: ExecutorOptions) -> Iterator[None]:
    """Hold the Ray cluster for a whole command and start its workers early: a fresh Ray worker
    spends seconds importing torch, which then overlaps the driver's own imports and planning."""
    if executor.executor != "ray":
        yield
        return
    with ray_session(executor) as ray:
        # the units' CPU share and runtime_env: a unit submitted while a warm-up still runs waits
        # for its worker to be free (and warm) instead of starting a cold one
        cpus = _cpus_per_worker(ray, executor.workers)
        warm = ray.remote(_warm_up).options(num_cpus=cpus, runtime_env=runtime_env())
        for _ in range(executor.workers):
            warm.remote()
        yield


def _warm_up() -> None:
    import torch  # noqa: F401

    import bema_cli.stabilize.unit  # noqa: F401  (the module a unit task runs, and safetensors with it)


def _ray_unit(plan: Plan, opts: Options, index: int, outputs: Outputs, threads: int) -> dict:
    """One Ray task: unit `index` of `plan`, on this worker's share of the cores; its motion sums."""
    ws = _workspace(plan, opts)
    with compute_threads(ws, threads), ws.batch():
        return process_unit(plan, opts, plan.units[index], outputs, ws)


_cached: list[Workspace] = []  # this worker process's buffers (Ray workers live as long as the command)


def _workspace(plan: Plan, opts: Options) -> Workspace:
    """One Workspace per worker process, reused by every unit it runs, as the local executor
    reuses one (fresh buffers per unit would pay their page faults again)."""
    ws = Workspace.for_plan(plan, opts)
    old = _cached[0] if _cached else None
    if old is None or (old.size, old.acc, old.device) != (ws.size, ws.acc, ws.device):
        if old is not None:
            old.close()
        _cached[:] = [ws]
    return _cached[0]


def _cpus_per_worker(ray, workers: int) -> int:
    total, largest = cluster_cpus(ray)
    return max(1, min(int(largest), int(total // workers)))


def _resources(ray, plan: Plan, opts: Options, workers: int) -> dict:
    """What each task reserves: an equal share of the cluster's cores (at most one node's), one GPU
    when the cluster has GPUs and --device allows them, and --max-memory of the node's memory."""
    cpus = _cpus_per_worker(ray, workers)
    gpus = 1 if opts.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    if opts.device == "cuda" and not gpus:
        raise UsageError("--device cuda: the Ray cluster has no GPU")
    memory = max((n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0)
    if opts.max_memory > memory:
        raise UsageError(
            f"--max-memory: {opts.max_memory} bytes per worker, but the largest Ray node offers {int(memory)}"
        )
    return {"num_cpus": cpus, "num_gpus": gpus, "memory": opts.max_memory}


def _run_ray(
    plan: Plan, opts: Options, outputs: Outputs, executor: ExecutorOptions, advance: Callable[[int], None]
) -> dict:
    """At most `workers` unit tasks in flight; each finished one frees a slot for the next."""
    with ray_session(executor) as ray:
        res = _resources(ray, plan, opts, executor.workers)
        task = ray.remote(_ray_unit).options(max_retries=RETRIES, runtime_env=runtime_env(), **res)
        plan_ref, outputs_ref = ray.put(plan), ray.put(outputs)  # shipped once, shared by every task
        todo = list(range(len(plan.units)))[::-1]
        running: dict = {}
        sums: dict = {}
        try:
            while todo or running:
                while todo and len(running) < executor.workers:
                    i = todo.pop()
                    running[task.remote(plan_ref, opts, i, outputs_ref, int(res["num_cpus"]))] = i
                done, _ = ray.wait(list(running), num_returns=1)
                i = running.pop(done[0])
                try:
                    motion.merge(sums, ray.get(done[0]))
                except Exception as exc:
                    raise task_error(exc, f"work unit {i + 1} of {len(plan.units)}") from None
                advance(unit_bytes(plan.units[i]))
        finally:
            # after an error or a signal the temp folder goes, so its writers must stop first. Units are
            # short: let those in flight end, then cancel the stragglers (force-cancelling a task whose
            # reply is arriving crashes Ray's core worker: "Tried to complete task that was not pending")
            if running:
                _, late = ray.wait(list(running), num_returns=len(running), timeout=CANCEL_GRACE_S)
                for ref in late:
                    ray.cancel(ref, force=True)
    return sums
