"""Spawned-rank bodies for the checkpoint tests (a module of its own so child processes can import them)."""

from __future__ import annotations

import torch
from engines_testutils import make_batch, model_factory, split_rows, token_mean_loss

from engines.fsdp import EngineConfig, FSDPEngine


def local_rows(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous share of ``batch``."""
    a, b = split_rows(next(iter(batch.values())).shape[0], world, rank)
    return {k: v[a:b] for k, v in batch.items()}


def engine_snapshot(eng: FSDPEngine) -> dict[str, object]:
    """Everything a checkpoint must restore, gathered to full tensors on every rank: weights, Adam moments and
    step counts, param-group hyperparameters, the engine step and its learning rate."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(eng.model, eng.optimizer, options=opts)
    optim_state = {f"{fqn}/{k}": (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                   for fqn, st in optim_sd["state"].items() for k, v in st.items()}
    # a group's "lr" is whatever the last step used; train_step sets it from the schedule (compared as "lr")
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optim_sd["param_groups"]]
    return {"model": {k: v.detach().clone() for k, v in model_sd.items()}, "optim": optim_state,
            "groups": groups, "step": eng.global_step, "lr": eng.lr}


def save_then_load_worker(rank: int, world: int, cfg: EngineConfig, ckpt_dir: str) -> dict[str, object]:
    """Train A two steps and save; B (another init seed) loads. Returns both snapshots and one more step of each."""
    batch = local_rows(make_batch(B=6, seed=11), rank, world)
    a = FSDPEngine(model_factory(0), cfg)
    for _ in range(2):
        a.train_step(batch, token_mean_loss)
    a.save(ckpt_dir)
    b = FSDPEngine(model_factory(3), cfg)
    b.load(ckpt_dir)
    snap_a, snap_b = engine_snapshot(a), engine_snapshot(b)
    ma, mb = a.train_step(batch, token_mean_loss), b.train_step(batch, token_mean_loss)
    after_a, after_b = engine_snapshot(a), engine_snapshot(b)
    return {"saved": snap_a, "loaded": snap_b, "metrics": (ma, mb), "after": (after_a["model"], after_b["model"])}


class Payload:
    """Unpickling this creates ``marker``: the stand-in for an attacker's code."""

    def __init__(self, marker: str) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def payload_worker(rank: int, world: int, marker: str) -> Payload:
    """A spawned rank whose result would run code if the parent unpickled it."""
    return Payload(marker)


def load_error_worker(rank: int, world: int, cfg: EngineConfig, ckpt_dir: str) -> dict[str, object]:
    """Load a checkpoint expected to fail; returns this rank's error message and whether its weights changed."""
    from engines.checkpoint import CheckpointError

    eng = FSDPEngine(model_factory(2), cfg)
    before = engine_snapshot(eng)["model"]
    try:
        eng.load(ckpt_dir)
    except CheckpointError as e:
        error = str(e)
    else:
        error = None
    after = engine_snapshot(eng)["model"]
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "step": eng.global_step}
