"""torch.distributed helpers shared by the engines, their tests and benchmarks.

- :func:`init_distributed` joins (or creates) the default process group from the usual env vars
  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), picking gloo on CPU and nccl on CUDA.
- :func:`spawn` runs a function on N local ranks with ``torch.multiprocessing`` and returns the
  per-rank results (through ``torch.save`` files in a private temporary directory, so tensors survive the
  child's exit; read back with ``weights_only=True``, which loads tensors and plain containers and never runs
  code, whoever wrote the file). Ranks are forked from a fork server that imported torch, transformers and the
  engines once (:data:`PRELOAD`), so a spawn costs no interpreter start-up and no imports per rank.
"""

from __future__ import annotations

import faulthandler
import ipaddress
import logging
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("orchestra")

__all__ = ["default_device", "init_distributed", "failed_ranks", "free_port", "rendezvous_store", "spawn", "PRELOAD",
           "VOLATILE_ENV", "PORT_TRIES"]

#: what the fork server imports once, so that ranks forked from it do not (``__main__`` is multiprocessing's default)
PRELOAD = ("__main__", "engines._dist", "engines.fsdp", "engines.models")
_server_lock = threading.Lock()
_server_key: list[Any] = []  # [(environment, sys.path)] the fork server started with; [None]: one ran before ours
#: environment variables that change between calls and that no import reads (pytest sets this one for each test):
#: they do not make a spawn start fresh interpreters; a child still gets their current value
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def default_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def failed_ranks(failed: bool, device: torch.device) -> list[int]:
    """The ranks of the default process group whose ``failed`` is True, learned by every rank (one all-reduce; no
    collective with one rank or none): how ranks agree to stop together, so that none goes on alone into a
    collective its peers will not enter."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [0] if failed else []
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    flags[dist.get_rank()] = int(failed)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def agreed(error: BaseException) -> BaseException:
    """Mark ``error`` as raised on every rank by agreement (after a collective that told each rank, such as
    :func:`failed_ranks`): the ranks stop together, so no rank need abort its process groups for it."""
    error.orc_agreed = True  # type: ignore[attr-defined]
    return error


def is_agreed(error: BaseException) -> bool:
    """Whether :func:`agreed` marked ``error``."""
    return getattr(error, "orc_agreed", False) is True


def _hold_port() -> socket.socket:
    """A socket bound with SO_REUSEADDR to a free port on every address (IPv6 ``::`` taking IPv4 too, else IPv4),
    never listening. While it is open, a plain bind of the port on any address, a bind to port 0 and an outgoing
    connection cannot get it, and rank 0's store can still listen on it (torch's store and :func:`rendezvous_store`
    bind with SO_REUSEADDR; so can any other SO_REUSEADDR bind, which only a port chosen on purpose would meet)."""
    dual = socket.has_dualstack_ipv6()  # "::" then takes IPv4 too
    s = socket.socket(socket.AF_INET6 if dual else socket.AF_INET, socket.SOCK_STREAM)
    if dual:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::" if dual else "", 0))
    return s


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(device: torch.device | None = None) -> torch.device:
    """Make sure a default process group exists; return this rank's compute device.

    If a group is already initialised it is used as is. Otherwise RANK/WORLD_SIZE/MASTER_ADDR/
    MASTER_PORT are read from the environment; with none of them set, a private single-rank group
    (in-memory store, no port) is created so engines also work in a plain Python process.
    Backend: nccl for CUDA devices, gloo otherwise.
    """
    device = device if device is not None else default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    backend = "nccl" if device.type == "cuda" else "gloo"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size == 1 and "MASTER_PORT" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return device
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} is not set: set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT (or call torch.distributed.init_process_group yourself "
            "before building the engine)"
        )
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        kw["device_id"] = device
    _sockets_on_loopback_for(os.environ["MASTER_ADDR"],
                             "GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME")
    store = rendezvous_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size, backend)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kw)
    return device


def _sockets_on_loopback_for(addr: str, variable: str) -> None:
    """With ``MASTER_ADDR`` on loopback (every rank on this machine), the backend's own sockets listen on the
    loopback interface too (``variable``: ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME``). By default gloo listens
    on the address this machine's hostname resolves to and NCCL's bootstrap on a non-loopback interface, both of
    which the network can reach. A value the user set is left as it is."""
    if variable in os.environ or not _pinned_address(addr):
        return
    try:
        loopback = ipaddress.ip_address(socket.getaddrinfo(addr, None)[0][4][0]).is_loopback
    except (OSError, ValueError):  # unresolvable: the store's connect says so
        return
    name = _loopback_interface() if loopback else None
    if name is not None:
        os.environ[variable] = name


def _loopback_interface() -> str | None:
    """The name of this machine's loopback interface (Linux: IFF_LOOPBACK in /sys/class/net/<name>/flags)."""
    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & 0x8:
                    return name
        except (OSError, ValueError):
            continue
    return None


def _pinned_address(addr: str) -> bool:
    """Whether ``addr`` names one address the same way on every machine: an IP literal, or ``localhost``. Another
    hostname may resolve here to another address than on the other nodes (Debian maps this machine's own name to
    127.0.1.1), so its store keeps torch's default of every interface."""
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return addr == "localhost"
    return True


def rendezvous_store(addr: str, port: int, rank: int, world_size: int, backend: str = "gloo") -> dist.TCPStore:
    """The process group's key-value store at ``addr:port``, served by rank 0 on that address only.

    torch's ``tcp://`` rendezvous serves it on every interface of rank 0's machine, whatever ``addr`` is; the store
    tells each rank where its peers listen and authenticates nobody, so a job on 127.0.0.1 was open to the network.
    Rank 0 binds the listening socket itself (``addr``, as ``MASTER_ADDR`` says) and hands it to the store. As
    torch's rendezvous does: every rank is a client under torchrun's agent (which serves the store), the timeout is
    the backend's default, ``USE_LIBUV=0`` picks the older server. An ``addr`` that is a hostname other than
    ``localhost`` is served on every interface, as before (see :func:`_pinned_address`)."""
    import importlib

    _rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (the package's name is a function)
    c10d = dist.distributed_c10d
    timeout = c10d._get_default_timeout(c10d.Backend(backend)) if hasattr(c10d, "_get_default_timeout") \
        else c10d.default_pg_timeout
    use_libuv = os.environ.get("USE_LIBUV", "1") == "1"
    agent_serves = getattr(_rdzv, "_torchelastic_use_agent_store", lambda: False)()
    if rank != 0 or agent_serves:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    if not _pinned_address(addr):
        return dist.TCPStore(addr, port, world_size, True, timeout, multi_tenant=True, use_libuv=use_libuv)
    listener = None
    try:
        family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(max(128, world_size))
    except OSError as e:  # socket.gaierror too
        if listener is not None:
            listener.close()
        raise RuntimeError(f"rank 0 could not listen on MASTER_ADDR:MASTER_PORT = {addr}:{port} for the process "
                           f"group's store ({e}): MASTER_ADDR must be an address of rank 0's machine, and "
                           f"MASTER_PORT a free port there") from e
    # the store owns the socket from here (its fd is closed with the store, not by this socket object)
    return dist.TCPStore(addr, port, world_size, True, timeout, master_listen_fd=listener.detach(),
                         use_libuv=use_libuv)


def _spawn_entry(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    threads: int,
    env: dict[str, str],
) -> None:
    os.environ.clear()  # the parent's environment when it called spawn (a fork server's child starts with the server's)
    os.environ.update(env)
    _fresh_random_state()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    faulthandler.enable(file=2, all_threads=True)  # a native crash (a gloo thread's abort): every thread's stack
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
        if dist.is_initialized():
            dist.barrier()  # nobody tears down the group while a peer still uses it
            dist.destroy_process_group()
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise


def _fresh_random_state() -> None:
    """Seed torch's, numpy's and Python's global generators from fresh entropy, as a new interpreter does: ranks
    forked from one server would otherwise all draw the same numbers. (String hashing keeps the server's seed.)"""
    import random

    import numpy as np

    random.seed()
    np.random.seed()
    torch.seed()


def _server_running_elsewhere() -> bool:
    """Whether multiprocessing's fork server already runs, started by something else before this module's first
    spawn (its environment and preloads are then unknown here)."""
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None) is not None


def _start_method() -> str:
    """``forkserver`` while this process's environment and ``sys.path`` are the ones the fork server started with
    (so that a rank sees what a fresh interpreter started now would, down to what the preloaded modules read when
    they were imported); ``spawn`` otherwise (a fresh interpreter per rank, as before the fork server). Always
    ``spawn`` where CUDA is available: importing the engines may initialize CUDA's driver in the server, and a
    process forked after that cannot use CUDA."""
    if torch.cuda.is_available():
        return "spawn"
    env, path = {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV}, list(sys.path)
    with _server_lock:
        if not _server_key:
            if _server_running_elsewhere():
                _server_key.append(None)
            else:
                multiprocessing.set_forkserver_preload(list(PRELOAD))
                _server_key.append((env, path))
        if _server_key[0] is None:
            log.info("spawn: a fork server this module did not start already runs; ranks start as fresh "
                     "interpreters")
            return "spawn"
        server_env, server_path = _server_key[0]
    if (env, path) == (server_env, server_path):
        return "forkserver"
    changed = sorted(k for k in env.keys() | server_env.keys() if env.get(k) != server_env.get(k))
    log.info("spawn: %s changed since the fork server started; ranks start as fresh interpreters",
             ", ".join(changed) if changed else "sys.path")
    return "spawn"


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return the results.

    Each child gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR=127.0.0.1/MASTER_PORT (a free port, held bound by this
    process until the ranks end, so that no other process takes it before rank 0 listens on it) and
    ``torch.set_num_threads(threads)``; ``fn`` must be importable (module level). ``fn`` should
    create its engine (which joins the group) and return tensors, numbers, strings, None and
    dicts/lists/tuples of them (what ``torch.load(weights_only=True)`` reads back; other objects
    fail to load with an error naming them). A child's exception is re-raised here with its traceback.

    Children are forked from multiprocessing's fork server, which this process starts on its first spawn with
    :data:`PRELOAD` imported (a few seconds, once; the server lives as long as this process). Nothing of this
    process's own state reaches a child; a child gets this process's environment as it is at the call, and its
    random generators are seeded afresh, as in a new interpreter. Children start as fresh interpreters instead
    (``spawn``) when the environment (but for :data:`VOLATILE_ENV`) or ``sys.path`` has changed since the server
    started (so that no preloaded module read a stale value), when a fork server this module did not start
    already runs (its environment is unknown), and on machines with CUDA (a fork after CUDA's driver is
    initialized is not safe).
    """
    import torch.multiprocessing as mp

    for attempt in range(1, PORT_TRIES + 1):
        hold = _hold_port()
        port = int(hold.getsockname()[1])
        with hold, tempfile.TemporaryDirectory(prefix="engines_spawn_") as out_dir:
            try:
                mp.start_processes(
                    _spawn_entry,
                    args=(world_size, port, out_dir, fn, args, threads, dict(os.environ)),
                    nprocs=world_size,
                    join=True,
                    start_method=_start_method(),
                )
            except Exception as exc:
                errors = {}
                for r in range(world_size):
                    p = os.path.join(out_dir, f"rank{r}.pt")
                    if os.path.exists(p):
                        rec = torch.load(p, weights_only=True)
                        if not rec["ok"]:
                            errors[r] = rec["error"]
                if attempt < PORT_TRIES and _port_taken(errors.get(0, "")):
                    # the port was free when picked, and taken before rank 0 listened on it: nothing ran yet
                    log.warning("spawn: port %d was taken by another process before rank 0 listened on it; "
                                "starting the ranks again on another port (try %d of %d)", port, attempt + 1,
                                PORT_TRIES)
                    continue
                detail = "\n".join(f"--- rank {r} ---\n{e}" for r, e in errors.items())
                detail = detail or f"no rank reported an error (one died: {exc})"
                raise RuntimeError("spawned rank failed:\n" + detail) from exc
            results = []
            for r in range(world_size):
                rec = torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
                results.append(rec["result"])
            return results
    raise AssertionError("unreachable: the last try returns or raises")


#: how many ports ``spawn`` tries when the one it picked is taken before rank 0 listens on it
PORT_TRIES = 3


def _port_taken(error: str) -> bool:
    """Whether rank 0's error ``error`` (a traceback) says its store's port was in use."""
    return "EADDRINUSE" in error or "address already in use" in error.lower()
