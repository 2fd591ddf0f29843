"""Sharded checkpoints of an FSDP2 model and its optimizer that never unpickle anything.

A checkpoint directory holds, for a run of ``W`` ranks:

- ``model-rank{r:05d}-of-{W:05d}.safetensors`` and ``optim-rank{r:05d}-of-{W:05d}.safetensors``: rank r's local
  shards (FSDP2 DTensor local tensors) of the weights and of the optimizer's tensor state (Adam moments).
  Tensors that are not sharded are stored once, by rank 0.
- ``index.json``: for every tensor (``model/<fqn>``, ``optim/<fqn>/<state>``) its global shape, dtype, placement
  (``{"kind": "shard", "dim": d}`` or ``{"kind": "replicate"}``) and the shards that hold it (rank, file, global
  offset, shape); for every file its size and sha256. Written last, so a directory without it is incomplete.
- ``engine_state.json``: everything that is not a tensor: the step (the LR schedule is a function of it),
  optimizer param groups and scalar state (Adam ``step`` counts), per-rank torch RNG state, the engine config.

Loading validates the index against the running model (names, global shapes, dtypes) and checks that the shards
of each tensor cover every element exactly once. It reads each shard file it needs once, whole, into memory,
checks its size and sha256 on those bytes and takes the tensors from them: what loads is what was verified, even
if the file is replaced or rewritten meanwhile (peak memory: about the largest file this rank reads, on top of
the model; ``bench.checkpoint_load``). It copies into each rank's local shard the parts of the saved shards that
overlap it, so a checkpoint written by W ranks loads into any number of ranks. Tensors are parsed by the
``safetensors`` library from those bytes (a JSON header plus raw bytes) and everything else with ``json``: a
tampered file fails to parse, it cannot run code. Checkpoints should still come from a place you trust: a
well-formed checkpoint can hold any weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from engines._dist import agreed, failed_ranks
from engines.checkpoint_io import CheckpointError, read_checked, read_json, sha256_file, write_json_atomic

__all__ = ["FORMAT", "CheckpointError", "load_sharded", "read_json", "save_sharded", "sha256_file",
           "write_json_atomic"]

FORMAT = "orchestra.fsdp-checkpoint/1"
INDEX = "index.json"
STATE = "engine_state.json"

log = logging.getLogger("orchestra")


def _shard_file(kind: str, rank: int, world: int) -> str:
    return f"{kind}-rank{rank:05d}-of-{world:05d}.safetensors"


# ------------------------------------------------------------------------------------------------------------ layout
# safetensors dtype names -> torch dtypes (those this torch has)
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in [
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U64", "uint64"), ("U32", "uint32"),
        ("U16", "uint16"), ("U8", "uint8"), ("BOOL", "bool"), ("C64", "complex64"), ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2", "float8_e5m2"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")]
    if hasattr(torch, attr)}


def _parse_safetensors(path: str, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file held in ``data``, parsed by the safetensors library from these very bytes
    (those whose size and sha256 were checked: what loads is what was verified); a malformed file (a header that
    lies about offsets, dtypes or shapes, overlapping or trailing data) is a :class:`CheckpointError` naming
    ``path``. The library copies each tensor out of ``data``."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, ValueError, TypeError, RuntimeError, AssertionError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({type(e).__name__}: {e}); the file is "
                              f"corrupt or was not written by safetensors: restore it or use another checkpoint") from e


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _placement(t: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """``(placement, local tensor)``; plain tensors count as replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return {"kind": "replicate"}, t
    if t.device_mesh.ndim != 1:
        raise CheckpointError(f"only 1-D device meshes are supported, got a {t.device_mesh.ndim}-D mesh")
    p = t.placements[0]
    if type(p) is Shard:
        return {"kind": "shard", "dim": p.dim % max(t.ndim, 1)}, t.to_local()
    if type(p) is Replicate:
        return {"kind": "replicate"}, t.to_local()
    raise CheckpointError(f"cannot checkpoint a tensor with placement {p!r}; supported: Shard(d), Replicate()")


def _flatten(model_sd: Mapping[str, Any], optim_sd: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor],
                                                                                 dict[str, dict[str, Any]]]:
    """Tensor entries by checkpoint key, and the optimizer's scalar state (0-d tensors and numbers) by fqn."""
    tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, st in optim_sd.get("state", {}).items():
        for name, v in st.items():
            is_dt = type(v).__name__ == "DTensor"
            if isinstance(v, torch.Tensor) and (is_dt or v.dim() > 0):
                tensors[f"optim/{fqn}/{name}"] = v
            elif isinstance(v, torch.Tensor):
                scalars.setdefault(fqn, {})[name] = {"value": v.item(), "dtype": _dtype_name(v.dtype)}
            elif isinstance(v, (bool, int, float)):
                scalars.setdefault(fqn, {})[name] = {"value": v, "dtype": type(v).__name__}
            else:
                raise CheckpointError(f"optimizer state {fqn}/{name} is a {type(v).__name__}; only tensors and "
                                      f"numbers can be checkpointed")
    return tensors, scalars


def _jsonable_group(group: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in group.items():
        if isinstance(v, torch.Tensor):
            v = v.item()
        if isinstance(v, tuple):
            v = list(v)
        try:
            json.dumps(v)
        except TypeError:
            raise CheckpointError(f"optimizer param group entry {k!r} ({type(v).__name__}) is not JSON-able") from None
        out[k] = v
    return out


def _all_gather_json(obj: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order; bytes travel as uint8 tensors, not pickles."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    world = dist.get_world_size()
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: data.numel()] = data
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    return [json.loads(o[: int(s.item())].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]


def _rng_state(device: torch.device) -> dict[str, list[int]]:
    state = {"torch_cpu": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def _rng_to_restore(spath: str, state: Mapping[str, Any], rank: int, world: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """This rank's saved ``(cpu, cuda or None)`` RNG states as the tensors torch takes, checked (a list of bytes
    as long as this torch's state); None when the checkpoint was written by another number of ranks."""
    rngs = state.get("rng")
    _expect(isinstance(rngs, list), spath, "'rng' is not a list of per-rank RNG states")
    if state.get("world_size") != world or rank >= len(rngs):
        return None

    def as_state(v: Any, like: torch.Tensor, what: str) -> torch.Tensor:
        ok = (isinstance(v, list) and len(v) == like.numel()
              and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in v))
        _expect(ok, spath, f"'rng' of rank {rank}: {what} is not a list of {like.numel()} bytes")
        return torch.tensor(v, dtype=torch.uint8)

    entry = rngs[rank]
    _expect(isinstance(entry, dict) and "torch_cpu" in entry, spath, f"'rng' of rank {rank} has no 'torch_cpu'")
    cpu = as_state(entry["torch_cpu"], torch.get_rng_state(), "torch_cpu")
    cuda = None
    if device.type == "cuda" and "cuda" in entry:
        cuda = as_state(entry["cuda"], torch.cuda.get_rng_state(device), "cuda")
    return cpu, cuda


# param-group flags that choose how the update is computed, not what it is (a checkpoint written where one applied
# loads where it does not): the running optimizer's values stay. Every other flag must be the running one's.
_IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _finite_number(v: Any) -> bool:
    """A JSON number no optimizer writes as NaN or inf (Python's json reads ``NaN`` and ``Infinity``)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_flag(v: Any) -> bool:
    """A param-group value that switches behaviour: a bool, or None (not set: ``foreach``, ``fused``)."""
    return isinstance(v, bool) or v is None


def _same_kind(cur: Any, saved: Any) -> bool:
    """Whether ``saved`` (a param-group value read from JSON) can stand for ``cur`` (the running optimizer's)."""
    number = _finite_number

    if isinstance(cur, torch.Tensor):
        return cur.numel() == 1 and number(saved)
    if isinstance(cur, bool) or cur is None:  # a flag; None: not set (foreach, fused), a saved flag may set it
        return saved is None or isinstance(saved, bool)
    if isinstance(cur, (int, float)):
        return number(saved)
    if isinstance(cur, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(cur) and all(map(_same_kind, cur, saved))
    if isinstance(cur, str):
        return isinstance(saved, str)
    return True  # a kind this check does not know: as before, taken as saved


# ------------------------------------------------------------------------------------------------------------ save
def save_sharded(directory: str | os.PathLike[str], model_sd: Mapping[str, Any], optim_sd: Mapping[str, Any],
                 *, device: torch.device, engine_state: Mapping[str, Any]) -> None:
    """Write this rank's shards, then (rank 0) ``engine_state.json`` and ``index.json``. Collective.

    ``model_sd``/``optim_sd`` come from ``torch.distributed.checkpoint.state_dict.get_state_dict`` (sharded
    DTensors, optimizer state keyed by parameter name); ``engine_state`` is JSON-able (step, config...). A rank
    that cannot write its part (a full disk) makes every rank raise :class:`CheckpointError` together, the failing
    one naming its cause; no rank is left waiting in a collective.
    """
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    os.makedirs(directory, exist_ok=True)
    entries, scalars = _flatten(model_sd, optim_sd)
    groups = [_jsonable_group(g) for g in optim_sd.get("param_groups", [])]  # fails on every rank, before any write
    try:
        if rank == 0:  # a checkpoint saved here before stops being one before any of its files is overwritten:
            # a save that dies halfway leaves no index (refused), never the old one over new shards and state
            for name in (INDEX, STATE):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, name))
    except Exception as e:  # noqa: BLE001 - every rank raises together (below), this one naming its cause
        _agree_written(e, directory, device)
    _agree_written(None, directory, device)  # (also the barrier: no rank writes before the index is gone)
    stored: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}}
    local: dict[str, dict[str, Any]] = {}
    for key, t in entries.items():
        placement, piece = _placement(t)
        local[key] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "placement": placement,
                      "local_shape": list(piece.shape)}
        if placement["kind"] == "shard" or rank == 0:
            # a private contiguous CPU copy: tied weights share storage, which safetensors refuses
            stored[key.split("/", 1)[0]][key] = piece.detach().to("cpu", copy=True).contiguous()
    files: dict[str, dict[str, Any]] = {}
    try:
        for kind, tensors in stored.items():
            name = _shard_file(kind, rank, world)
            path = os.path.join(directory, name)
            save_file(tensors, path, metadata={"format": FORMAT, "rank": str(rank), "world_size": str(world)})
            size, digest = sha256_file(path)
            files[name] = {"bytes": size, "sha256": digest}
    except Exception as e:  # a rank that cannot write (a full disk, a read-only mount) fails every rank here
        _agree_written(e, directory, device)
    _agree_written(None, directory, device)
    infos = _all_gather_json({"rank": rank, "files": files, "tensors": {k: v["local_shape"] for k, v in local.items()},
                              "rng": _rng_state(device)}, device)
    index_tensors: dict[str, Any] = {}  # built on every rank: a bad layout fails on all of them together
    for key, meta in local.items():
        shape, placement = meta["shape"], meta["placement"]
        shards = []
        if placement["kind"] == "shard":
            d, start = placement["dim"], 0
            for info in infos:
                piece = info["tensors"][key]
                offset = [0] * len(shape)
                offset[d] = start
                shards.append({"rank": info["rank"], "file": _shard_file(key.split("/", 1)[0], info["rank"], world),
                               "offset": offset, "shape": piece})
                start += piece[d]
            if start != shape[d]:
                raise CheckpointError(f"{key}: local shards add up to {start} rows along dim {d}, the tensor has "
                                      f"{shape[d]}; this sharding is not a contiguous split")
        else:
            shards.append({"rank": 0, "file": _shard_file(key.split("/", 1)[0], 0, world),
                           "offset": [0] * len(shape), "shape": shape})
        index_tensors[key] = {"shape": shape, "dtype": meta["dtype"], "placement": placement, "shards": shards}
    try:
        if rank == 0:
            all_files = {name: f for info in infos for name, f in info["files"].items()}
            state = {"format": FORMAT, "world_size": world, **engine_state,
                     "optimizer": {"param_groups": groups, "scalars": scalars},
                     "rng": [info["rng"] for info in infos]}
            write_json_atomic(os.path.join(directory, STATE), state)
            write_json_atomic(os.path.join(directory, INDEX),
                              {"format": FORMAT, "world_size": world, "files": all_files, "tensors": index_tensors},
                              indent=1)
    except Exception as e:  # as above; the agreement is also the barrier: no rank returns before the index exists
        _agree_written(e, directory, device)
    _agree_written(None, directory, device)


def _agree_written(error: Exception | None, directory: str, device: torch.device) -> None:
    """Every rank learns which ranks could not write their part of a checkpoint, so that all of them raise
    :class:`CheckpointError` together and none waits in the save's next collective (for the process group's
    timeout); the engine stays usable. The failing rank's error names its cause, the others' name the ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = failed_ranks(error is not None, device)
    if error is not None:
        raise agreed(CheckpointError(f"{directory}: rank {rank} could not write its part of the checkpoint ({error}); "
                                     f"the checkpoint is incomplete: do not load it")) from error
    if ranks:
        raise agreed(CheckpointError(f"{directory}: rank(s) {ranks} could not write their part of the checkpoint "
                                     f"(their errors say why); the checkpoint is incomplete: do not load it"))


# ------------------------------------------------------------------------------------------------------------ load
def _agree(error: BaseException | None, directory: str, device: torch.device) -> None:
    """Every rank learns whether any rank found the checkpoint unusable, so that all ranks load or none does
    (and none waits forever in a later collective). Ranks without an error of their own raise one that says so."""
    if failed_ranks(error is not None, device) and error is None:
        raise agreed(CheckpointError(f"{directory}: another rank found this checkpoint unusable (its error names the "
                                     f"file); nothing was loaded"))
    if error is not None:  # this rank raises its own error next, as every other rank raises one
        agreed(error)


# The settings of a model's config that change what the same weights compute: a checkpoint of a model that differs
# in one of them has tensors of the same names and shapes, and would load into this one without any other sign.
_ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rope_theta", "rope_scaling",
                 "rope_parameters", "layer_types",
                 "rms_norm_eps", "layer_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias",
                 "use_sliding_window", "sliding_window", "num_labels", "partial_rotary_factor")


def model_record(model: torch.nn.Module, kind: str) -> dict[str, Any]:
    """What a checkpoint records of its model beyond its tensors: its kind ("causal_lm", "value") and the settings
    of its config (a transformers model's ``config``) that change what the same weights compute (``_ARCHITECTURE``)."""
    cfg = getattr(model, "config", None)
    values = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    return json.loads(json.dumps({"kind": kind, "config": {k: values[k] for k in _ARCHITECTURE if k in values}},
                                 default=str))  # (as it reads back: a tuple as a list)


def _check_model(spath: str, saved: Any, running: Mapping[str, Any] | None) -> None:
    """Refuse a checkpoint whose model record (``model_record``) differs from the running model's in its kind or in
    a setting both record; a checkpoint written before the record existed is checked by its tensors alone."""
    if running is None or saved is None:
        return
    _expect(isinstance(saved, dict) and isinstance(saved.get("config"), dict), spath,
            "'model' must be an object holding a 'config' object")
    diffs = [f"kind {saved.get('kind')!r}, this engine's {running['kind']!r}"] if saved.get("kind") != running["kind"] \
        else []
    mine = running["config"]
    diffs += [f"{k} {saved['config'][k]!r}, this engine's {mine[k]!r}" for k in _ARCHITECTURE
              if k in saved["config"] and k in mine and saved["config"][k] != mine[k]]
    if diffs:
        raise CheckpointError(f"{spath}: the checkpoint holds another model than this engine's, whose tensors have "
                              f"the same names and shapes ({'; '.join(diffs)}): loaded, its weights would compute "
                              f"something else. Build the model with the checkpoint's settings to load it")


def _expect(cond: bool, path: str, what: str) -> None:
    if not cond:
        raise CheckpointError(f"{path}: {what}; the file is corrupt or was not written by this version of orchestra")


def _some(names: set[str] | list[str], n: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _check_index(directory: str, index: Any, state: Any, entries: Mapping[str, torch.Tensor],
                 scalars: Mapping[str, Mapping[str, Any]], optim_sd: Mapping[str, Any]) -> None:
    """The saved layout matches the running model and optimizer (names, shapes, dtypes, groups)."""
    ipath, spath = os.path.join(directory, INDEX), os.path.join(directory, STATE)
    _expect(isinstance(index, dict) and index.get("format") == FORMAT, ipath,
            f"not an {FORMAT} index (format {index.get('format') if isinstance(index, dict) else None!r})")
    _expect(isinstance(index.get("tensors"), dict) and isinstance(index.get("files"), dict), ipath,
            "no 'tensors'/'files' tables")
    _expect(isinstance(state, dict) and state.get("format") == FORMAT, spath, f"not an {FORMAT} engine state")
    _expect(_natural(state.get("global_step")), spath,
            f"'global_step' is {state.get('global_step')!r:.100}, not a natural number")
    for name, f in index["files"].items():
        _expect(isinstance(name, str) and os.path.basename(name) == name and not name.startswith("."), ipath,
                f"file name {name!r} is not a plain file name")
        _expect(isinstance(f, dict) and _natural(f.get("bytes")) and isinstance(f.get("sha256"), str), ipath,
                f"the entry of file {name} is {f!r:.200}, not {{'bytes': <natural number>, 'sha256': <hex>}}")
    saved, current = set(index["tensors"]), set(entries)
    if saved != current:
        raise CheckpointError(
            f"{ipath} does not match the model being loaded: missing {_some(current - saved) or 'nothing'}; "
            f"unexpected {_some(saved - current) or 'nothing'}. The checkpoint was written for another model "
            f"(or optimizer); load it into the model it was saved from")
    for key, t in entries.items():
        e = index["tensors"][key]
        _expect(isinstance(e, dict) and isinstance(e.get("shards"), list), ipath, f"{key} has no shard list")
        if list(e.get("shape", [])) != list(t.shape) or e.get("dtype") != _dtype_name(t.dtype):
            raise CheckpointError(f"{key}: the checkpoint has shape {e.get('shape')} {e.get('dtype')}, the model "
                                  f"being loaded has {list(t.shape)} {_dtype_name(t.dtype)} ({ipath}); load it into "
                                  f"the model it was saved from")
        _check_tiling(ipath, key, list(t.shape), e["shards"], index["files"])
    opt = state.get("optimizer")
    _expect(isinstance(opt, dict) and isinstance(opt.get("scalars"), dict)
            and isinstance(opt.get("param_groups"), list), spath, "no optimizer state")
    _expect(all(isinstance(st, dict) for st in opt["scalars"].values()), spath, "malformed optimizer scalars")
    saved_scalars = {f"{fqn}/{n}" for fqn, st in opt["scalars"].items() for n in st}
    cur_scalars = {f"{fqn}/{n}" for fqn, st in scalars.items() for n in st}
    if saved_scalars != cur_scalars:
        missing, unexpected = _some(cur_scalars - saved_scalars), _some(saved_scalars - cur_scalars)
        raise CheckpointError(f"{spath}: optimizer scalar state differs: missing {missing or 'nothing'}; unexpected "
                              f"{unexpected or 'nothing'}; was it saved with another optimizer?")
    for fqn, st in opt["scalars"].items():
        for n, v in st.items():
            value = v.get("value") if isinstance(v, dict) else None
            _expect(_finite_number(value), spath, f"optimizer scalar {fqn}/{n} is {value!r:.100}, not a finite number")
            # Adam's step counts updates: a NaN, negative or fractional one breaks its bias correction silently
            _expect(n != "step" or (value >= 0 and float(value).is_integer()), spath,
                    f"optimizer scalar {fqn}/{n} is {value!r:.100}, not a whole number of steps")
    groups = optim_sd.get("param_groups", [])
    saved_params = [g.get("params") if isinstance(g, dict) else None for g in opt["param_groups"]]
    if saved_params != [list(g["params"]) for g in groups]:
        raise CheckpointError(f"{spath}: the optimizer param groups hold other parameters than the running "
                              f"optimizer's; was it saved with another model or optimizer?")
    for i, (group, saved) in enumerate(zip(groups, opt["param_groups"])):
        for k, v in saved.items():
            if k == "params" or k not in group:
                continue
            if not _same_kind(group[k], v):
                raise CheckpointError(f"{spath}: optimizer param group {i}'s {k!r} is {v!r:.100}, which cannot "
                                      f"stand for the running optimizer's {group[k]!r:.100}; the file is corrupt or "
                                      f"was written by another optimizer")
            if _is_flag(group[k]) and k not in _IMPLEMENTATION_FLAGS and v != group[k]:
                raise CheckpointError(f"{spath}: optimizer param group {i}'s {k!r} is {v!r}, the running optimizer's "
                                      f"is {group[k]!r}: the flag changes the update rule (and the state it keeps); "
                                      f"the file was changed, or written by an optimizer configured otherwise. Load "
                                      f"it into an engine configured as the one that saved it")


def _natural(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _box(lo: list[int], hi: list[int]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi)) + "]"


def _split_along_one_dim(shape: list[int], shards: list[Mapping[str, Any]]) -> bool:
    """True when the (in-bounds) ``shards`` tile ``shape`` exactly as a split along one dimension, the layout
    :func:`save_sharded` writes: one sort, where the general check below needs a grid. False: not shown."""
    live = [s for s in shards if all(n > 0 for n in s["shape"])]  # an empty shard (more ranks than rows) holds nothing
    if math.prod(shape) == 0:
        return True
    split = {d for s in live for d, size in enumerate(shape) if (s["offset"][d], s["shape"][d]) != (0, size)}
    if not split:
        return len(live) == 1
    if len(split) > 1:
        return False
    d = split.pop()
    end = 0
    for s in sorted(live, key=lambda s: s["offset"][d]):
        if s["offset"][d] != end:
            return False
        end += s["shape"][d]
    return end == shape[d]


_MAX_CELLS = 1 << 22  # a layout our writer makes has one cell per shard; an index with more is refused, not checked


def _check_tiling(ipath: str, key: str, shape: list[int], shards: list[Any], files: Mapping[str, Any]) -> None:
    """The shards of ``key`` (a tensor of ``shape``) lie inside it and cover each of its elements exactly once,
    each from a file of the index, and no file twice (a file holds one piece of each tensor). A shard that overlaps
    another or a hole would load another shard's values or keep the template's, silently."""
    ndim = len(shape)
    seen: dict[str, list[int]] = {}
    for s in shards:
        ok = (isinstance(s, dict) and isinstance(s.get("file"), str) and s["file"] in files
              and isinstance(s.get("offset"), list) and isinstance(s.get("shape"), list)
              and len(s["offset"]) == ndim == len(s["shape"]) and all(map(_natural, s["offset"] + s["shape"])))
        _expect(ok, ipath, f"{key} has a malformed shard entry {s!r} (want 'file' one of the index's files, "
                           f"'offset' and 'shape' lists of {ndim} natural numbers)")
        if any(o + n > size for o, n, size in zip(s["offset"], s["shape"], shape)):
            raise CheckpointError(f"{ipath}: {key}: the shard in {s['file']} at offset {s['offset']} shape "
                                  f"{s['shape']} reaches outside the tensor, whose shape is {shape}; the index is "
                                  f"corrupt: restore it or use another checkpoint")
        if s["file"] in seen:
            raise CheckpointError(f"{ipath}: {key}: {s['file']} is listed twice, at offsets {seen[s['file']]} and "
                                  f"{s['offset']}, but a file holds one piece of each tensor; the index is corrupt: "
                                  f"restore it or use another checkpoint")
        seen[s["file"]] = s["offset"]
    if _split_along_one_dim(shape, shards):
        return
    # count, on the grid cut at every shard boundary, how many shards hold each cell: every cell must be held once
    cuts = [sorted({0, size} | {o for s in shards for o in (s["offset"][d], s["offset"][d] + s["shape"][d])})
            for d, size in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > _MAX_CELLS:
        raise CheckpointError(f"{ipath}: {key} is split into {len(shards)} shards that cut it into more than "
                              f"{_MAX_CELLS} pieces; orchestra never writes such a layout: the index is corrupt")
    held = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    at = [{v: i for i, v in enumerate(c)} for c in cuts]
    for s in shards:
        held[tuple(slice(a[o], a[o + n]) for a, o, n in zip(at, s["offset"], s["shape"]))] += 1
    if bool((held == 1).all()):
        return

    def cell(where: torch.Tensor) -> tuple[list[int], list[int]]:
        idx = where.nonzero()[0].tolist()
        return [c[i] for c, i in zip(cuts, idx)], [c[i + 1] for c, i in zip(cuts, idx)]

    problems = []
    if bool((held > 1).any()):
        lo, hi = cell(held > 1)
        owners = [f"{s['file']} at offset {s['offset']} shape {s['shape']}" for s in shards
                  if all(o <= a and b <= o + n for a, b, o, n in zip(lo, hi, s["offset"], s["shape"]))]
        problems.append(f"elements {_box(lo, hi)} are in {len(owners)} shards ({'; '.join(owners)})")
    if bool((held == 0).any()):
        lo, hi = cell(held == 0)
        problems.append(f"elements {_box(lo, hi)} are in no shard")
    raise CheckpointError(f"{ipath}: the shards of {key} (shape {shape}) do not cover each element exactly once: "
                          f"{'; '.join(problems)}. The index is corrupt: restore it or use another checkpoint")


class _Shards:
    """The index's shard files, each read once, whole, on first use: its size and (``verify``) sha256 are checked on
    the very bytes its tensors are parsed from, so a file renamed over or rewritten after the check cannot slip
    other bytes in, and one truncated later cannot fault a memory map."""

    def __init__(self, directory: str, files: Mapping[str, Mapping[str, Any]], verify: bool) -> None:
        self.directory, self.files, self.verify = directory, files, verify
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}

    def get(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors of file ``name`` (read, checked against the index and parsed on first use)."""
        if name not in self._tensors:
            path = os.path.join(self.directory, name)
            data = read_checked(path, dict(self.files[name]), "the index", verify=self.verify)
            self._tensors[name] = _parse_safetensors(path, data)
        return self._tensors[name]

    def check(self, name: str, key: str, shape: list[int], dtype: torch.dtype) -> None:
        """File ``name`` (verified, parsed) holds ``key`` with the index's shape and the model's dtype."""
        tensors = self.get(name)
        path = os.path.join(self.directory, name)
        if key not in tensors:
            raise CheckpointError(f"{path} has no tensor {key}, the index says it does; the file was replaced")
        t = tensors[key]
        if (list(t.shape), t.dtype) != (list(shape), dtype):
            raise CheckpointError(f"{path}: {key} is {list(t.shape)} {t.dtype}, expected {list(shape)} {dtype} from "
                                  f"the index and the model; the file was replaced")

    def retain(self, needed: set[tuple[str, str]]) -> None:
        """Drop the parsed tensors no ``(file, key)`` of ``needed`` names (a file holds other ranks' pieces too)."""
        for name, tensors in self._tensors.items():
            for key in [k for k in tensors if (name, k) not in needed]:
                del tensors[key]

    def read(self, name: str, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """``box`` of tensor ``key`` from file ``name`` (already checked)."""
        return self._tensors[name][key][box]


def _boxes(local_offset: list[int], local_shape: list[int], shards: list[Mapping[str, Any]]
           ) -> Iterator[tuple[Mapping[str, Any], tuple[slice, ...], tuple[slice, ...]]]:
    """For each saved shard overlapping the local box: (shard, slice into the shard, slice into the local tensor)."""
    for s in shards:
        src, dst = [], []
        for lo, n, so, sn in zip(local_offset, local_shape, s["offset"], s["shape"]):
            a, b = max(lo, so), min(lo + n, so + sn)
            if a >= b:
                break
            src.append(slice(a - so, b - so))
            dst.append(slice(a - lo, b - lo))
        else:
            yield s, tuple(src), tuple(dst)


def load_sharded(directory: str | os.PathLike[str], model_sd: Mapping[str, Any], optim_sd: Mapping[str, Any],
                 *, device: torch.device, verify: bool = True,
                 model: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Fill ``model_sd``/``optim_sd`` (templates from ``get_state_dict``, this rank's sharding) in place from
    a :func:`save_sharded` directory written by any number of ranks; returns the saved engine state. Collective.

    Every check (JSON, index vs model, the shards' tiling, sizes and sha256 when ``verify``, safetensors headers,
    the kinds of the saved param-group values, this rank's RNG state, and — given ``model``, the running model's
    :func:`model_record` — that the checkpoint's model is this one) runs before any tensor of the templates is
    written, and on every rank; a failure raises :class:`CheckpointError`, and any failure there on one rank fails
    every rank.
    """
    directory = os.fspath(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    entries, scalars = _flatten(model_sd, optim_sd)
    locals_: dict[str, torch.Tensor] = {}
    placements: dict[str, dict[str, Any]] = {}
    for key, t in entries.items():
        placements[key], locals_[key] = _placement(t)
    index = state = None
    try:
        index = read_json(os.path.join(directory, INDEX))
        state = read_json(os.path.join(directory, STATE))
        _check_index(directory, index, state, entries, scalars, optim_sd)
        _check_model(os.path.join(directory, STATE), state.get("model"), model)
        rng = _rng_to_restore(os.path.join(directory, STATE), state, rank, world, device)
    except Exception as e:  # any rank's failure, of any type, fails every rank here (none waits in a collective)
        _agree(e, directory, device)
        raise
    _agree(None, directory, device)
    shapes = _all_gather_json({k: list(v.shape) for k, v in locals_.items()}, device)
    shards = _Shards(directory, index["files"], verify)
    plan: list[tuple[torch.Tensor, tuple[slice, ...], str, str, tuple[slice, ...]]] = []
    try:  # pass 1: read (and verify) every file this rank needs, check headers
        for key, dst in locals_.items():
            placement = placements[key]
            offset = [0] * dst.dim()
            if placement["kind"] == "shard":
                d = placement["dim"]
                offset[d] = sum(shapes[r][key][d] for r in range(rank))
            # _check_index made sure the shards tile the tensor: those overlapping this rank's box tile the box
            for s, src, where in _boxes(offset, list(dst.shape), index["tensors"][key]["shards"]):
                shards.check(s["file"], key, s["shape"], dst.dtype)
                plan.append((dst, where, s["file"], key, src))
    except Exception as e:  # as above
        _agree(e, directory, device)
        raise
    _agree(None, directory, device)
    shards.retain({(name, key) for _, _, name, key, _ in plan})
    with torch.no_grad():  # pass 2: every check passed, copy the overlapping parts into the templates
        for dst, where, name, key, src in plan:
            dst[where].copy_(shards.read(name, key, src))
    saved_scalars = state["optimizer"]["scalars"]
    for fqn, st in optim_sd.get("state", {}).items():
        for name, v in list(st.items()):
            if fqn in scalars and name in scalars[fqn]:
                value = saved_scalars[fqn][name]["value"]
                if isinstance(v, torch.Tensor):
                    v.fill_(value)
                else:
                    st[name] = type(v)(value)
    for group, saved in zip(optim_sd.get("param_groups", []), state["optimizer"]["param_groups"]):
        for k, v in saved.items():
            if k == "params" or k not in group or _is_flag(group[k]):  # flags: checked equal, or the running one's
                continue
            cur = group[k]
            if isinstance(cur, tuple):
                v = tuple(v)
            elif isinstance(cur, torch.Tensor):
                cur.fill_(v)
                continue
            group[k] = v
    if rng is not None:
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
    else:
        log.info("checkpoint %s was written by %s ranks, this run has %s: model and optimizer state are resharded; "
                 "per-rank RNG state is not restored", directory, state.get("world_size"), world)
    return state
