"""GSPO, GMPO, CISPO, clip-higher and the truncated IS weight: values and gradients worked out by hand, edge cases
(all-masked rows, -inf log-probs at padding), and that every loss splits over micro-batches like the engine does."""

import math

import pytest
import torch

from pipelines.algorithms import (
    AGG_MODES,
    agg_units,
    cispo_loss,
    gmpo_loss,
    gspo_loss,
    policy_loss,
    truncated_is_weights,
)
from pipelines.objectives import PolicyLoss

T = torch.tensor
LOSSES = {"ppo": policy_loss, "gspo": gspo_loss, "gmpo": gmpo_loss, "cispo": cispo_loss}


def approx(x, abs=1e-5):
    return pytest.approx(x, abs=abs)


def _grad(fn, log_ratio, adv, mask, **kw):
    """Loss and d loss / d log_probs for old log-probs 0 (so log_probs is the log-ratio)."""
    logp = log_ratio.clone().requires_grad_(True)
    loss, metrics = fn(logp, torch.zeros_like(logp), adv, mask, **kw)
    loss.backward()
    return loss.item(), logp.grad, metrics


# -- GSPO ------------------------------------------------------------------------------------------------------------

def test_gspo_clips_and_differentiates_the_sequence_ratio():
    # log-ratios [0.2, -0.1]: s = exp(mean) = exp(0.05) = 1.051271, inside [0.8, 1.2]; A = 1
    # loss (seq-mean-token-mean) = -A s = -1.051271; d/d logp_t = -A s / 2 = -0.525636 on each token
    loss, grad, m = _grad(gspo_loss, T([[0.2, -0.1]]), T([[1.0, 1.0]]), T([[1, 1]]), clip_ratio_low=0.2,
                          clip_ratio_high=0.2)
    assert loss == approx(-1.051271)
    assert grad[0].tolist() == approx([-0.525636, -0.525636])
    assert m["seq_ratio_mean"].item() == approx(1.051271) and m["clipfrac"].item() == 0.0


def test_gspo_clipped_sequence_gets_no_gradient_on_any_token():
    # s = 1.051271 > 1 + 0.01 with A > 0: loss = -A * 1.01, both tokens clipped, gradient 0
    loss, grad, m = _grad(gspo_loss, T([[0.2, -0.1]]), T([[1.0, 1.0]]), T([[1, 1]]), clip_ratio_low=0.01,
                          clip_ratio_high=0.01)
    assert loss == approx(-1.01)
    assert grad[0].tolist() == [0.0, 0.0] and m["clipfrac"].item() == 1.0


def test_gspo_ignores_padding_with_minus_inf_and_all_masked_rows():
    # the first row is the one above plus a padded -inf token; the second row has no valid token (left out)
    logp = T([[0.2, -0.1, -math.inf], [-math.inf, 3.0, 0.0]])
    mask = T([[1, 1, 0], [0, 0, 0]])
    loss, grad, _ = _grad(gspo_loss, logp, torch.ones(2, 3), mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss == approx(-1.051271)
    assert grad.tolist() == [approx([-0.525636, -0.525636, 0.0]), [0.0, 0.0, 0.0]]


# -- GMPO ------------------------------------------------------------------------------------------------------------

def test_gmpo_positive_advantage_clips_high_log_ratios_in_log_space():
    # A = 1, bounds +-0.4: l = min(d, clip(d)) = [min(0.5, 0.4), -0.1] = [0.4, -0.1]; mean 0.15
    # g = exp(0.15) = 1.161834; loss = -1.161834; token 0 is clipped (gradient 0), token 1: -g / 2 = -0.580917
    loss, grad, m = _grad(gmpo_loss, T([[0.5, -0.1]]), T([[1.0, 1.0]]), T([[1, 1]]), clip_ratio_low=0.4,
                          clip_ratio_high=0.4)
    assert loss == approx(-1.161834)
    assert grad[0].tolist() == approx([0.0, -0.580917])
    assert m["clipfrac"].item() == 0.5


def test_gmpo_negative_advantage_keeps_high_log_ratios():
    # A = -1: l = max(d, clip(d)) = [0.5, -0.1]; mean 0.2; g = exp(0.2) = 1.221403; loss = +1.221403
    # gradient +g / 2 = 0.610701 on both tokens
    loss, grad, _ = _grad(gmpo_loss, T([[0.5, -0.1]]), T([[-1.0, -1.0]]), T([[1, 1]]), clip_ratio_low=0.4,
                          clip_ratio_high=0.4)
    assert loss == approx(1.221403)
    assert grad[0].tolist() == approx([0.610701, 0.610701])


def test_gmpo_ignores_padding_with_minus_inf():
    loss, grad, _ = _grad(gmpo_loss, T([[0.5, -0.1, -math.inf]]), torch.ones(1, 3), T([[1, 1, 0]]),
                          clip_ratio_low=0.4, clip_ratio_high=0.4)
    assert loss == approx(-1.161834)
    assert grad[0].tolist() == approx([0.0, -0.580917, 0.0])


# -- CISPO -----------------------------------------------------------------------------------------------------------

def test_cispo_keeps_the_gradient_of_clipped_tokens_with_the_clipped_weight():
    # log-ratios [0.5, 0]: r = [1.648721, 1]; w = clip(r, 0.8, 1.2) = [1.2, 1]; A = 2
    # per token -w A = [-2.4, -2]; token-mean -2.2; gradient -w A / 2 = [-1.2, -1.0]
    loss, grad, m = _grad(cispo_loss, T([[0.5, 0.0]]), T([[2.0, 2.0]]), T([[1, 1]]))
    assert loss == approx(-2.2)
    assert grad[0].tolist() == approx([-1.2, -1.0])
    assert m["clipfrac"].item() == 0.5
    # PPO's clip drops the clipped token's gradient instead: -A * 1.2 is a constant there
    _, ppo_grad, _ = _grad(policy_loss, T([[0.5, 0.0]]), T([[2.0, 2.0]]), T([[1, 1]]))
    assert ppo_grad[0].tolist() == approx([0.0, -1.0])


def test_cispo_ignores_padding_with_minus_inf():
    loss, grad, _ = _grad(cispo_loss, T([[0.5, 0.0, -math.inf]]), torch.full((1, 3), 2.0), T([[1, 1, 0]]))
    assert loss == approx(-2.2)
    assert grad[0].tolist() == approx([-1.2, -1.0, 0.0])


# -- PPO clip-higher and token weights -------------------------------------------------------------------------------

def test_clip_higher_lets_positive_tokens_rise_further_than_they_may_fall():
    # low 0.2, high 0.28 (DAPO): A = 1, log-ratio log(1.25) -> r = 1.25 < 1.28: not clipped, loss -1.25, grad -1.25
    # with symmetric 0.2 it is clipped at 1.2: loss -1.2, grad 0
    lr = T([[math.log(1.25)]])
    loss, grad, _ = _grad(policy_loss, lr, T([[1.0]]), T([[1]]), clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert (loss, grad.item()) == (approx(-1.25), approx(-1.25))
    loss, grad, _ = _grad(policy_loss, lr, T([[1.0]]), T([[1]]), clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert (loss, grad.item()) == (approx(-1.2), approx(0.0))


def test_token_weights_multiply_each_tokens_loss():
    # ratio 1, A = [1, -1] -> per token [-1, 1]; weights [2, 0.5] -> [-2, 0.5]; token-mean -0.75
    loss, _ = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), T([[1.0, -1.0]]), T([[1, 1]]),
                          token_weights=T([[2.0, 0.5]]))
    assert loss.item() == approx(-0.75)


# -- truncated importance sampling -----------------------------------------------------------------------------------

def test_truncated_is_weight_is_the_trainer_over_rollout_ratio_capped():
    # old - rollout = [0 - (-1), 0 - 0.5] = [1, -0.5]: w = [min(e, 2), exp(-0.5)] = [2, 0.606531]
    # the padded token (rollout -inf) gets 0; mean over valid (2 + 0.606531) / 2 = 1.303265; capped 1 of 2
    w, m = truncated_is_weights(torch.zeros(1, 3), T([[-1.0, 0.5, -math.inf]]), T([[1, 1, 0]]), cap=2.0)
    assert w[0].tolist() == approx([2.0, 0.606531, 0.0])
    assert m["tis/weight_mean"].item() == approx(1.303265)
    assert m["tis/capped_frac"].item() == 0.5
    assert not w.requires_grad


def test_policy_loss_object_weights_tokens_by_the_truncated_is_ratio():
    # ratio 1 (log_probs = old = 0), A = 1 on two tokens; rollout log-probs [-1, 0.5] -> weights [2, 0.606531]
    # per token -w: token-mean -(2 + 0.606531) / 2 = -1.303265
    mb = {"old_log_probs": torch.zeros(1, 2), "advantages": T([1.0]), "response_mask": T([[1, 1]]),
          "rollout_log_probs": T([[-1.0, 0.5]])}
    loss, metrics = PolicyLoss(rollout_is_cap=2.0)({"log_probs": torch.zeros(1, 2)}, mb)
    assert loss.item() == approx(-1.303265)
    assert metrics["tis/capped_frac"].item() == 0.5
    plain, _ = PolicyLoss()({"log_probs": torch.zeros(1, 2)}, mb)
    assert plain.item() == approx(-1.0)


@pytest.mark.parametrize("loss_type", ["gspo", "gmpo", "cispo"])
def test_dual_clip_is_refused_outside_ppo(loss_type):
    with pytest.raises(ValueError, match="dual_clip_c"):
        PolicyLoss(loss_type=loss_type, dual_clip_c=3.0)


# -- every loss with every aggregation mode: micro-batches weighted by their unit share give the whole loss ----------

@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_every_policy_loss_splits_over_micro_batches_like_the_engine(name, agg):
    g = torch.Generator().manual_seed(0)
    B, R = 6, 5
    old = -torch.rand(B, R, generator=g) * 2
    logp0 = old + 0.3 * torch.randn(B, R, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, R).contiguous()
    mask = (torch.rand(B, R, generator=g) > 0.3).to(torch.int64)
    mask[2] = 0  # a row without valid tokens
    fn = LOSSES[name]

    def run(rows):
        logp = logp0.clone().requires_grad_(True)
        loss, _ = fn(logp[rows], old[rows], adv[rows], mask[rows], agg=agg)
        return loss, logp

    whole, lp = run(slice(0, B))
    whole.backward()
    units = (lambda m: m.sum()) if agg_units(agg) == "tokens" else (lambda m: m.bool().any(-1).sum())
    total = units(mask).item()
    lp_parts = logp0.clone().requires_grad_(True)
    parts = 0.0
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        loss, _ = fn(lp_parts[rows], old[rows], adv[rows], mask[rows], agg=agg)
        parts = parts + loss * units(mask[rows]).item() / total
    parts.backward()
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(lp_parts.grad, lp.grad, rtol=1e-5, atol=1e-7)
