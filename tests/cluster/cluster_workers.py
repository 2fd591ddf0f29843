"""A Worker for the multi-node tests; shipped to the nodes as the ``working_dir`` of the job's runtime_env."""

from __future__ import annotations

from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D


class Where(Worker):
    """Says which rank it is (placement is what these tests look at)."""

    @endpoint(D.broadcast())
    def rank_of(self) -> int:
        return self.rank


class Echo(Worker):
    """Records the calls it ran, in order (the fast path across nodes keeps the group's call order)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    @endpoint(D.broadcast())
    def note(self, tag: str) -> tuple[int, str]:
        self.log.append(tag)
        return self.rank, tag

    @endpoint(D.broadcast())
    def history(self) -> list[str]:
        return list(self.log)

    @endpoint(D.shard())
    def double(self, b: Batch) -> Batch:
        self.log.append("double")
        return Batch.from_dict({"x": b["x"] * 2})

    @endpoint(D.broadcast())
    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()
