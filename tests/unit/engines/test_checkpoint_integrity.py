"""engines.checkpoint against a checkpoint whose files lie: an index whose shards overlap, leave holes or leave the
tensor; in process, on plain CPU tensors (no engine, no spawned ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engines.checkpoint import FORMAT, CheckpointError, load_sharded, save_sharded, sha256_file

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


@pytest.mark.parametrize("how", ["renamed over it", "rewritten in place"])
def test_a_shard_changed_right_after_its_sha256_was_checked_is_not_what_loads(w_ckpt, monkeypatch, how):
    """The bytes loaded are the bytes hashed: the shard is swapped for another valid safetensors file (other
    values, same header) the moment its digest is computed. The old loader hashed the file, then opened it again
    by name and loaded the other file's values."""
    import hashlib
    import os

    from engines import checkpoint_io

    shard = w_ckpt / "model-rank00000-of-00001.safetensors"
    other = w_ckpt.parent / "other.safetensors"
    save_file({"model/w": torch.full((4,), -7.0)}, str(other), metadata={"format": FORMAT, "rank": "0",
                                                                         "world_size": "1"})
    assert other.stat().st_size == shard.stat().st_size

    real_sha256 = hashlib.sha256

    class SwapWhenDigested:
        def __init__(self) -> None:
            self._h = real_sha256()

        def update(self, data: bytes) -> None:
            self._h.update(data)

        def hexdigest(self) -> str:
            if other.exists():
                if how == "renamed over it":
                    os.replace(other, shard)
                else:
                    with open(shard, "r+b") as f:
                        f.write(other.read_bytes())
                    other.unlink()
            return self._h.hexdigest()

    monkeypatch.setattr(checkpoint_io.hashlib, "sha256", SwapWhenDigested)
    out = torch.zeros(4)
    _load(w_ckpt, w=out)
    assert not other.exists()  # the swap happened
    assert out.tolist() == [1, 2, 3, 4]


# The loader has the safetensors library parse the bytes it hashed (above); these pin that a header lying about
# the data is refused, naming the file, with and without verify, and nothing is written.
def _raw_safetensors(header: dict | list, data: bytes, header_len: int | None = None) -> bytes:
    import struct

    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h) if header_len is None else header_len) + h + data


_F32x4 = torch.tensor([10.0, 20.0, 30.0, 40.0]).numpy().tobytes()
_W = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
_LYING_HEADERS = {
    "data_offsets past the end": ({"model/w": {**_W, "data_offsets": [8, 24]}}, _F32x4, None),
    "data_offsets reversed": ({"model/w": {**_W, "data_offsets": [16, 0]}}, _F32x4, None),
    "negative offset": ({"model/w": {**_W, "data_offsets": [-16, 0]}}, _F32x4, None),
    "dtype size mismatch": ({"model/w": {**_W, "dtype": "F64"}}, _F32x4, None),
    "shape lies": ({"model/w": {**_W, "shape": [2]}}, _F32x4, None),
    "huge shape": ({"model/w": {**_W, "shape": [2**62, 4]}}, _F32x4, None),
    "overlapping tensors": ({"model/w": _W, "model/x": {**_W, "shape": [2], "data_offsets": [8, 16]}}, _F32x4,
                            None),
    "a hole": ({"model/w": {**_W, "data_offsets": [4, 20]}}, b"\0" * 4 + _F32x4, None),
    "trailing bytes": ({"model/w": _W}, _F32x4 + bytes(8), None),
    "unknown dtype": ({"model/w": {**_W, "dtype": "XX"}}, _F32x4, None),
    "dtype a list": ({"model/w": {**_W, "dtype": ["F32"]}}, _F32x4, None),
    "shape a number": ({"model/w": {**_W, "shape": 4}}, _F32x4, None),
    "metadata not strings": ({"__metadata__": {"a": 1}, "model/w": _W}, _F32x4, None),
    "header a list": ([1], _F32x4, None),
    "header length past the end": ({"model/w": _W}, _F32x4, 10**6),
    "header length 2**63": ({"model/w": _W}, _F32x4, 2**63),
    "header cut": ({"model/w": _W}, _F32x4, 3),
}


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("what", list(_LYING_HEADERS))
def test_a_safetensors_header_that_lies_is_refused_naming_the_file(w_ckpt, what, verify):
    header, data, header_len = _LYING_HEADERS[what]
    shard = w_ckpt / "model-rank00000-of-00001.safetensors"
    shard.write_bytes(_raw_safetensors(header, data, header_len))
    index = json.loads((w_ckpt / "index.json").read_text())
    size, digest = sha256_file(shard)
    index["files"][shard.name] = {"bytes": size, "sha256": digest}  # the index vouches for the lying file
    (w_ckpt / "index.json").write_text(json.dumps(index))
    out = torch.full((4,), -1.0)
    with pytest.raises(CheckpointError, match=r"model-rank00000-of-00001\.safetensors is not a valid safetensors "
                                              r"file \("):
        load_sharded(w_ckpt, {"w": out}, NO_OPTIM, device=CPU, verify=verify)
    assert out.tolist() == [-1.0] * 4


def test_a_shard_of_another_size_than_the_index_says_is_refused_before_it_is_read(w_ckpt):
    """Also without ``verify`` (the runner's load, after the manifest check): a file grown or cut since is not read."""
    shard = w_ckpt / "model-rank00000-of-00001.safetensors"
    with open(shard, "ab") as f:
        f.write(bytes(8))
    with pytest.raises(CheckpointError, match=r"model-rank00000-of-00001\.safetensors has \d+ bytes, the index says"):
        load_sharded(w_ckpt, {"w": torch.zeros(4)}, NO_OPTIM, device=CPU, verify=False)


# engine_state.json (which the index's sha256 do not cover) and index.json values of the wrong type: refused
# before any tensor is written, as CheckpointError naming the file and the entry
def _adam_state_dicts() -> tuple[dict, dict]:
    """``(model_sd, optim_sd)`` of one parameter ``w`` after one AdamW step, keyed by name like get_state_dict's."""
    p = torch.nn.Parameter(torch.arange(4.0))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    return {"w": p.detach().clone()}, {"state": {"w": dict(sd["state"][0])},
                                       "param_groups": [{**sd["param_groups"][0], "params": ["w"]}]}


def _set(tree: dict, path: list, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


_BAD_VALUES = {
    "rng of rank 0 a string": ("engine_state.json", ["rng", 0, "torch_cpu"], "x", "rng"),
    "rng of rank 0 without torch_cpu": ("engine_state.json", ["rng", 0], {}, "rng"),
    "rng of rank 0 too short": ("engine_state.json", ["rng", 0, "torch_cpu"], [1, 2, 3], "rng"),
    "rng of rank 0 past a byte": ("engine_state.json", ["rng", 0, "torch_cpu"], None, "rng"),
    "rng a string": ("engine_state.json", ["rng"], "x", "rng"),
    "lr a string": ("engine_state.json", ["optimizer", "param_groups", 0, "lr"], "fast", "'lr'"),
    "betas of one": ("engine_state.json", ["optimizer", "param_groups", 0, "betas"], [0.9], "'betas'"),
    "amsgrad a number": ("engine_state.json", ["optimizer", "param_groups", 0, "amsgrad"], 1, "'amsgrad'"),
    # values of the right type that no optimizer could have written: each loaded silently before (an Adam step of
    # NaN left every weight NaN after one more step that reported nothing; maximize turned descent into ascent)
    "adam step NaN": ("engine_state.json", ["optimizer", "scalars", "w", "step", "value"], float("nan"), "w/step"),
    "adam step inf": ("engine_state.json", ["optimizer", "scalars", "w", "step", "value"], float("inf"), "w/step"),
    "adam step -3": ("engine_state.json", ["optimizer", "scalars", "w", "step", "value"], -3, "w/step"),
    "adam step 1.5": ("engine_state.json", ["optimizer", "scalars", "w", "step", "value"], 1.5, "w/step"),
    "adam step true": ("engine_state.json", ["optimizer", "scalars", "w", "step", "value"], True, "w/step"),
    "eps NaN": ("engine_state.json", ["optimizer", "param_groups", 0, "eps"], float("nan"), "'eps'"),
    "betas with inf": ("engine_state.json", ["optimizer", "param_groups", 0, "betas"], [0.9, float("inf")],
                       "'betas'"),
    "maximize true": ("engine_state.json", ["optimizer", "param_groups", 0, "maximize"], True, "'maximize'"),
    "amsgrad true": ("engine_state.json", ["optimizer", "param_groups", 0, "amsgrad"], True, "'amsgrad'"),
    "global_step true": ("engine_state.json", ["global_step"], True, "global_step"),
    "global_step -5": ("engine_state.json", ["global_step"], -5, "global_step"),
    "a file entry a number": ("index.json", ["files", "model-rank00000-of-00001.safetensors"], 5,
                              "model-rank00000-of-00001.safetensors"),
    "a file's bytes a string": ("index.json", ["files", "model-rank00000-of-00001.safetensors", "bytes"], "176",
                                "model-rank00000-of-00001.safetensors"),
}


@pytest.mark.parametrize("what", list(_BAD_VALUES))
def test_a_value_of_the_wrong_type_is_refused_before_anything_is_written(tmp_path, what):
    name, path, value, why = _BAD_VALUES[what]
    d = tmp_path / "ckpt"
    model_sd, optim_sd = _adam_state_dicts()
    save_sharded(d, model_sd, optim_sd, device=CPU, engine_state={"global_step": 1})
    tree = json.loads((d / name).read_text())
    if what == "rng of rank 0 past a byte":
        value = [300] + tree["rng"][0]["torch_cpu"][1:]
    _set(tree, path, value)
    (d / name).write_text(json.dumps(tree))
    model_sd, optim_sd = _adam_state_dicts()
    model_sd["w"].zero_()
    groups_before = [dict(g) for g in optim_sd["param_groups"]]
    rng_before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=rf"{name}.*{why}"):
        load_sharded(d, model_sd, optim_sd, device=CPU, verify=True)
    assert model_sd["w"].tolist() == [0.0] * 4
    assert optim_sd["param_groups"] == groups_before
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_the_adam_state_round_trips(tmp_path):
    """The state the checks above start from loads: weights, moments, step count, hyperparameters."""
    d = tmp_path / "ckpt"
    saved_model, saved_optim = _adam_state_dicts()
    save_sharded(d, saved_model, saved_optim, device=CPU, engine_state={"global_step": 1})
    model_sd, optim_sd = _adam_state_dicts()
    model_sd["w"].zero_()
    for v in optim_sd["state"]["w"].values():
        v.zero_()
    optim_sd["param_groups"][0]["lr"] = 0.5
    load_sharded(d, model_sd, optim_sd, device=CPU, verify=True)
    assert torch.equal(model_sd["w"], saved_model["w"])
    for k, v in saved_optim["state"]["w"].items():
        assert torch.equal(optim_sd["state"]["w"][k], v), k
    assert optim_sd["param_groups"] == saved_optim["param_groups"]


def test_the_running_optimizers_implementation_flags_stay(tmp_path):
    """``foreach``, ``fused``, ``capturable`` and ``differentiable`` choose how the update is computed, not what it
    is (a checkpoint written where one applied loads where it does not): the running optimizer's values stay, and
    no flag is copied from the file."""
    d = tmp_path / "ckpt"
    saved_model, saved_optim = _adam_state_dicts()
    saved_optim["param_groups"][0].update(foreach=True, capturable=True)
    save_sharded(d, saved_model, saved_optim, device=CPU, engine_state={"global_step": 1})
    model_sd, optim_sd = _adam_state_dicts()
    load_sharded(d, model_sd, optim_sd, device=CPU, verify=True)
    assert optim_sd["param_groups"][0]["foreach"] is None
    assert optim_sd["param_groups"][0]["capturable"] is False


@pytest.mark.parametrize("dies_at", ["engine_state.json", "index.json"])
def test_a_save_into_a_checkpoint_that_dies_halfway_leaves_no_checkpoint_not_the_old_index_over_new_files(
        w_ckpt, monkeypatch, dies_at):
    """The old index.json stayed while new shards and a new engine_state.json were written: a save that died
    between them left a directory that loaded without error — the old weights with the new step count."""
    import engines.checkpoint as ck

    write = ck.write_json_atomic

    def dying(path, *a, **kw):
        if Path(path).name == dies_at:
            raise OSError("the process died here")
        return write(path, *a, **kw)

    monkeypatch.setattr(ck, "write_json_atomic", dying)
    with pytest.raises(CheckpointError):
        save_sharded(w_ckpt, {"w": torch.full((4,), 5.0)}, NO_OPTIM, device=CPU, engine_state={"global_step": 9})
    monkeypatch.setattr(ck, "write_json_atomic", write)
    with pytest.raises(CheckpointError, match="index.json"):
        _load(w_ckpt, w=torch.zeros(4))
    save_sharded(w_ckpt, {"w": torch.full((4,), 5.0)}, NO_OPTIM, device=CPU, engine_state={"global_step": 9})
    out = torch.zeros(4)
    _load(w_ckpt, w=out)  # a save that completes makes it a checkpoint again
    assert out.tolist() == [5.0] * 4
