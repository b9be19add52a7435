"""`bema eval --executor ray`: a pool of N engine actors; the checkpoints are the work queue.

Each actor starts its backend (a vLLM engine, or transformers) once, on its first
checkpoint, and swaps weights in place for every next one, exactly as the local executor
does. A checkpoint's whole evaluation (`job.run_job`: all its tasks) runs on one actor,
so its batches, and therefore its numbers, are the local executor's. Only the driver writes
results.jsonl, as each checkpoint's records arrive, so resuming works as for a local run.
An actor that dies (a lost node, an OOM kill, `ray.kill`) is replaced by a fresh one and its
checkpoint goes back to the front of the queue. See docs/scale-out.md.
"""

from __future__ import annotations

import os
from collections import deque

from bema_cli import output
from bema_cli.cluster import ExecutorOptions, cluster_cpus, ray_session, runtime_env, task_error
from bema_cli.errors import BackendError, UsageError
from bema_cli.eval.backends.base import EngineOptions
from bema_cli.eval.backends.vllm_engine import KV_ENV  # vLLM-CPU's KV cache size, in GiB

REQUEUES = 2  # a checkpoint whose actor dies this many more times is an error, not a loop
ENV_PREFIXES = ("VLLM_", "HF_", "TOKENIZERS_")  # engine settings the actors must share
KV_SHARE = (
    0.5  # of a CPU node's memory, for all its engines' KV caches: weights and activations need the rest
)


class EngineActor:
    """One engine in a Ray actor; `run` is one checkpoint's whole evaluation there."""

    def __init__(self, backend_name: str, engine: EngineOptions):
        from bema_cli.eval.backends.vllm_backend import route_vllm_logs

        if backend_name == "vllm":
            route_vllm_logs(engine.log_file, engine.debug)  # before vLLM is imported in this process
        self.backend_name, self.engine, self.backend = backend_name, engine, None

    def run(self, job) -> list[tuple[list[dict], list[dict]]]:
        from bema_cli.eval.backends.base import make_backend
        from bema_cli.eval.job import run_job

        if self.backend is None:
            self.backend = make_backend(self.backend_name, self.engine)
        return list(run_job(self.backend, job))


def actor_resources(ray, workers: int, engine: EngineOptions) -> dict:
    """An equal share of the cluster's cores (fractional: two engines fit on 2 cores, none spans
    nodes), and --tensor-parallel-size GPUs each when the cluster has GPUs."""
    total, largest = cluster_cpus(ray)
    gpus = engine.tensor_parallel_size if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    cpus = min(largest, total / workers)
    if cpus <= 0:
        raise UsageError("--executor ray: the Ray cluster has no CPU to run an engine on")
    return {"num_cpus": cpus, "num_gpus": gpus}


def cpu_kv_cache_env(node_memory: float, actors_on_node: int, environ: dict[str, str]) -> dict[str, str]:
    """VLLM_CPU_KVCACHE_SPACE (GiB) for each engine on a CPU node: KV_SHARE of the node's Ray memory
    split between the engines on it. Left alone when the user set it. Without it, vLLM-CPU sizes each
    engine's cache from --gpu-memory-utilization of the whole node's RAM, so two engines on one node ask
    for more than it has and are killed for memory (two engines on a 24 GB node were)."""
    if environ.get(KV_ENV, "").strip():
        return {}
    gib = int(KV_SHARE * node_memory / max(1, actors_on_node) // 2**30)
    return {KV_ENV: str(max(1, gib))}


def actors_per_node(node_cpus: float, cpus_per_actor: float, workers: int) -> int:
    """How many engine actors Ray can place on one node of `node_cpus` cores."""
    return max(1, min(workers, int(node_cpus / cpus_per_actor + 1e-9)))


def engine_env(ray, res: dict, engines: int, backend_name: str) -> dict[str, str]:
    """The environment engine actors share (VLLM_*, HF_*, TOKENIZERS_*), with each CPU vLLM engine's
    KV cache sized for the engines that fit on one node (a GPU engine has its GPU(s) alone)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    if backend_name == "vllm" and not res["num_gpus"]:
        _, largest = cluster_cpus(ray)
        node = max((n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0)
        sized = cpu_kv_cache_env(node, actors_per_node(largest, res["num_cpus"], engines), env)
        if sized:
            output.log(f"each engine's KV cache: {sized[KV_ENV]} GiB ({KV_ENV}; set it to choose another)")
        env.update(sized)
    return env


def run_pool(evaluation, jobs: list, executor: ExecutorOptions) -> None:
    """Run `jobs` (one per checkpoint) on a pool of engine actors; the driver writes every record."""
    if not jobs:
        return
    with ray_session(executor) as ray:
        res = actor_resources(ray, executor.workers, evaluation.engine)
        env = engine_env(ray, res, executor.workers, evaluation.backend_name)
        actor_class = ray.remote(EngineActor)
        opts = {**res, "max_restarts": 0, "runtime_env": runtime_env(env)}

        started = iter(range(1 << 30))

        def start():  # named, so `ray list actors` (and a test) can find the engines
            name = f"bema-engine-{next(started)}"
            return actor_class.options(name=name, **opts).remote(evaluation.backend_name, evaluation.engine)

        queue = deque(jobs)
        idle = [start() for _ in range(min(executor.workers, len(jobs)))]
        running: dict = {}  # result ref -> (actor, job)
        lost: dict[int, int] = {}  # id(job) -> times its actor died under it
        output.log(f"evaluating {len(jobs)} checkpoint(s) on {len(idle)} Ray engine actor(s)")
        try:
            with output.progress() as bar:
                task = bar.add_task("evaluating", total=len(jobs))
                while queue or running:
                    while queue and idle:
                        actor, job = idle.pop(), queue.popleft()
                        running[actor.run.remote(job)] = (actor, job)
                    done, _ = ray.wait(list(running), num_returns=1)
                    actor, job = running.pop(done[0])
                    try:
                        results = ray.get(done[0])
                    except ray.exceptions.RayActorError:  # the actor died: a fresh one, the job requeued
                        lost[id(job)] = lost.get(id(job), 0) + 1
                        if lost[id(job)] > REQUEUES:
                            raise BackendError(
                                f"{job.target.path}: its engine actor died {lost[id(job)]} times; giving up"
                            ) from None
                        output.warn(f"engine actor lost while evaluating {job.target.label}; requeued")
                        queue.appendleft(job)
                        idle.append(start())
                        continue
                    except Exception as exc:
                        raise task_error(exc, f"evaluating {job.target.path}") from None
                    for records, samples in results:
                        evaluation.write(records, samples)
                    bar.advance(task)
                    idle.append(actor)
        finally:
            for actor in idle + [a for a, _ in running.values()]:
                ray.kill(actor)
