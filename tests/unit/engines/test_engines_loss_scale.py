"""Micro-batch weighting by the units a loss averages over (``loss_fn.loss_scale``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from engines_testutils import make_batch, model_factory

from engines.fsdp import EngineConfig, FSDPEngine

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class SeqMeanLoss:
    """Mean over sequences (with a response token) of each sequence's token-mean of -adv * logp."""

    loss_scale: str = "sequences"

    def __call__(self, outputs, mb):
        m = mb["response_mask"].float()
        has = m.sum(-1) > 0
        per_seq = -(mb["advantages"] * outputs["log_probs"] * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq[has].sum() / has.sum().clamp(min=1), {}


def test_sequence_mean_loss_is_independent_of_micro_batch_size():
    batch = make_batch(B=6, seed=4)
    batch["response_mask"][2] = 0  # a row without response tokens is not a sequence of the mean
    results = []
    for mbs in (6, 4, 1):
        eng = FSDPEngine(model_factory(0), EngineConfig(lr=1e-3, grad_clip=None, micro_batch_size=mbs))
        results.append(eng.train_step(batch, SeqMeanLoss()))
    for m in results[1:]:
        assert m["loss"] == pytest.approx(results[0]["loss"], rel=1e-5)
        assert m["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-4)
    with torch.no_grad():  # and the full-batch loss is the plain sequence mean
        eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=6))
        lp = eng.compute_log_prob(batch)["log_probs"]
    expected, _ = SeqMeanLoss()({"log_probs": lp}, batch)
    assert results[0]["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_unknown_loss_scale_is_rejected():
    eng = FSDPEngine(model_factory(0), EngineConfig())
    with pytest.raises(ValueError, match="loss_scale must be one of tokens, sequences, rows, got 'words'"):
        eng.train_step(make_batch(B=2), SeqMeanLoss(loss_scale="words"))
    with pytest.raises(ValueError, match="loss_scale must be one of"):
        EngineConfig(loss_scale="words")
