"""GSPO, GMPO and CISPO, with the truncated IS weight on, through a real ``FSDPEngine.train_step``: the loss and
gradient norm do not depend on the micro-batch size (the engine weights micro-batches by the units the loss object
declares; these losses are row-local, so the same weighting holds)."""

import pytest
import torch
from pipelines_testutils import policy_batch, policy_model

from engines.fsdp import EngineConfig, FSDPEngine
from pipelines.objectives import PolicyLoss

pytestmark = pytest.mark.timeout(180)

CASES = [("gspo", "seq-mean-token-mean"), ("gmpo", "seq-mean-token-sum"), ("cispo", "token-mean"),
         ("gspo", "seq-mean-token-sum-norm")]


@pytest.fixture(scope="module")
def batch():
    b = policy_batch(B=32)
    g = torch.Generator().manual_seed(1)
    b["rollout_log_probs"] = (b["old_log_probs"] + 0.5 * torch.randn(b["old_log_probs"].shape, generator=g)) \
        * b["response_mask"]
    return b


@pytest.mark.parametrize("loss_type,agg", CASES)
def test_new_policy_losses_do_not_depend_on_micro_batch_size(batch, loss_type, agg):
    loss_fn = PolicyLoss(agg=agg, loss_type=loss_type, clip_ratio_low=0.2, clip_ratio_high=0.28, rollout_is_cap=2.0,
                         kl_coef=0.1)
    steps = [FSDPEngine(policy_model, EngineConfig(lr=1e-3, grad_clip=None, micro_batch_size=mbs)).train_step(
        batch, loss_fn) for mbs in (32, 5)]
    assert steps[0]["grad_norm"] > 0 and torch.isfinite(torch.tensor(steps[0]["loss"]))
    assert steps[1]["loss"] == pytest.approx(steps[0]["loss"], rel=1e-4)
    assert steps[1]["grad_norm"] == pytest.approx(steps[0]["grad_norm"], rel=1e-4)
    assert 0 < steps[0]["tis/capped_frac"] < 1  # the weight acted on some tokens, not all
