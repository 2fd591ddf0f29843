"""ResourcePool: process slots on nodes, reserved by the pool's backend (on Ray: one STRICT_PACK placement group per
node entry; in-process: a share of ``orc.init(backend="local", num_cpus=...)``)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

import anyio

from . import _backend
from ._backend import Backend, Slot
from ._errors import PlacementError

__all__ = ["ResourcePool", "Slot"]

log = logging.getLogger("orchestra")


class ResourcePool:
    """Process slots per node: ``process_on_nodes=[4, 2]`` is 4 ranks on one node and 2 on another.

    Each entry becomes a STRICT_PACK placement group; ranks are ordered by node address. ``max_colocate_count``
    lets that many worker processes share one slot (one GPU); ``cpus_per_worker`` (fractional allowed) is what
    each process reserves — the default (0.25 on CPU pools, 1 with GPUs) lets a 4-worker CPU pool start on a 2-core
    laptop. Placement checks the cluster first and never waits longer than ``placement_timeout`` seconds.
    ``backend`` is where the ranks run: ``"ray"`` or ``"local"`` (default: the one ``orc.init`` started last).
    """

    def __init__(self, process_on_nodes: Sequence[int], *, use_gpu: bool = False, max_colocate_count: int = 1,
                 cpus_per_worker: float | None = None, name: str | None = None,
                 placement_timeout: float = 60.0, backend: str | Backend | None = None) -> None:
        nodes = list(process_on_nodes)
        if not nodes or any(not isinstance(n, int) or n < 1 for n in nodes):
            raise ValueError(f"process_on_nodes needs positive integers (ranks per node), got {process_on_nodes!r}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        if cpus_per_worker is not None and cpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker must be >= 0, got {cpus_per_worker}")
        self.process_on_nodes = nodes
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.cpus_per_worker = float(cpus_per_worker if cpus_per_worker is not None else (1.0 if use_gpu else 0.25))
        self.name = name or f"pool{nodes}"
        self.placement_timeout = placement_timeout
        self.backend: Backend = _resolve(backend)
        self._session = _backend.session()  # the session it reserves in: after orc.shutdown() it is refused
        self._slots: list[Slot] | None = None
        self._pgs: list[Any] = []
        self._lock: asyncio.Lock | None = None
        self._refs = 0  # groups using this pool: the placement groups are released when the last one closes
        self._refs_lock = threading.Lock()  # groups give their reference back from worker threads
        self._era = 0  # bumped by ``forget``: a reference taken before it is no longer counted

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        """Resources reserved per rank slot (shared by up to ``max_colocate_count`` processes)."""
        b = {"CPU": self.cpus_per_worker * self.max_colocate_count}
        if self.use_gpu:
            b["GPU"] = 1.0
        return b

    def actor_resources(self) -> dict[str, float]:
        """What one worker process asks of its slot."""
        out = {"num_cpus": self.cpus_per_worker}
        if self.use_gpu:
            out["num_gpus"] = 1.0 / self.max_colocate_count
        return out

    def fit_message(self, problems: list[str]) -> str:
        """The PlacementError text: what the pool asked for, what did not fit, and what to change."""
        return (f"resource pool {self.name!r} (process_on_nodes={self.process_on_nodes}, use_gpu={self.use_gpu}, "
                f"cpus_per_worker={self.cpus_per_worker:g}, max_colocate_count={self.max_colocate_count}) does not "
                f"fit the cluster:\n  - " + "\n  - ".join(problems) +
                "\nLower process_on_nodes or cpus_per_worker, free other pools (group.shutdown()), or start Ray with "
                "more resources (orc.init(num_cpus=..., num_gpus=...)).")

    async def slots(self) -> list[Slot]:
        """Reserve the slots (once) and return one Slot per rank, ordered by node address."""
        if self._session != _backend.session():  # its backend's cluster (or in-process ranks) ended with it
            raise PlacementError(f"{self.name}: this ResourcePool was made before orc.shutdown() ended the session "
                                 f"it reserves in, and what it reserved ended with it; make a new ResourcePool after "
                                 f"orc.init()")
        if self._slots is not None:
            return self._slots
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._slots is None:
                self._slots = await self._place()
        return self._slots

    async def _place(self) -> list[Slot]:
        # placement queries block: they run in a worker thread, off the event loop. Resources other pools hold now
        # are waited for (up to placement_timeout): Ray frees a released pool's resources asynchronously.
        await anyio.to_thread.run_sync(self.backend.check_fits, self)
        try:
            return await self.backend.reserve(self, self._pgs)
        except BaseException:  # failed, or cancelled (the group was shut down while placing): give it back
            self.release()
            raise

    def acquire(self) -> int:
        """A group starts using this pool (``release_ref`` once when it closes, with the era returned here)."""
        with self._refs_lock:
            self._refs += 1
            return self._era

    def holds_refs(self) -> bool:
        """Whether a group still uses this pool."""
        return self._refs > 0

    def release_ref(self, era: int) -> None:
        """A group using this pool closed: release the placement groups when it was the last one. Each group gives
        its reference back exactly once (``WorkerGroup`` keeps track); one more release is a bug, refused. ``era``
        (what ``acquire`` returned): a reference taken before the pool was forgotten is gone with it, so giving it
        back does nothing (a close already under way in a worker thread when ``orc.shutdown()`` ran)."""
        with self._refs_lock:
            if era != self._era:
                return
            if self._refs == 0:
                raise RuntimeError(f"resource pool {self.name!r}: a reference was given back that no group held (a "
                                   f"group released its share twice); the pool's other groups keep it")
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.release()

    def forget(self) -> None:
        """The cluster that held this pool's reservations is gone (``orc.shutdown()`` ended it or disconnected from
        it: a job's placement groups end with it): drop them and every group's share without calling the backend,
        which would start a new cluster to answer. A later group reserves anew."""
        with self._refs_lock:
            self._refs = 0
            self._era += 1
        self._pgs, self._slots = [], None

    def release(self) -> None:
        """Give the reservations back now (hosts placed in them must be gone). Blocking."""
        held, self._pgs, self._slots = self._pgs, [], None
        if held:
            self.backend.unreserve(held, self.name)

    def __repr__(self) -> str:
        return (f"ResourcePool(backend={self.backend.name!r}, process_on_nodes={self.process_on_nodes}, use_gpu={self.use_gpu}, "
                f"max_colocate_count={self.max_colocate_count}, cpus_per_worker={self.cpus_per_worker:g})")


def _resolve(backend: str | Backend | None) -> Backend:
    """The backend a pool names: an instance, a name, or None for the one ``orc.init`` started last. ``"local"``
    before ``orc.init(backend="local")`` starts an in-process backend (this machine's CPUs) without making it the
    default, so that pools of both backends can run side by side (the contract tests do)."""
    if isinstance(backend, Backend):
        return backend
    if backend is None:
        return _backend.current()
    if backend == "local":
        try:
            return _backend.by_name("local")
        except ValueError:
            from ._local import LocalBackend

            local = LocalBackend()
            _backend.register(local)
            return local
    if backend != "ray":
        raise ValueError(f"ResourcePool(backend={backend!r}): choose 'ray' or 'local'")
    return _backend.by_name(backend)
