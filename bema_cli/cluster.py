"""Where the work runs: in this process (`local`) or on a Ray cluster (`ray`), for stabilize and eval.

Ray is an optional extra, imported only when `--executor ray` is chosen. `ray_session`
joins the cluster at `--ray-address` (default: $RAY_ADDRESS), else starts a local one in
this process and shuts it down afterwards. See docs/scale-out.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bema_cli import signals
from bema_cli.errors import BemaError, UsageError

EXECUTORS = ("local", "ray")
INSTALL_HINT = "pip install ray, or from a bema checkout: pip install '.[ray]'"
# A local Ray reserves shared memory for its object store (30% of RAM by default); bema ships
# only plans and results through it, so a small store leaves the memory to the work.
LOCAL_OBJECT_STORE = 256 * 2**20


# Ray starts its worker processes at niceness 15 (measured here), so on a busy node bema's work
# would yield to every other process; a local run has niceness 0, and so do bema's workers.
WORKER_ENV = {"RAY_worker_niceness": "0"}


def runtime_env(env: dict[str, str] | None = None) -> dict:
    """The runtime_env of every bema task and actor: WORKER_ENV plus `env`."""
    return {"env_vars": {**WORKER_ENV, **(env or {})}}


@dataclass(frozen=True)
class ExecutorOptions:
    """`--executor`, `--workers`, `--ray-address` (shared by `bema stabilize` and `bema eval`)."""

    executor: str = "local"
    workers: int = 1
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise UsageError(f"--executor: choose local or ray, got {self.executor!r}")
        if self.workers < 1:
            raise UsageError(f"--workers: must be at least 1, got {self.workers}")
        if self.executor == "local" and self.workers > 1:
            raise UsageError("--workers: more than one worker needs --executor ray")
        if self.executor == "local" and self.ray_address:
            raise UsageError("--ray-address: only used with --executor ray")


def import_ray():
    """The `ray` module, or a one-line UsageError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"--executor ray: Ray is not installed (install it with: {INSTALL_HINT})") from None
    return ray


@contextmanager
def ray_session(opts: ExecutorOptions, quiet: bool = False) -> Iterator:
    """Connect to (or start) a Ray cluster for the duration of one command; yields the ray module."""
    ray = import_ray()
    if ray.is_initialized():  # a caller (a test, a notebook) already connected: use that cluster
        yield ray
        return
    address = opts.ray_address or os.environ.get("RAY_ADDRESS") or None
    kwargs = {"log_to_driver": False, "include_dashboard": False, "logging_level": logging.WARNING}
    try:
        with signals.kept():  # SIGTERM stays ours: exit 143 with the temp folder removed, as locally
            if address:
                ray.init(address=address, **kwargs)
            else:
                # "local": a new instance even when `ray start` left one on this machine (`--ray-address auto` joins it)
                ray.init(address="local", object_store_memory=LOCAL_OBJECT_STORE, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local Ray instance"
        hint = ""
        if (
            address and "RAY_AUTH_MODE" not in os.environ
        ):  # Ray enables auth only for clusters it finds itself
            hint = "; a cluster with token authentication also needs RAY_AUTH_MODE=token and its ~/.ray/auth_token"
        raise BemaError(f"--executor ray: cannot start or reach {where} ({exc}){hint}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def cluster_cpus(ray) -> tuple[float, float]:
    """(CPUs of the whole cluster, CPUs of its largest node)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return sum(n.get("CPU", 0) for n in nodes), max((n.get("CPU", 0) for n in nodes), default=0)


def task_error(exc: BaseException, what: str) -> BaseException:
    """The error a failed Ray task should surface as: a BemaError raised in the task as itself,
    anything else (a lost worker after its retries, a bug) as one line naming `what`."""
    ray = import_ray()
    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    if isinstance(cause, BemaError):
        return cause
    if cause is not None:
        return BemaError(f"{what} failed on a Ray worker: {type(cause).__name__}: {cause}")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return BemaError(f"{what} failed on Ray: {first}")
