"""The critic-free advantage estimators, DAPO's group filter and overlong penalty, and the adaptive KL controller,
against numbers worked out by hand in the comments."""

import json
import math

import pytest
import torch

from pipelines.algorithms import (
    AdaptiveKLController,
    discounted_returns,
    dynamic_sampling_filter,
    group_baseline_scores,
    grpo_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
)

T = torch.tensor


def approx(x, abs=1e-5):
    return pytest.approx(x, abs=abs)


# -- advantages ------------------------------------------------------------------------------------------------------

def test_discounted_return_is_the_reward_to_go_over_valid_tokens():
    # gamma 0.5, rewards [1, 0, 2]: G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5
    # row 2 has a hole at t=1 (reward 9 ignored): G2 = 2, G0 = 1 + 0.5 * 2 = 2
    # row 3 has no valid token: all 0
    rewards = T([[1.0, 0.0, 2.0], [1.0, 9.0, 2.0], [5.0, 5.0, 5.0]])
    mask = T([[1, 1, 1], [1, 0, 1], [0, 0, 0]])
    assert discounted_returns(rewards, mask, gamma=0.5).tolist() == [approx([1.5, 1.0, 2.0]), approx([2.0, 0.0, 2.0]),
                                                                     [0.0, 0.0, 0.0]]


def test_reinforce_pp_whitens_the_return_over_the_batch_tokens():
    # gamma 1. row 0: rewards [0, 1] -> G = [1, 1]; row 1: one valid token, reward 0 -> G = [0]
    # valid values 1, 1, 0: mean 2/3; deviations 1/3, 1/3, -2/3; sum of squares 2/3; unbiased var (2/3)/2 = 1/3
    # std 1/sqrt(3) = 0.577350; whitened: (1/3)/0.577350 = 0.577350, (-2/3)/0.577350 = -1.154701
    adv = reinforce_pp_advantages(T([[0.0, 1.0], [0.0, 7.0]]), T([[1, 1], [1, 0]]), gamma=1.0)
    assert adv.tolist() == [approx([0.577350, 0.577350]), approx([-1.154701, 0.0])]


def test_reinforce_pp_discounts_before_whitening():
    # gamma 0.5, one row, rewards [0, 0, 4]: G = [1, 2, 4]; mean 7/3; deviations -4/3, -1/3, 5/3;
    # squares 16/9 + 1/9 + 25/9 = 42/9; unbiased var 21/9 = 7/3; std 1.527525
    # whitened: -4/3 / 1.527525 = -0.872872, -1/3 / 1.527525 = -0.218218, 5/3 / 1.527525 = 1.091089
    adv = reinforce_pp_advantages(T([[0.0, 0.0, 4.0]]), torch.ones(1, 3), gamma=0.5)
    assert adv[0].tolist() == approx([-0.872872, -0.218218, 1.091089])


def test_group_baseline_subtracts_the_group_mean_and_zeroes_one_sample_groups():
    # group "a" has one sample -> 0; group "b": mean (1 + 3) / 2 = 2 -> [-1, 1]
    assert group_baseline_scores(T([5.0, 1.0, 3.0]), group_ids=["a", "b", "b"]).tolist() == [0.0, -1.0, 1.0]


def test_reinforce_pp_baseline_whitens_token_weighted_over_the_batch():
    # groups of 2: scores [1, 0 | 0, 0] -> centered [0.5, -0.5, 0, 0]
    # lengths 2, 1, 1, 1 -> token values 0.5, 0.5, -0.5, 0, 0: mean 0.1
    # deviations 0.4, 0.4, -0.6, -0.1, -0.1; squares sum 0.16 + 0.16 + 0.36 + 0.01 + 0.01 = 0.70; /4 = 0.175
    # std 0.418330: 0.4 / std = 0.956183, -0.6 / std = -1.434274, -0.1 / std = -0.239046
    mask = T([[1, 1], [1, 0], [1, 0], [1, 0]])
    adv = reinforce_pp_baseline_advantages(T([1.0, 0.0, 0.0, 0.0]), mask, group_size=2)
    assert adv.tolist() == [approx([0.956183, 0.956183]), approx([-1.434274, 0.0]), approx([-0.239046, 0.0]),
                            approx([-0.239046, 0.0])]


def test_reinforce_pp_baseline_all_masked_row_stays_zero():
    mask = T([[1, 1], [0, 0], [1, 0], [1, 1]])
    adv = reinforce_pp_baseline_advantages(T([1.0, 0.0, 0.0, 2.0]), mask, group_size=2)
    assert adv[1].tolist() == [0.0, 0.0]
    assert torch.isfinite(adv).all()


def test_dr_grpo_is_the_group_centred_score_without_std():
    # group of 4, scores [1, 0, 0, 0]: mean 0.25 -> [0.75, -0.25, -0.25, -0.25], no division
    adv = grpo_advantages(T([1.0, 0.0, 0.0, 0.0]), torch.ones(4, 1), group_size=4, norm_by_std=False)
    assert adv[:, 0].tolist() == approx([0.75, -0.25, -0.25, -0.25])


def test_remax_subtracts_the_greedy_score_of_the_same_prompt():
    # scores [1, 0.5] with greedy score 0.5 for the prompt: [0.5, 0]; on the valid tokens only
    adv = remax_advantages(T([1.0, 0.5]), T([0.5, 0.5]), T([[1, 1], [1, 0]]))
    assert adv.tolist() == [[0.5, 0.5], [0.0, 0.0]]


def test_remax_needs_one_greedy_score_per_row():
    with pytest.raises(ValueError, match="scores must have shape"):
        remax_advantages(T([1.0, 0.5]), T([0.5]), torch.ones(2, 2))


# -- DAPO ------------------------------------------------------------------------------------------------------------

def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal():
    # groups of 2: [1, 1] all solved, [0, 1] informative, [0, 0] all failed
    f = dynamic_sampling_filter(T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), group_size=2)
    assert f.keep.tolist() == [False, False, True, True, False, False]
    assert (f.groups, f.kept_groups, f.dropped_groups) == (3, 1, 2)
    assert f.metrics() == {"dynamic_sampling/groups": 3.0, "dynamic_sampling/kept_groups": 1.0,
                           "dynamic_sampling/dropped_groups": 2.0}


def test_dynamic_sampling_drops_one_sample_groups_and_respects_atol():
    f = dynamic_sampling_filter(T([1.0, 0.0, 1.0]), group_ids=["a", "b", "b"])
    assert f.keep.tolist() == [False, True, True]
    near = dynamic_sampling_filter(T([0.5, 0.5 + 1e-9]), group_size=2, atol=1e-6)
    assert near.keep.tolist() == [False, False]


def test_dynamic_sampling_refuses_non_finite_scores():
    with pytest.raises(ValueError, match="finite"):
        dynamic_sampling_filter(T([1.0, float("nan")]), group_size=2)


def test_overlong_penalty_is_zero_then_linear_in_the_buffer_then_minus_factor():
    # max_length 10, buffer 4: free up to 10 - 4 = 6; L=7: (6 - 7) / 4 = -0.25; L=8: -0.5; L=10: -1; L=11: -1
    pen = overlong_penalty(T([3, 6, 7, 8, 10, 11]), max_length=10, buffer=4)
    assert pen.tolist() == approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(T([8]), max_length=10, buffer=4, factor=0.5).tolist() == approx([-0.25])


def test_overlong_penalty_rejects_a_buffer_outside_the_length():
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(T([1]), max_length=4, buffer=0)


# -- adaptive KL controller ------------------------------------------------------------------------------------------

def test_adaptive_kl_raises_the_coefficient_when_kl_is_above_target_capped_at_20_percent():
    # target 6, horizon 10000, kl 9: error 9/6 - 1 = 0.5 -> capped 0.2; coef 0.1 * (1 + 0.2 * 256/10000) = 0.100512
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert c.update(9.0, n_steps=256) == pytest.approx(0.100512, rel=1e-12)


def test_adaptive_kl_lowers_the_coefficient_when_kl_is_below_target():
    # kl 3: error -0.5 -> -0.2; 0.1 * (1 - 0.2 * 256/10000) = 0.099488; then kl 6.6: error 0.1, n 1000:
    # 0.099488 * (1 + 0.1 * 0.1) = 0.10048288
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert c.update(3.0, n_steps=256) == pytest.approx(0.099488, rel=1e-12)
    assert c.update(6.6, n_steps=1000) == pytest.approx(0.10048288, rel=1e-12)


def test_adaptive_kl_state_survives_a_json_round_trip():
    """The coefficient comes back; target and horizon are the loading run's settings (a resume may change them)."""
    a = AdaptiveKLController(0.2, target=0.05, horizon=100)
    a.update(0.1)
    b = AdaptiveKLController(1.0, target=0.05, horizon=100)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert b.update(0.01) == a.update(0.01)
    c = AdaptiveKLController(1.0, target=1.0, horizon=1000)
    c.load_state_dict(a.state_dict())
    assert c.state_dict() == {"coef": a.coef, "target": 1.0, "horizon": 1000}


def test_adaptive_kl_refuses_a_non_finite_kl():
    c = AdaptiveKLController(0.1, target=0.1, horizon=10)
    with pytest.raises(ValueError, match="finite"):
        c.update(math.nan)
    assert c.coef == 0.1


def test_adaptive_kl_never_turns_the_coefficient_negative():
    # factor 1 + error * n/horizon with error >= -0.2: <= 0 once n >= 5 x horizon. Horizon 4, 32 samples: the factor
    # would be 1 - 0.2 * 8 = -0.6 (coef 0.05 -> -0.03); refused, naming the bound, and the coefficient is unchanged.
    c = AdaptiveKLController(0.05, target=10.0, horizon=4)
    with pytest.raises(ValueError, match=r"32 samples.*horizon 4.*algorithm.kl_horizon > 6.4"):
        c.update(0.0, n_steps=32)
    assert c.coef == 0.05
    # horizon 7 (> 32 / 5): 0.05 * (1 - 0.2 * 32/7) = 0.05 * 3/35, small but positive
    c = AdaptiveKLController(0.05, target=10.0, horizon=7)
    assert c.update(0.0, n_steps=32) == pytest.approx(0.05 * 3 / 35, rel=1e-12) and c.coef > 0
