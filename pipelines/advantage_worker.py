"""Algorithm-side helper workers: advantage estimation next to the reward, on the CPU pool."""

from __future__ import annotations

import torch

from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D

from .algorithms import apply_kl_penalty, discounted_returns, gae_advantages, kl_penalty

__all__ = ["AdvantageWorker"]


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
        A per-sequence ``key`` ([B]) counts once for each valid token of its row."""
        x, m = batch[key].double(), batch["response_mask"].bool()
        if x.dim() == 1:
            x = x[:, None].expand(m.shape)
        v = x[m]
        return {"sum": float(v.sum()), "sumsq": float((v * v).sum()), "count": float(v.numel())}
