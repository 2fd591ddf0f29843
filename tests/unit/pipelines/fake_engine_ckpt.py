"""What a worker's ``save`` leaves for the runner to commit, for tests whose workers are fakes: a commit refuses a
checkpoint without each engine role's index and shards (``pipelines.checkpoint.commit(roles=...)``)."""

from __future__ import annotations

import json
from pathlib import Path


def write_engine_checkpoint(directory: str, role: str = "actor") -> str:
    """An engine checkpoint of one (fake) shard in ``directory/role``, as ``ActorRolloutRefWorker.save`` writes it;
    returns ``directory``."""
    d = Path(directory) / role
    d.mkdir(parents=True, exist_ok=True)
    shard = "model-rank00000-of-00001.safetensors"
    (d / shard).write_bytes(b"fake weights")
    (d / "engine_state.json").write_text("{}")
    (d / "index.json").write_text(json.dumps({"format": "fake", "files": {shard: {}}, "tensors": {}}))
    return directory


class FakeActor:
    """An actor group whose ``save`` leaves what a commit needs and whose ``load`` restores nothing: for runner tests
    where only the runner's own files matter."""

    async def save(self, directory: str, pending_generate_calls: int = 0) -> str:
        return write_engine_checkpoint(directory)  # a commit needs the role's index and shards

    async def load(self, directory: str, verify: bool = True) -> int:
        return 0


class FakeCluster:
    """A cluster of one :class:`FakeActor`, no critic, the rollout colocated."""

    split = False
    critic = None

    def __init__(self) -> None:
        self.actor = FakeActor()

    async def ready(self) -> None:
        return None

    def groups(self) -> list:
        return []

    def shutdown(self) -> None:
        return None
