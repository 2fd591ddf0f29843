"""Starting and stopping the Ray cluster the controller talks to, and running the controller's event loop.

A private local cluster (``orc.init()`` without an address) listens on loopback where Ray allows it (node IP
127.0.0.1) and always has Ray's token authentication on: Ray still binds some gRPC servers to every interface, so
the token is what keeps other hosts out. ``orc.shutdown()`` first closes every group (calls in flight fail with
``GroupClosedError``), then stops Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

import ray

from . import _backend, _replies

__all__ = ["init", "shutdown", "run", "register"]

T = TypeVar("T")
log = logging.getLogger("orchestra")

# Set before Ray starts, in this process and (through the runtime env) in every worker.
_ENV = {"RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false",
        # Ray starts workers at nice 15; ours do the job's compute, so they run at the controller's priority.
        "RAY_worker_niceness": "0"}

_groups: weakref.WeakSet = weakref.WeakSet()  # every group's shared state, closed by shutdown()


def register(group: Any) -> None:
    """Track a group so that ``shutdown()`` can close it (its calls in flight then fail at once)."""
    _groups.add(group)


class _Session:
    """What ``init`` returns: the cluster's resources, and a context manager that calls ``shutdown`` at exit."""

    def __init__(self, resources: dict[str, Any]) -> None:
        self.resources = resources

    def __getitem__(self, key: str) -> Any:
        return self.resources[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.resources.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.resources

    def __repr__(self) -> str:
        return f"orchestra session {self.resources}"

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        shutdown()

    async def __aenter__(self) -> _Session:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        shutdown()


def init(address: str | None = None, *, num_cpus: float | None = None, num_gpus: int | None = None,
         backend: str = "ray", **ray_kwargs: Any) -> _Session:
    """Connect to Ray: a private local cluster on loopback, with token authentication, unless ``address`` names
    one (``"local"``, Ray's name for a new local cluster, is the private one too). Idempotent. Use as ``with orc.init(): ...`` to shut down at exit.

    ``backend="local"`` starts no cluster: every rank of every group made afterwards runs in this process
    (threads; see ``orchestra._local``) with the same call semantics — for tests that run in seconds and for
    ``breakpoint()`` inside an endpoint. ``num_cpus`` (default: this machine's) is what its pools reserve from.

    Workers of a local cluster inherit this process's import path, so Worker classes defined in your scripts and
    tests import there. With an ``address``, Ray's ``runtime_env`` ships the code instead: the current directory
    as ``working_dir`` and the ``orchestra`` / ``engines`` / ``pipelines`` packages as ``py_modules`` (pass your
    own ``runtime_env`` keys to change either). Returns the session (``session["CPU"]`` etc. are the cluster's resources).
    """
    if backend == "local":
        if address is not None or ray_kwargs:
            raise ValueError(f"orc.init(backend='local') starts no cluster; it takes num_cpus and num_gpus only, got "
                             f"{'address, ' if address is not None else ''}{sorted(ray_kwargs)}")
        current = _backend.current()
        if current.name != "local":
            from ._local import LocalBackend

            current = LocalBackend(num_cpus=num_cpus, num_gpus=num_gpus)
            _backend.register(current)
            _backend.set_current(current)
        else:
            _warn_not_taken(current.resources(), num_cpus, num_gpus, "the in-process backend")
        return _Session(current.resources())
    if backend != "ray":
        raise ValueError(f"orc.init(backend={backend!r}): choose 'ray' (default) or 'local'")
    if _backend.current().name != "ray":  # back from the in-process backend: new pools use Ray
        _backend.set_current(None)
    if ray.is_initialized():
        resources = ray.cluster_resources()
        _warn_not_taken(resources, num_cpus, num_gpus, "the Ray cluster", ray_kwargs)
        return _Session(resources)
    if address == "local":  # Ray's own name for "start a new local cluster" (RAY_ADDRESS=local): ours, on loopback
        address = None
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    env_vars = dict(_ENV)
    runtime_env = dict(ray_kwargs.pop("runtime_env", None) or {})
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address is None:
        # Left unset, Ray turns token authentication on for a new local cluster and writes ~/.ray/auth_token.
        if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
            log.warning("RAY_AUTH_MODE=%s: Ray's token authentication is OFF; Ray binds some servers to every "
                        "interface, so anyone who can reach this machine can run code in the cluster",
                        os.environ["RAY_AUTH_MODE"])
        _loopback_only(True)
    cwd = os.getcwd()
    if address is None:  # a local cluster: workers share this machine's files and import what the driver imports
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        if cwd not in paths:
            paths.insert(0, cwd)
        env_vars["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        # another machine's paths mean nothing there: Ray uploads the code instead. The working directory (the
        # user's scripts and Worker classes; .gitignore'd files skipped) and the project's packages.
        runtime_env.setdefault("working_dir", cwd)
        runtime_env.setdefault("excludes", [".git", "__pycache__", "*.pyc"])
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        work = os.path.abspath(runtime_env["working_dir"]) if isinstance(runtime_env["working_dir"], str) else None
        mods = [os.path.join(here, m) for m in ("orchestra", "engines", "pipelines")
                if os.path.isfile(os.path.join(here, m, "__init__.py"))]
        mods = [m for m in mods if work is None or os.path.commonpath([m, work]) != work]  # not shipped twice
        runtime_env["py_modules"] = [*runtime_env.get("py_modules", []), *mods]
        if not runtime_env["py_modules"]:
            del runtime_env["py_modules"]
    runtime_env["env_vars"] = {**env_vars, **runtime_env.get("env_vars", {})}
    kwargs["runtime_env"] = runtime_env
    kwargs.update(ray_kwargs)
    if address is None:
        try:
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
        except BaseException:
            _loopback_only(False)
            raise
    else:
        ray.init(address=address, **kwargs)
    return _Session(ray.cluster_resources())


def runs_elsewhere(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is running, and not in this thread (so its objects must be touched from its own thread)."""
    if loop.is_closed() or not loop.is_running():
        return False
    try:
        return asyncio.get_running_loop() is not loop
    except RuntimeError:  # no loop runs in this thread
        return True


def _warn_not_taken(resources: dict[str, Any], num_cpus: float | None, num_gpus: int | None, what: str,
                    ray_kwargs: dict[str, Any] | None = None) -> None:
    """``init`` again while ``what`` runs: say which of the settings given differ from it and are not taken."""
    differ = [f"{k}={v!r} (it has {resources.get(r, 0):g})" for k, r, v in (("num_cpus", "CPU", num_cpus),
                                                                           ("num_gpus", "GPU", num_gpus))
              if v is not None and float(v) != float(resources.get(r, 0))]
    differ += [f"{k}={v!r}" for k, v in (ray_kwargs or {}).items()]  # (what Ray was started with is not known here)
    if differ:
        log.warning("orc.init: %s already runs here, so %s is not taken; call orc.shutdown() first to start it "
                    "with other settings", what, ", ".join(differ))


def shutdown() -> None:
    """Close every group (their calls in flight fail with ``GroupClosedError``), then disconnect from (and, if
    ``init`` started it, stop) the Ray cluster; the in-process backend ends too.

    Groups live on the event loop they are used from: while a group's loop runs in another thread, this refuses
    (RuntimeError naming the groups, nothing changed); end those groups on their loop first (``aclose()``)."""
    groups = list(_groups)
    elsewhere = [g.name for g in groups if g.closed is None and (loop := g.home_loop()) is not None
                 and runs_elsewhere(loop)]
    if elsewhere:
        raise RuntimeError(f"orc.shutdown() was called in thread {threading.current_thread().name!r}, but group(s) "
                           f"{elsewhere} live on an event loop running in another thread; nothing was changed. Close "
                           f"them on that loop first: asyncio.run_coroutine_threadsafe(group.aclose(), loop).result()")
    for g in groups:
        if not g.pool.backend.own_process:  # in-process ranks have no cluster to end them: stop their threads
            rest = g.end("orchestra was shut down")
            if rest is not None:
                rest()
        else:  # Ray ranks and reservations end with the cluster (or this job's connection to it) below
            g.close("orchestra was shut down")
            g.forget_pool()
    _groups.clear()
    _backend.end_session()  # a pool made until now is refused from here on (what it reserved ended here)
    _backend.unregister("local")
    _backend.set_current(None)
    if ray.is_initialized():
        if not _replies.quiesce():
            log.warning("orchestra: a reply thread was still waiting on Ray at shutdown")
        ray.shutdown()
    _replies.stop()
    _loopback_only(False)


_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_saved_env: list[str | None] = []


def _loopback_only(on: bool) -> None:
    """Make Ray's single-machine mode (node IP 127.0.0.1) apply to the local cluster started next, and undo it.

    Ray replaces a ``_node_ip_address`` of 127.0.0.1 by the machine's address unless clusters are disabled, which
    is its own switch for single-machine use; it is read from the environment by the processes Ray starts and
    from ``ray_constants`` in this one.
    """
    from ray._private import ray_constants

    if on:
        _saved_env.append(os.environ.get(_LOOPBACK_ENV))
        os.environ[_LOOPBACK_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    elif _saved_env:
        old = _saved_env.pop()
        if old is None:
            os.environ.pop(_LOOPBACK_ENV, None)
        else:
            os.environ[_LOOPBACK_ENV] = old
        ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(_LOOPBACK_ENV, not ray_constants.IS_WINDOWS_OR_OSX)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run the controller coroutine on uvloop when it is installed (plain asyncio otherwise)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main)
    return uvloop.run(main)
