"""The training objective is the whole mini-batch's loss for every aggregation mode: one train_step gives the
same loss and gradient norm at any micro-batch size and on 1 or 2 FSDP ranks."""

import pytest
from pipelines_testutils import policy_batch, policy_model, train_step_worker

from engines._dist import spawn
from engines.fsdp import EngineConfig, FSDPEngine
from pipelines.algorithms import AGG_MODES
from pipelines.objectives import PolicyLoss

pytestmark = pytest.mark.timeout(180)

REL = 1e-4


def _loss(agg: str) -> PolicyLoss:
    return PolicyLoss(agg=agg, entropy_coef=0.01, kl_coef=0.1, kl_estimator="k3")


def _one_step(batch, micro_batch_size: int, loss_fn) -> dict[str, float]:
    eng = FSDPEngine(policy_model, EngineConfig(lr=1e-3, grad_clip=None, micro_batch_size=micro_batch_size))
    return eng.train_step(batch, loss_fn)


@pytest.fixture(scope="module")
def batch():
    return policy_batch(B=64)


@pytest.fixture(scope="module")
def full_batch_steps(batch):
    """Per mode: one train_step with the whole mini-batch in one micro-batch on one rank (the reference)."""
    return {agg: _one_step(batch, 64, _loss(agg)) for agg in AGG_MODES}


@pytest.mark.parametrize("agg", AGG_MODES)
def test_loss_and_grad_norm_do_not_depend_on_micro_batch_size(batch, full_batch_steps, agg):
    ref = full_batch_steps[agg]
    for mbs in (8, 5):
        m = _one_step(batch, mbs, _loss(agg))
        assert m["loss"] == pytest.approx(ref["loss"], rel=REL), (agg, mbs)
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL), (agg, mbs)
        assert m["pg_loss"] == pytest.approx(ref["pg_loss"], rel=REL), (agg, mbs)
        # the token-mean metrics are means over the mini-batch's tokens in every mode (they were weighted by the
        # loss's units, so a seq-mean mode's clipfrac, approx_kl, ratio_mean and entropy moved with the size)
        for k in ("entropy", "clipfrac", "approx_kl", "ratio_mean", "kl_loss"):
            assert m[k] == pytest.approx(ref[k], rel=REL, abs=1e-9), (agg, mbs, k)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_sequence_mean_metrics_do_not_depend_on_micro_batch_size(batch, agg):
    """GSPO's ``seq_ratio_mean`` is a mean over sequences whatever the mode, its token metrics over tokens."""
    loss = PolicyLoss(agg=agg, entropy_coef=0.01, loss_type="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    ref = _one_step(batch, 64, loss)
    for mbs in (8, 5):
        m = _one_step(batch, mbs, loss)
        for k in ("loss", "seq_ratio_mean", "clipfrac", "entropy"):
            assert m[k] == pytest.approx(ref[k], rel=REL, abs=1e-9), (agg, mbs, k)


@pytest.mark.slow  # spawns a 2-process gloo group
def test_loss_and_grad_norm_do_not_depend_on_data_parallel_size(batch, full_batch_steps):
    # 64 rows over 2 ranks, 5-row micro-batches: 7 micro-batches per rank, uneven row counts per rank too
    per_rank = spawn(train_step_worker, 2, batch, 5, [_loss(agg) for agg in AGG_MODES])
    assert per_rank[0] == per_rank[1]  # metrics are global
    for agg, m in zip(AGG_MODES, per_rank[0]):
        ref = full_batch_steps[agg]
        assert m["loss"] == pytest.approx(ref["loss"], rel=REL), agg
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL), agg


def test_modes_really_differ(full_batch_steps):
    # guards the tests above against a batch on which every mode gives the same number
    losses = [full_batch_steps[a]["loss"] for a in AGG_MODES]
    assert len({round(x, 6) for x in losses}) == len(losses)
