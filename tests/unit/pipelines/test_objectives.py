"""The loss objects handed to the engines (PolicyLoss, ValueLoss, SFTLoss): values, gradients, signs."""

import math

import pytest
import torch

from engines._data import entropy_from_logits
from pipelines.algorithms import AGG_MODES, aggregate
from pipelines.objectives import PolicyLoss, SFTLoss, ValueLoss

T = torch.tensor


def _policy_outputs(logits: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    log_p = torch.log_softmax(logits, -1)
    return {"log_probs": log_p.gather(-1, tokens[..., None])[..., 0], "entropy": entropy_from_logits(logits)}


def _mb(logits: torch.Tensor, tokens: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> dict:
    with torch.no_grad():
        old = _policy_outputs(logits, tokens)["log_probs"]
    return {"old_log_probs": old, "ref_log_probs": old.clone(), "advantages": adv, "response_mask": mask}


def test_entropy_bonus_raises_entropy_when_descending_the_loss():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 5, requires_grad=True)
    tokens = torch.randint(0, 5, (3, 4))
    mask = T([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    mb = _mb(logits, tokens, torch.zeros(3), mask)  # zero advantages: only the entropy term acts
    loss_fn = PolicyLoss(entropy_coef=0.1)
    out = _policy_outputs(logits, tokens)
    loss, metrics = loss_fn(out, mb)
    h0 = float(aggregate(out["entropy"], mask).detach())
    assert loss.item() == pytest.approx(-0.1 * h0, rel=1e-6)  # loss = -coef * H
    assert float(metrics["entropy"]) == pytest.approx(h0, rel=1e-6)
    loss.backward()
    with torch.no_grad():
        stepped = logits - 1.0 * logits.grad
    h1 = float(aggregate(entropy_from_logits(stepped), mask))
    assert h1 > h0 + 1e-3


def test_policy_loss_without_bonus_is_the_clipped_surrogate_plus_kl():
    logits = torch.zeros(1, 2, 3, requires_grad=True)
    tokens = T([[0, 1]])
    mask = T([[1, 1]])
    mb = _mb(logits, tokens, T([2.0]), mask)
    mb["ref_log_probs"] = mb["old_log_probs"] - 0.5  # d = logp - ref = 0.5 on both tokens
    loss, metrics = PolicyLoss(kl_coef=0.1, kl_estimator="k1")(_policy_outputs(logits, tokens), mb)
    # ratio 1: surrogate = -A = -2; k1 KL = 0.5
    assert float(metrics["pg_loss"]) == pytest.approx(-2.0)
    assert float(metrics["kl_loss"]) == pytest.approx(0.5)
    assert loss.item() == pytest.approx(-2.0 + 0.1 * 0.5)


def test_policy_loss_whitens_per_sequence_advantages():
    logits = torch.zeros(2, 1, 2, requires_grad=True)
    tokens = T([[0], [0]])
    mask = T([[1], [1]])
    mb = _mb(logits, tokens, T([3.0, 1.0]), mask)
    loss, _ = PolicyLoss(adv_mean=2.0, adv_std=2.0)(_policy_outputs(logits, tokens), mb)
    # whitened advantages +0.5 and -0.5: token-mean surrogate at ratio 1 is 0
    assert loss.item() == pytest.approx(0.0, abs=1e-7)


def test_value_loss_clipped_and_unclipped():
    values = T([[1.0, 0.0, 5.0]], requires_grad=True)
    old = T([[0.5, 0.0, 0.0]])
    returns = T([[2.0, 1.0, 0.0]])
    mb = {"values": old, "returns": returns, "response_mask": T([[1, 1, 0]])}
    loss, metrics = ValueLoss(clip_range=0.2)({"values": values}, mb)
    # token 0: unclipped (1-2)^2 = 1, clipped V = 0.7 -> (0.7-2)^2 = 1.69 (larger, clip active); token 1: 1 and 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert float(metrics["vf_loss"]) == pytest.approx(loss.item())
    assert float(metrics["vf_clipfrac"]) == pytest.approx(0.5)
    plain, _ = ValueLoss(clip_range=None)({"values": values}, mb)
    assert plain.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    plain.backward()
    assert values.grad.tolist() == [pytest.approx([-0.5, -0.5, 0.0])]  # (V - G) / tokens, masked token untouched


def test_sft_loss_is_the_mean_nll_of_the_response_tokens():
    logp = T([[-1.0, -3.0, -7.0], [-2.0, -9.0, -9.0]], requires_grad=True)
    mask = T([[1, 1, 0], [1, 0, 0]])
    loss, metrics = SFTLoss()({"log_probs": logp}, {"response_mask": mask})
    assert loss.item() == pytest.approx((1 + 3 + 2) / 3)
    assert float(metrics["nll"]) == pytest.approx(loss.item())
    seq, _ = SFTLoss(agg="seq-mean-token-mean")({"log_probs": logp}, {"response_mask": mask})
    assert seq.item() == pytest.approx((2.0 + 2.0) / 2)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_loss_objects_declare_the_units_they_average_over(agg):
    expected = "tokens" if agg == "token-mean" else "sequences"
    assert PolicyLoss(agg=agg).loss_scale == expected
    assert ValueLoss(agg=agg).loss_scale == expected
    assert SFTLoss(agg=agg).loss_scale == expected


def test_entropy_is_finite_with_filtered_logits():
    logits = T([[[0.0, 0.0, -math.inf], [math.log(3.0), 0.0, -math.inf]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    ent.sum().backward()
    assert ent[0].tolist() == pytest.approx([math.log(2), 0.5623351446])
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("agg", AGG_MODES)
def test_rows_with_a_zero_advantage_mask_get_no_policy_gradient_after_whitening(agg):
    # DAPO filler rows: advantage exactly 0 even when the batch's whitening would shift a 0 to -mean/std
    torch.manual_seed(0)
    logp = torch.randn(4, 3).requires_grad_()
    mb = {"old_log_probs": logp.detach() + 0.1 * torch.randn(4, 3), "advantages": torch.tensor([1.0, -1.0, 0.0, 0.0]),
          "response_mask": torch.ones(4, 3), "advantage_mask": torch.tensor([1.0, 1.0, 0.0, 0.0])}
    loss, _ = PolicyLoss(agg=agg, adv_mean=0.3, adv_std=2.0)({"log_probs": logp}, mb)
    loss.backward()
    assert torch.equal(logp.grad[2:], torch.zeros(2, 3)) and bool((logp.grad[:2] != 0).any())
