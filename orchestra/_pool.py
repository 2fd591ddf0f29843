"""ResourcePool: process slots on nodes, reserved with one STRICT_PACK placement group per node entry."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

import anyio

from ._errors import PlacementError

__all__ = ["ResourcePool", "Slot"]

log = logging.getLogger("orchestra")


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: its placement group, bundle, node and rank among the pool's ranks on that node."""

    rank: int
    placement_group: Any
    bundle_index: int
    node_ip: str
    node_id: str
    local_rank: int


class ResourcePool:
    """Process slots per node: ``process_on_nodes=[4, 2]`` is 4 ranks on one node and 2 on another.

    Each entry becomes a STRICT_PACK placement group; ranks are ordered by node address. ``max_colocate_count``
    lets that many worker processes share one slot (one GPU); ``cpus_per_worker`` (fractional allowed) is what
    each process reserves — the default (0.25 on CPU pools, 1 with GPUs) lets a 4-worker CPU pool start on a 2-core
    laptop. Placement checks the cluster first and never waits longer than ``placement_timeout`` seconds.
    """

    def __init__(self, process_on_nodes: Sequence[int], *, use_gpu: bool = False, max_colocate_count: int = 1,
                 cpus_per_worker: float | None = None, name: str | None = None,
                 placement_timeout: float = 60.0) -> None:
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
        self._slots: list[Slot] | None = None
        self._pgs: list[Any] = []
        self._lock: asyncio.Lock | None = None
        self._refs = 0  # groups using this pool: the placement groups are released when the last one closes

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

    def _check_fits(self) -> None:
        """Fail at once when the pool can never fit the cluster. Resources other pools hold now are waited for
        (up to ``placement_timeout``): Ray frees a released pool's resources asynchronously."""
        bundle = self.bundle()
        need_total = {k: v * self.world_size for k, v in bundle.items()}
        avail = ray.available_resources()
        total = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        node_totals = [n.get("Resources", {}) for n in nodes]
        problems = []
        for k, v in need_total.items():
            if total.get(k, 0.0) + 1e-9 < v:
                problems.append(f"{k}: need {v:g}, available {avail.get(k, 0.0):g} of {total.get(k, 0):g}")
        for i, count in enumerate(self.process_on_nodes):
            need = {k: v * count for k, v in bundle.items()}
            if not any(all(t.get(k, 0.0) + 1e-9 >= v for k, v in need.items()) for t in node_totals):
                problems.append(f"node entry {i} needs {need} on ONE node; the largest node has "
                                f"{_largest(node_totals, need)}")
        if problems:
            raise PlacementError(self._fit_message(problems))

    def _fit_message(self, problems: list[str]) -> str:
        return (f"resource pool {self.name!r} (process_on_nodes={self.process_on_nodes}, use_gpu={self.use_gpu}, "
                f"cpus_per_worker={self.cpus_per_worker:g}, max_colocate_count={self.max_colocate_count}) does not "
                f"fit the cluster:\n  - " + "\n  - ".join(problems) +
                "\nLower process_on_nodes or cpus_per_worker, free other pools (group.shutdown()), or start Ray with "
                "more resources (orc.init(num_cpus=..., num_gpus=...)).")

    async def slots(self) -> list[Slot]:
        """Reserve the placement groups (once) and return one Slot per rank, ordered by node address."""
        if self._slots is not None:
            return self._slots
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._slots is None:
                self._slots = await self._place()
        return self._slots

    async def _place(self) -> list[Slot]:
        # Ray's state queries and placement-group calls block: they run in a worker thread, off the event loop
        await anyio.to_thread.run_sync(self._check_fits)
        bundle = self.bundle()

        def create() -> list[Any]:
            # entries spread over distinct nodes (STRICT_SPREAD across entries, STRICT_PACK within one): each
            # entry gets a node of its own that can hold it as a soft target, biggest entries first
            targets: dict[int, str] = {}
            if len(self.process_on_nodes) > 1:
                nodes = sorted((n for n in ray.nodes() if n.get("Alive")),
                               key=lambda n: -n.get("Resources", {}).get("CPU", 0.0))
                for i in sorted(range(len(self.process_on_nodes)), key=lambda i: -self.process_on_nodes[i]):
                    need = {k: v * self.process_on_nodes[i] for k, v in bundle.items()}
                    node = next((n["NodeID"] for n in nodes if n["NodeID"] not in targets.values() and
                                 all(n.get("Resources", {}).get(k, 0.0) + 1e-9 >= v for k, v in need.items())), None)
                    if node is not None:
                        targets[i] = node
            for i, n in enumerate(self.process_on_nodes):  # recorded as made, so a cancel still releases them
                self._pgs.append(placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK",
                                                 name=f"{self.name}-{i}-{uuid.uuid4().hex[:8]}",
                                                 _soft_target_node_id=targets.get(i)))
            return list(self._pgs)

        try:
            pgs = await anyio.to_thread.run_sync(create)
            await asyncio.wait_for(asyncio.gather(*[pg.ready() for pg in pgs]), self.placement_timeout)
        except asyncio.TimeoutError:
            states = await anyio.to_thread.run_sync(lambda: [placement_group_table(pg).get("state") for pg in pgs])
            avail = await anyio.to_thread.run_sync(ray.available_resources)
            await anyio.to_thread.run_sync(self.release)
            raise PlacementError(self._fit_message(
                [f"placement groups not ready after {self.placement_timeout:g} s (states {states}); the cluster "
                 f"has {avail} available"])) from None
        except BaseException:  # cancelled (the group was shut down while placing): give the reservation back
            self.release()
            raise

        def where() -> list[tuple[str, str, Any, int]]:
            node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
            return [(node_ip.get(node, ""), node, pg, count)
                    for pg, count in zip(pgs, self.process_on_nodes)
                    for node in [placement_group_table(pg)["bundles_to_node_id"][0]]]

        placed = await anyio.to_thread.run_sync(where)
        shared = {}
        for i, (ip, node, _, _) in enumerate(placed):
            shared.setdefault(node, []).append(i)
        shared = {node: entries for node, entries in shared.items() if len(entries) > 1}
        if shared:
            log.warning("resource pool %r: node entries share a node (%s): the cluster has no free node for each "
                        "entry (process_on_nodes=%s); ranks of different entries then compete for that node", self.name,
                        "; ".join(f"entries {e} on {node[:12]}" for node, e in shared.items()), self.process_on_nodes)
        placed.sort(key=lambda t: tuple(int(x) if x.isdigit() else 0 for x in t[0].split(".")))
        slots, rank, per_node = [], 0, {}
        for ip, node, pg, count in placed:
            for b in range(count):
                local = per_node.get(node, 0)
                per_node[node] = local + 1
                slots.append(Slot(rank, pg, b, ip, node, local))
                rank += 1
        return slots

    def acquire(self) -> None:
        """A group starts using this pool (``release_ref`` when it closes)."""
        self._refs += 1

    def holds_refs(self) -> bool:
        return self._refs > 0

    def release_ref(self) -> None:
        """A group using this pool closed: release the placement groups when it was the last one."""
        self._refs = max(0, self._refs - 1)
        if self._refs == 0:
            self.release()

    def release(self) -> None:
        """Give the placement groups back to the cluster now (workers placed in them must be gone). Blocking."""
        pgs, self._pgs, self._slots = self._pgs, [], None
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - Ray already gone, or the group already removed
                log.warning("resource pool %r: could not remove placement group %s: %r", self.name, pg.id.hex(), e)

    def __repr__(self) -> str:
        return (f"ResourcePool(process_on_nodes={self.process_on_nodes}, use_gpu={self.use_gpu}, "
                f"max_colocate_count={self.max_colocate_count}, cpus_per_worker={self.cpus_per_worker:g})")


def _largest(node_totals: list[dict], need: dict) -> dict:
    if not node_totals:
        return {}
    best = max(node_totals, key=lambda t: tuple(t.get(k, 0.0) for k in need))
    return {k: best.get(k, 0.0) for k in need}
