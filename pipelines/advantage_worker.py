"""Algorithm-side helper workers: advantage estimation next to the reward, on the CPU pool, and DAPO's gather of
the kept rollout rows (read worker to worker, so that no row passes through the controller)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D

from .algorithms import apply_kl_penalty, discounted_returns, gae_advantages, kl_penalty

__all__ = ["AdvantageWorker", "gather_groups", "left_pad_prompts"]

_PROMPT_COLUMNS = ("prompts", "input_ids", "attention_mask")  # the prompt is the left part of these


def left_pad_prompts(batch: Batch, width: int, pad_id: int) -> Batch:
    """``batch`` with its prompt part left-padded to ``width`` tokens (pad in ``prompts``/``input_ids``, 0 in
    ``attention_mask``), so that rounds with different prompt widths concatenate; positions come from the mask."""
    have = batch["prompts"].shape[1]
    if have > width:
        raise ValueError(f"left_pad_prompts: prompts are {have} wide, more than width={width}")
    if have == width:
        return batch
    cols = {k: torch.nn.functional.pad(batch[k], (width - have, 0), value=0 if k == "attention_mask" else pad_id)
            for k in _PROMPT_COLUMNS if k in batch}
    return batch | Batch.from_dict(cols)


def _concat(parts: list[Batch], pad_id: int) -> Batch:
    width = max(p["prompts"].shape[1] for p in parts)
    return Batch.concat([left_pad_prompts(p, width, pad_id) for p in parts])


def gather_groups(rounds: Sequence[Batch], picks: Sequence[tuple[int, Sequence[int]]], pad_id: int = 0) -> Batch:
    """Rows ``picks`` = ``[(round, row indices), ...]`` of ``rounds``, concatenated in that order, prompts
    left-padded to the widest piece (rounds may sample prompts of different widths). Runs where the rows are read
    (``AdvantageWorker.gather_groups``), never in the controller."""
    pieces = []
    for r, rows in picks:
        if not 0 <= r < len(rounds):
            raise IndexError(f"gather_groups: round {r} of {len(rounds)}")
        if len(rows):
            pieces.append(rounds[r][list(rows)])
    if not pieces:
        raise ValueError("gather_groups: no rows picked; the update needs at least one group")
    return _concat(pieces, pad_id)


class AdvantageWorker(Worker):
    """GAE, REINFORCE++ returns and batch moments, computed on the workers that already hold the rows (no
    controller round trip)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)

    @endpoint(D.shard(), requires=["token_level_scores", "values", "response_mask"])
    def gae(self, batch: Batch, gamma: float = 1.0, lam: float = 1.0, kl_coef: float = 0.0,
            kl_estimator: str = "k1") -> Batch:
        """Token rewards (scores, minus ``kl_coef`` x KL to the reference when set), then GAE advantages/returns."""
        mask = batch["response_mask"]
        rewards = batch["token_level_scores"].float()
        if kl_coef:
            kl = kl_penalty(batch["old_log_probs"].float(), batch["ref_log_probs"].float(), kl_estimator)
            rewards = apply_kl_penalty(rewards, kl, kl_coef, mask)
        adv, ret = gae_advantages(rewards, batch["values"].float(), mask, gamma=gamma, lam=lam)
        return Batch.from_dict({"advantages": adv, "returns": ret})

    @endpoint(D.shard(), requires=["token_level_scores", "response_mask"])
    def reinforce_pp(self, batch: Batch, gamma: float = 1.0, kl_coef: float = 0.0,
                     kl_estimator: str = "k1") -> Batch:
        """REINFORCE++ before whitening: token rewards (scores, minus ``kl_coef`` x KL to the reference when set),
        then the discounted return of each token as its advantage. The step whitens with :meth:`moments`."""
        mask = batch["response_mask"]
        rewards = batch["token_level_scores"].float()
        if kl_coef:
            kl = kl_penalty(batch["old_log_probs"].float(), batch["ref_log_probs"].float(), kl_estimator)
            rewards = apply_kl_penalty(rewards, kl, kl_coef, mask)
        return Batch.from_dict({"advantages": discounted_returns(rewards, mask, gamma)})

    @endpoint(D.broadcast() | D.rank_zero())
    def gather_groups(self, *rounds: Batch, picks: list[tuple[int, list[int]]], pad_id: int = 0) -> Batch:
        """DAPO's kept rows: ``picks`` (round, row indices) of the rollout rounds, read here from the rollout
        workers and concatenated (see ``gather_groups``); the update reads the result
        from this rank."""
        return gather_groups(rounds, picks, pad_id)

    @endpoint(D.shard(), requires=["response_mask"])
    def response_lengths(self, batch: Batch) -> Batch:
        """``response_length`` [B]: valid response tokens of each row (for the overlong penalty)."""
        return Batch.from_dict({"response_length": batch["response_mask"].sum(-1)})

    @endpoint(D.shard() | D.metrics("sum"), requires=["old_log_probs", "ref_log_probs", "response_mask"])
    def kl_moments(self, batch: Batch, kl_estimator: str = "k1") -> dict[str, float]:
        """Sum and count over valid response tokens of the per-token KL(policy || ref) estimate (for the adaptive
        KL controller; reduced over ranks by sum)."""
        m = batch["response_mask"].bool()
        kl = kl_penalty(batch["old_log_probs"].double(), batch["ref_log_probs"].double(), kl_estimator)[m]
        return {"sum": float(kl.sum()), "count": float(kl.numel())}

    @endpoint(D.shard() | D.metrics("sum"))
    def moments(self, batch: Batch, key: str = "advantages") -> dict[str, float]:
        """Sum, sum of squares and count of ``key`` over valid response tokens (reduced over ranks by sum).
        A per-sequence ``key`` ([B]) counts once for each valid token of its row. Rows whose ``advantage_mask`` is 0
        (DAPO's filler rows, held at advantage 0) are left out."""
        x, m = batch[key].double(), batch["response_mask"].bool()
        if "advantage_mask" in batch.keys():
            m = m & batch["advantage_mask"].bool()[:, None]
        if x.dim() == 1:
            x = x[:, None].expand(m.shape)
        v = x[m]
        return {"sum": float(v.sum()), "sumsq": float((v * v).sum()), "count": float(v.numel())}
