"""RuleRewardEngine.score refuses a reward function's output that is not one score per response (too few, too
many, a scalar or 0-d tensor, a nested list, something not numeric), naming the task, the reward, the count
expected and the count (or type) got; it used to fail with a bare IndexError / TypeError, or broadcast silently."""

from __future__ import annotations

import pytest
import torch

from engines.reward import RuleRewardEngine, register_reward
from engines.tokenizer import CharTokenizer

TOK = CharTokenizer()
OUTPUTS = {
    "short_by_one": lambda texts: [1.0] * (len(texts) - 1),
    "one_too_many": lambda texts: [1.0] * (len(texts) + 1),
    "scalar": lambda texts: 1.0,
    "zero_d_tensor": lambda texts: torch.tensor(1.0),
    "one_score_for_all": lambda texts: torch.ones(1),
    "nested": lambda texts: [[1.0]] * len(texts),
    "strings": lambda texts: ["good"] * len(texts),
    "none": lambda texts: None,
}
for _name, _make in OUTPUTS.items():
    register_reward(f"test_output_refusals_{_name}", overwrite=True)(
        lambda texts, truths, _make=_make: _make(texts))


def _batch() -> dict[str, torch.Tensor]:
    resp = torch.tensor([TOK.encode("12") + [2], TOK.encode("7") + [2, 0], TOK.encode("3") + [2, 0]])
    return {"responses": resp, "response_mask": (resp != 0).long()}


@pytest.mark.parametrize("name,got", [("short_by_one", r"2 scores"), ("one_too_many", r"4 scores"),
                                      ("scalar", r"a float"), ("zero_d_tensor", r"a 0-d tensor"),
                                      ("one_score_for_all", r"1 scores"), ("nested", r"shape \(3, 1\)"),
                                      ("strings", r"a list"), ("none", r"a NoneType")])
def test_a_reward_that_is_not_one_score_per_response_is_refused(name, got):
    eng = RuleRewardEngine(f"test_output_refusals_{name}", TOK, task="digits")
    with pytest.raises(ValueError, match=rf"task 'digits': reward 'test_output_refusals_{name}' must return one score "
                                         rf"per response \(3\), got {got}"):
        eng.score(_batch(), ["12", "7", "4"])


def test_one_score_per_response_still_works():
    register_reward("test_output_refusals_ok", overwrite=True)(lambda texts, truths: [float(len(t)) for t in texts])
    out = RuleRewardEngine("test_output_refusals_ok", TOK).score(_batch(), ["12", "7", "4"])
    assert out["scores"].tolist() == [2.0, 1.0, 1.0]
    register_reward("test_output_refusals_tensor", overwrite=True)(lambda texts, truths: torch.ones(len(texts)))
    assert RuleRewardEngine("test_output_refusals_tensor", TOK).score(_batch(), ["a", "b", "c"])["scores"].shape == (3,)
