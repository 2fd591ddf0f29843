"""Starting and stopping the Ray cluster the controller talks to, and running the controller's event loop."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import ray

__all__ = ["init", "shutdown", "run"]

T = TypeVar("T")

# Set before Ray starts, in this process and (through the runtime env) in every worker.
_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false",
        # Ray starts workers at nice 15; ours do the job's compute, so they run at the controller's priority.
        "RAY_worker_niceness": "0"}


def init(address: str | None = None, *, num_cpus: float | None = None, num_gpus: int | None = None,
         **ray_kwargs: Any) -> dict[str, Any]:
    """Connect to Ray: a private local cluster on loopback unless ``address`` names one. Idempotent.

    Workers inherit this process's import path, so Worker classes defined in your scripts and tests import there.
    Returns the cluster's resources.
    """
    if ray.is_initialized():
        return ray.cluster_resources()
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    cwd = os.getcwd()
    if cwd not in paths:
        paths.insert(0, cwd)
    env_vars = {**_ENV, "PYTHONPATH": os.pathsep.join(paths)}
    runtime_env = dict(ray_kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**env_vars, **runtime_env.get("env_vars", {})}
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "runtime_env": runtime_env}
    kwargs.update(ray_kwargs)
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
    else:
        ray.init(address=address, **kwargs)
    return ray.cluster_resources()


def shutdown() -> None:
    """Disconnect from (and, if it was started by ``init``, stop) the Ray cluster."""
    if ray.is_initialized():
        ray.shutdown()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run the controller coroutine on uvloop when it is installed (plain asyncio otherwise)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main)
    return uvloop.run(main)
