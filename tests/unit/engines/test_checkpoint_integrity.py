"""engines.checkpoint against a checkpoint whose files lie: an index whose shards overlap, leave holes or leave the
tensor; in process, on plain CPU tensors (no engine, no spawned ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engines.checkpoint import CheckpointError, load_sharded, save_sharded, sha256_file

CPU = torch.device("cpu")
NO_OPTIM: dict = {"state": {}, "param_groups": []}


def _saved(d: Path, **tensors: torch.Tensor) -> None:
    """A 1-rank checkpoint of ``tensors`` (model state only) in ``d``."""
    save_sharded(d, tensors, NO_OPTIM, device=CPU, engine_state={"global_step": 7})


def _reshard(d: Path, key: str, pieces: list[tuple[list[int], torch.Tensor]]) -> None:
    """Rewrite ``d``'s ``model/<key>`` as if each piece had been saved by a rank of its own at the given global
    offset, with a consistent index (right sizes and sha256): the index lies only about where the pieces go."""
    index = json.loads((d / "index.json").read_text())
    world = len(pieces)
    shards = []
    for r, (offset, piece) in enumerate(pieces):
        name = f"model-rank{r:05d}-of-{world:05d}.safetensors"
        save_file({f"model/{key}": piece.contiguous()}, str(d / name))
        size, digest = sha256_file(d / name)
        index["files"][name] = {"bytes": size, "sha256": digest}
        shards.append({"rank": r, "file": name, "offset": offset, "shape": list(piece.shape)})
    index["tensors"][f"model/{key}"]["shards"] = shards
    (d / "index.json").write_text(json.dumps(index))


def _load(d: Path, **templates: torch.Tensor) -> None:
    load_sharded(d, templates, NO_OPTIM, device=CPU, verify=True)


@pytest.fixture
def w_ckpt(tmp_path: Path) -> Path:
    """A checkpoint of ``w = [1, 2, 3, 4]``."""
    d = tmp_path / "ckpt"
    _saved(d, w=torch.arange(4, dtype=torch.float32) + 1)
    return d


def test_a_correct_split_loads(w_ckpt):
    w = torch.arange(4, dtype=torch.float32) + 1
    _reshard(w_ckpt, "w", [([0], w[:1]), ([1], w[1:3]), ([3], w[3:]), ([4], w[4:])])  # an empty shard at the end
    out = torch.full((4,), -99.0)
    _load(w_ckpt, w=out)
    assert out.tolist() == [1, 2, 3, 4]


def test_overlapping_shards_that_leave_a_hole_are_refused(w_ckpt):
    """Two shards at offset [0]: the element count matches, the positions do not (the template kept -99 in the
    hole, silently)."""
    w = torch.arange(4, dtype=torch.float32) + 1
    _reshard(w_ckpt, "w", [([0], w[:2]), ([0], w[2:])])
    out = torch.full((4,), -99.0)
    with pytest.raises(CheckpointError) as e:
        _load(w_ckpt, w=out)
    msg = str(e.value)
    assert "index.json" in msg and "model/w" in msg
    assert "[0:2]" in msg and "2 shards" in msg  # what overlaps, and by how many
    assert "[2:4]" in msg and "no shard" in msg  # what is missing
    assert "model-rank00000-of-00002.safetensors" in msg and "model-rank00001-of-00002.safetensors" in msg
    assert out.tolist() == [-99.0] * 4  # nothing was written


def test_overlapping_shards_without_a_hole_are_refused(tmp_path):
    d = tmp_path / "ckpt"
    m = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    _saved(d, m=m)
    _reshard(d, "m", [([0, 0], m[:3]), ([2, 0], m[2:])])  # row 2 twice, and one row too many
    with pytest.raises(CheckpointError, match=r"model/m.*\[2:3, 0:3\].*2 shards"):
        _load(d, m=torch.zeros(4, 3))


def test_a_shard_outside_the_tensor_is_refused(w_ckpt):
    w = torch.arange(4, dtype=torch.float32) + 1
    _reshard(w_ckpt, "w", [([0], w[:2]), ([2], torch.cat([w[2:], w[2:]]))])  # 4 elements at offset 2 of 4
    with pytest.raises(CheckpointError, match=r"index\.json.*model/w.*model-rank00001-of-00002\.safetensors.*"
                                              r"offset \[2\] shape \[4\].*outside.*\[4\]"):
        _load(w_ckpt, w=torch.zeros(4))


@pytest.mark.parametrize("offset", [[-2], [1.0], [True], ["0"]])
def test_a_shard_offset_that_is_not_a_natural_number_is_refused(w_ckpt, offset):
    w = torch.arange(4, dtype=torch.float32) + 1
    _reshard(w_ckpt, "w", [([2], w[2:]), (offset, w[:2])])
    with pytest.raises(CheckpointError, match=r"index\.json.*model/w.*shard"):
        _load(w_ckpt, w=torch.zeros(4))


def test_one_file_listed_for_two_shards_of_a_tensor_is_refused(w_ckpt):
    """A file holds one piece of each tensor: listing it at two offsets tiles the tensor with one piece twice."""
    w = torch.arange(4, dtype=torch.float32) + 1
    _reshard(w_ckpt, "w", [([0], w[:2])])
    index = json.loads((w_ckpt / "index.json").read_text())
    (shard,) = index["tensors"]["model/w"]["shards"]
    index["tensors"]["model/w"]["shards"].append({**shard, "offset": [2]})
    (w_ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model/w.*model-rank00000-of-00001\.safetensors.*twice"):
        _load(w_ckpt, w=torch.zeros(4))


def test_missing_elements_are_named(w_ckpt):
    w = torch.arange(4, dtype=torch.float32) + 1
    _reshard(w_ckpt, "w", [([0], w[:1]), ([2], w[2:])])
    with pytest.raises(CheckpointError, match=r"model/w.*\[1:2\].*no shard"):
        _load(w_ckpt, w=torch.zeros(4))


@pytest.mark.parametrize("name", ["index.json", "engine_state.json"])
@pytest.mark.parametrize("text", ['{"x": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000, "[]"],
                         ids=["5000 digits", "100000 deep", "a list"])
def test_json_that_fails_to_parse_to_an_object_is_named(w_ckpt, name, text):
    (w_ckpt / name).write_text(text)
    with pytest.raises(CheckpointError, match=rf"{name}.*(not valid JSON|not a JSON object)"):
        _load(w_ckpt, w=torch.zeros(4))
