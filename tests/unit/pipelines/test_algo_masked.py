"""Masked reductions and aggregation modes, against hand-computed numbers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.algorithms import AGG_MODES, aggregate, masked_mean, masked_sum, masked_var, masked_whiten

T = torch.tensor


def test_masked_sum_and_mean_ignore_garbage_at_masked_positions():
    x = T([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = T([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(x, m).item() == 13.0
    assert masked_mean(x, m).item() == 3.25  # 13 / 4
    assert masked_mean(x, m, dim=-1).tolist() == [1.5, 5.0]
    assert masked_sum(x, m, dim=-1).tolist() == [3.0, 10.0]


def test_masked_mean_of_nothing_is_zero():
    x = T([[1.0, 2.0], [3.0, 4.0]])
    m = T([[0, 0], [1, 1]])
    assert masked_mean(x, m, dim=-1).tolist() == [0.0, 3.5]
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_masked_shape_mismatch():
    with pytest.raises(ValueError, match="shape mismatch"):
        masked_sum(torch.ones(2, 3), torch.ones(2, 2))


def test_masked_var():
    x = T([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    m = T([[1, 1, 1], [1, 0, 0]])
    # mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    assert masked_var(x, m).item() == pytest.approx(5 / 3)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(1.25)
    assert masked_var(T([[7.0]]), T([[1]])).item() == 0.0  # one element: no n-1 blow-up


def test_masked_whiten():
    x = T([[1.0, 3.0, 100.0]])
    m = T([[1, 1, 0]])
    # mean 2, unbiased var (1 + 1) / 1 = 2
    out = masked_whiten(x, m)
    assert out[0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0], abs=1e-6)
    kept = masked_whiten(x, m, shift_mean=False)
    assert kept[0].tolist() == pytest.approx([2 - 1 / math.sqrt(2), 2 + 1 / math.sqrt(2), 0.0], abs=1e-6)


LOSS = T([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [9.0, 9.0, 9.0]])
MASK = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the third row has no valid token


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-sum", 5.0),  # (6 + 4) / 2 sequences
        ("seq-mean-token-mean", 3.0),  # (2 + 4) / 2 sequences
        ("seq-mean-token-sum-norm", 5.0 / 3),  # (6 / 3 + 4 / 3) / 2 sequences: sums over the width R = 3
    ],
)
def test_aggregate_modes(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "mode, normalizer, expected",
    [("token-mean", 8, 10 / 8), ("seq-mean-token-sum", 4, 10 / 4), ("seq-mean-token-mean", 4, 6 / 4)],
)
def test_aggregate_normalizer(mode, normalizer, expected):
    assert aggregate(LOSS, MASK, mode, normalizer).item() == pytest.approx(expected)


def test_aggregate_errors():
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'.*token-mean"):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        aggregate(LOSS, MASK, "token-mean", 0)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 6),
    st.integers(1, 5),
    st.sampled_from(AGG_MODES),
    st.integers(0, 2**16),
)
def test_micro_batch_sum_with_normalizer_equals_full_batch(B, R, mode, seed):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, R, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, R, generator=g) < 0.7).long()
    mask[0, 0] = 1
    denom = mask.sum().item() if mode == "token-mean" else mask.any(-1).sum().item()
    cut = B // 2
    parts = aggregate(loss[:cut], mask[:cut], mode, denom) + aggregate(loss[cut:], mask[cut:], mode, denom)
    assert parts.item() == pytest.approx(aggregate(loss, mask, mode).item())
