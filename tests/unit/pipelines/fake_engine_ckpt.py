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
