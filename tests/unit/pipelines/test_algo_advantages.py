"""GAE, GRPO and RLOO advantages against hand-computed numbers."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipelines.algorithms import (
    gae_advantages,
    grpo_advantages,
    masked_mean,
    masked_var,
    outcome_to_token_scores,
    rloo_advantages,
)

T = torch.tensor


def approx(x, abs=1e-6):
    return pytest.approx(x, abs=abs)


def test_gae_1x3():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    # t=2: delta = 1 - 0.7 = 0.3;                 A2 = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03;        A1 = 0.03 + 0.72 * 0.3 = 0.246
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04;        A0 = 0.04 + 0.72 * 0.246 = 0.21712
    adv, ret = gae_advantages(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3), 0.9, 0.8)
    assert adv[0].tolist() == approx([0.21712, 0.246, 0.3])
    assert ret[0].tolist() == approx([0.71712, 0.846, 1.0])  # A + V


def test_gae_skips_holes_and_padding():
    rewards = T([[0.0, 5.0, 1.0], [2.0, 7.0, 7.0]])
    values = T([[0.5, 99.0, 0.7], [1.0, 5.0, 5.0]])
    mask = T([[1, 0, 1], [1, 0, 0]])
    # row 0, hole at t=1: A2 = 1 - 0.7 = 0.3; delta0 = 0.9 * 0.7 - 0.5 = 0.13; A0 = 0.13 + 0.72 * 0.3 = 0.346
    # row 1, one valid token: A0 = 2 + 0 - 1 = 1, return 2
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert adv.tolist() == [approx([0.346, 0.0, 0.3]), approx([1.0, 0.0, 0.0])]
    assert ret.tolist() == [approx([0.846, 0.0, 1.0]), approx([2.0, 0.0, 0.0])]


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    adv, ret = gae_advantages(T([[1.0, 0.0, 2.0]]), T([[0.5, 0.0, 1.0]]), torch.ones(1, 3))
    assert ret[0].tolist() == approx([3.0, 2.0, 2.0])
    assert adv[0].tolist() == approx([2.5, 2.0, 1.0])


def test_gae_whiten_and_no_grad():
    values = T([[0.5, 0.6, 0.7], [0.1, 0.2, 0.0]], requires_grad=True)
    mask = T([[1, 1, 1], [1, 1, 0]])
    rewards = T([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    raw, ret_raw = gae_advantages(rewards, values, mask, 0.9, 0.8)
    adv, ret = gae_advantages(rewards, values, mask, 0.9, 0.8, whiten=True)
    assert not adv.requires_grad and not ret.requires_grad
    assert torch.equal(ret, ret_raw)  # returns come from the raw advantages
    assert masked_mean(adv, mask).item() == approx(0.0)
    assert masked_var(adv, mask).item() == approx(1.0, abs=1e-5)
    assert adv[1, 2].item() == 0.0
    expected = (raw - masked_mean(raw, mask)) / masked_var(raw, mask).sqrt()
    assert torch.allclose(adv[mask.bool()], expected[mask.bool()], atol=1e-5)


def test_gae_shape_mismatch():
    with pytest.raises(ValueError, match="shape mismatch"):
        gae_advantages(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3))


def test_grpo_two_groups_by_size():
    # group 0: scores [1, 0], mean 0.5, sample std sqrt(0.5); group 1: [3, 3] has std 0 -> advantage 0
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv = grpo_advantages(T([1.0, 0.0, 3.0, 3.0]), mask, group_size=2)
    s = 0.5 / math.sqrt(0.5)  # 0.7071
    assert adv.tolist() == [approx([s, s], 1e-5), approx([-s, 0.0], 1e-5), [0.0, 0.0], [0.0, 0.0]]


def test_grpo_uneven_groups_by_ids_and_singleton():
    # group 'a' = rows 0, 2, 3 with scores [1, 0, 0]: mean 1/3, sample var (4/9 + 1/9 + 1/9) / 2 = 1/3
    # group 'b' = row 1 alone -> 0
    scores, mask = T([1.0, 5.0, 0.0, 0.0]), torch.ones(4, 1)
    expected = [2 / 3 / math.sqrt(1 / 3), 0.0, -1 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3)]
    adv = grpo_advantages(scores, mask, group_ids=["a", "b", "a", "a"])
    assert adv[:, 0].tolist() == approx(expected, 1e-5)  # [1.1547, 0, -0.5774, -0.5774]
    adv_t = grpo_advantages(scores, mask, group_ids=T([7, 3, 7, 7]))
    assert adv_t[:, 0].tolist() == approx(expected, 1e-5)
    no_std = grpo_advantages(scores, mask, group_ids=["a", "b", "a", "a"], norm_by_std=False)
    assert no_std[:, 0].tolist() == approx([2 / 3, 0.0, -1 / 3, -1 / 3])


def test_grpo_argument_errors():
    mask = torch.ones(4, 2)
    with pytest.raises(ValueError, match="exactly one of group_ids or group_size"):
        grpo_advantages(torch.zeros(4), mask)
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantages(torch.zeros(4), mask, group_size=2, group_ids=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="group_size=3 does not divide the batch of 4 rows"):
        grpo_advantages(torch.zeros(4), mask, group_size=3)
    with pytest.raises(ValueError, match="3 group ids for 4 rows"):
        grpo_advantages(torch.zeros(4), mask, group_ids=[0, 0, 1])
    with pytest.raises(ValueError, match=r"scores must have shape \[B\] with B=4"):
        grpo_advantages(torch.zeros(4, 1), mask, group_size=2)


def test_rloo():
    # group 0 [1, 0, 0]: 1 - 0 = 1, 0 - 0.5 = -0.5 (twice); group 1 [2, 4, 6]: 2 - 5, 4 - 4, 6 - 3
    adv = rloo_advantages(T([1.0, 0.0, 0.0, 2.0, 4.0, 6.0]), torch.ones(6, 2), group_size=3)
    assert adv[:, 1].tolist() == approx([1.0, -0.5, -0.5, -3.0, 0.0, 3.0])
    single = rloo_advantages(T([1.0, 2.0]), torch.ones(2, 1), group_ids=["x", "y"])
    assert single.tolist() == [[0.0], [0.0]]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(2, 5), st.integers(0, 2**16))
@example(groups=1, n=2, seed=56)  # scores -1.3281, -1.3268: a float32 group mean was 1e-7 off, / std 1e-3 -> 6e-5
def test_grpo_group_means_are_zero(groups, n, seed):
    scores = torch.randn(groups * n, generator=torch.Generator().manual_seed(seed))
    adv = grpo_advantages(scores, torch.ones(groups * n, 1), group_size=n)[:, 0]
    assert adv.view(groups, n).mean(1).abs().max().item() < 1e-5


def test_outcome_to_token_scores():
    mask = T([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    out = outcome_to_token_scores(T([1.0, 2.0, 3.0]), mask)
    assert out.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.0]]
