"""Batch plumbing of the engines: entropy and log-probs from logits."""

import math

import pytest
import torch

from engines._data import entropy_from_logits, logprobs_from_logits


def test_entropy_from_logits_matches_the_definition():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11) * 3
    p = torch.softmax(logits, -1)
    expected = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected, atol=1e-5, rtol=1e-5)


def test_entropy_from_logits_is_finite_with_filtered_tokens():
    inf = math.inf
    logits = torch.tensor([[[0.0, 0.0, -inf, -inf], [0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -inf, -inf]]],
                          requires_grad=True)
    ent = entropy_from_logits(logits)
    ent.sum().backward()
    assert ent[0].tolist() == pytest.approx([math.log(2), math.log(4), 0.5623351446], abs=1e-6)
    assert torch.isfinite(logits.grad).all()  # top-k / top-p filtered logits must not poison the gradient


def test_logprobs_from_logits_gathers_the_token():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert logprobs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
