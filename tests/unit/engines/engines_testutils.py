"""Helpers for the engine tests: a fixed random batch, losses, a reference step.

Kept in its own module (not a test file) so spawned ranks can import the worker functions.
"""

from __future__ import annotations

import torch

from engines.fsdp import EngineConfig, lr_factor
from engines.models import build_causal_lm, tiny_qwen2_config

VOCAB = 64


def make_batch(B: int = 7, P: int = 6, R: int = 8, seed: int = 0, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses with varied lengths, random ids >= 3."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (B, P), generator=g)
    responses = torch.randint(3, vocab, (B, R), generator=g)
    p_len = torch.randint(1, P + 1, (B,), generator=g)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    pm = (torch.arange(P)[None] >= (P - p_len)[:, None]).long()
    rm = (torch.arange(R)[None] < r_len[:, None]).long()
    prompts = prompts * pm
    responses = responses * rm
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([pm, rm], 1),
        "response_mask": rm,
        "advantages": torch.randn(B, R, generator=g),
    }


def model_factory(seed: int = 0):
    return lambda: build_causal_lm(tiny_qwen2_config(VOCAB), seed=seed)


def token_mean_loss(outputs, mb):
    """A policy-gradient-like loss: token-mean of -adv * logp, plus an entropy metric."""
    m = mb["response_mask"].float()
    loss = -(mb["advantages"] * outputs["log_probs"] * m).sum() / m.sum()
    metrics = {"entropy": (outputs["entropy"] * m).sum() / m.sum()} if "entropy" in outputs else {}
    return loss, metrics


def row_mean_loss(outputs, mb):
    """Row-mean of each row's token-mean (for loss_scale='rows')."""
    m = mb["response_mask"].float()
    per_row = -(mb["advantages"] * outputs["log_probs"] * m).sum(-1) / m.sum(-1)
    return per_row.mean(), {}


def ref_log_probs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """Unsharded reference: log-probs of the response tokens, masked."""
    am = batch["attention_mask"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    R = batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=am, position_ids=pos, use_cache=False).logits
    logits = logits[:, -R - 1 : -1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    return lp * batch["response_mask"]


def reference_steps(cfg: EngineConfig, batch, steps: int, seed: int = 0, scale: str = "tokens"):
    """Plain AdamW on the unsharded model, full batch, same clip and schedule as the engine."""
    model = build_causal_lm(tiny_qwen2_config(VOCAB), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    losses = []
    for s in range(steps):
        for gr in opt.param_groups:
            gr["lr"] = cfg.lr * lr_factor(cfg, s)
        lp = ref_log_probs(model, batch)
        outputs = {"log_probs": lp}
        loss, _ = (token_mean_loss if scale == "tokens" else row_mean_loss)(outputs, batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def split_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous, as-even-as-possible DP split (first ranks get the extra rows)."""
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _local(batch, rank: int, world: int):
    a, b = split_rows(next(iter(batch.values())).shape[0], world, rank)
    return {k: v[a:b] for k, v in batch.items()}, (a, b)


def fsdp_parity_worker(rank: int, world: int, cfgs: list[EngineConfig], batch, steps: int):
    """Spawned rank, per config: log-probs of its rows, `steps` train steps, full state dict."""
    from engines.fsdp import FSDPEngine

    results = []
    for cfg in cfgs:
        eng = FSDPEngine(model_factory(0), cfg)
        local, rows = _local(batch, rank, world)
        out = eng.compute_log_prob(local, with_entropy=True)
        metrics = [eng.train_step(local, token_mean_loss) for _ in range(steps)]
        results.append({
            "rows": rows,
            "log_probs": out["log_probs"],
            "entropy": out["entropy"],
            "metrics": metrics,
            "state": eng.full_state_dict(),
            "dp": (eng.dp_rank, eng.dp_size, eng.is_collector),
        })
    return results


def save_load_worker(rank: int, world: int, cfg: EngineConfig, batch, ckpt_dir: str):
    """Spawned rank: train A one step and save; B (other seed) loads; one more step on both."""
    from engines.fsdp import FSDPEngine

    local, _ = _local(batch, rank, world)
    a = FSDPEngine(model_factory(0), cfg)
    a.train_step(local, token_mean_loss)
    a.save(ckpt_dir)
    b = FSDPEngine(model_factory(1), cfg)
    b.load(ckpt_dir)
    loaded_equal = None
    sa, sb = a.full_state_dict(), b.full_state_dict()
    if rank == 0:
        loaded_equal = all(torch.equal(sa[k], sb[k]) for k in sa)
    ma = a.train_step(local, token_mean_loss)
    mb = b.train_step(local, token_mean_loss)
    sa, sb = a.full_state_dict(), b.full_state_dict()
    max_diff = max(float((sa[k] - sb[k]).abs().max()) for k in sa) if rank == 0 else None
    return {
        "loaded_equal": loaded_equal,
        "max_diff_after_step": max_diff,
        "metrics": (ma, mb),
        "step": b.global_step,
    }


def parity_and_save_load_worker(rank: int, world: int, parity: tuple, save_load: tuple):
    """Spawned rank: ``fsdp_parity_worker(*parity)`` then ``save_load_worker(*save_load)`` in the same processes (a
    spawn costs a fresh torch process per rank, so the two 2-rank tests share one)."""
    return fsdp_parity_worker(rank, world, *parity), save_load_worker(rank, world, *save_load)


def assert_states_close(state, ref_state, rel: float = 1e-5) -> None:
    """Every tensor within `rel` norm-wise relative error, except the attention key biases.

    d loss / d k_proj.bias is exactly 0 in exact arithmetic (q.(k + b) shifts all logits of a
    query by the same amount and softmax ignores it), so its gradient is rounding noise and
    Adam's first updates of it (noise / (|noise| + eps), i.e. about +-lr) differ between any
    two summation orders: there is nothing meaningful to compare.
    """
    assert set(state) == set(ref_state)
    for k, v in ref_state.items():
        if k.endswith("k_proj.bias"):
            continue
        err = rel_err(state[k], v)
        assert err < rel, f"{k}: relative error {err:.2e} >= {rel:.0e}"


def process_report_worker(rank: int, world: int, names: list[str]) -> dict[str, str]:
    """What a spawned rank sees of how it started: its start method, the named environment variables, whether a
    module attribute the parent set (``engines._dist.parent_only``) reached it, and a draw from each global random
    generator (torch, numpy, Python)."""
    import multiprocessing
    import os

    import engines._dist as dist_mod

    import random

    import numpy as np

    return {"start_method": multiprocessing.get_start_method(), "rank": os.environ["RANK"],
            "parent_only": str(getattr(dist_mod, "parent_only", "")),
            "draws": f"{torch.rand(1).item()} {np.random.rand()} {random.random()}",
            **{f"env:{n}": os.environ.get(n, "") for n in names}}


def dies_without_a_word(rank: int, world: int) -> None:
    """A rank that ends its process at once: no result file, no traceback."""
    import os

    os._exit(3)


def _listening_ips() -> list[str]:
    """The addresses this process's TCP sockets listen on (Linux: its socket inodes matched in /proc/net/tcp{,6})."""
    import os
    import socket

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ips = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(local.split(":")[0])  # 32-bit words in host (little-endian) order
                ips.add(socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return sorted(ips)


def listening_addresses_worker(rank: int, world: int) -> dict:
    """Join the default process group as an engine does (``init_distributed``), run one all-reduce, and report the
    addresses this process listens on meanwhile (the rendezvous store's on rank 0, gloo's on every rank)."""
    import os

    import torch.distributed as dist

    from engines._dist import init_distributed

    init_distributed(torch.device("cpu"))
    t = torch.ones(1)
    dist.all_reduce(t)
    listening = _listening_ips()
    dist.barrier()  # nobody leaves (closing its listeners) before every rank looked
    return {"sum": t.item(), "listening": listening, "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def plain_bind_refused_worker(rank: int, world: int) -> bool:
    """Whether a plain bind (no SO_REUSEADDR, as most programs do) of ``MASTER_PORT`` is refused now."""
    import os
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        except OSError:
            return True
    return False
