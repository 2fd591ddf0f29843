"""The reward engines put a sequence's score on its *last valid* response token (the last position where
response_mask is 1), as pipelines.algorithms.outcome_to_token_scores does: masks may have holes (e.g. a masked-out
observation span), which GAE supports; at ``mask.sum() - 1`` the score landed on a masked position and was lost."""

from __future__ import annotations

import torch

from engines.reward import RuleRewardEngine, _place_at_last
from engines.tokenizer import CharTokenizer


def test_score_lands_on_the_last_valid_token_of_a_mask_with_holes():
    tok = CharTokenizer()
    resp = torch.tensor([tok.encode("1") + [0, 0] + tok.encode("2") + [tok.eos_token_id]])
    mask = torch.tensor([[1, 0, 0, 1, 1]])
    out = RuleRewardEngine("exact_match", tok).score({"responses": resp, "response_mask": mask}, ["12"])
    assert out["scores"].tolist() == [1.0]
    assert out["token_level_scores"].tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]


def test_place_at_last_rows():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]])
    out = _place_at_last(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), mask)
    assert out.tolist() == [[0, 1, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 0, 4], [0, 5, 0, 0]]
    assert out.dtype == torch.float32
