"""Rule rewards with hand-written expectations, the registry, and the reward-model engine."""

from __future__ import annotations

import math

import pytest
import torch
from engines_testutils import VOCAB, make_batch

from engines.models import build_reward_model, tiny_qwen2_config
from engines.reward import (
    RewardModelEngine,
    RuleRewardEngine,
    get_reward,
    last_number,
    list_rewards,
    register_reward,
)


def test_builtins_registered():
    for name in ("exact_match", "numeric_match", "regex_format", "boxed_match", "think_answer_format"):
        assert name in list_rewards()
    with pytest.raises(KeyError, match="registered"):
        get_reward("nope")


def test_exact_match():
    f = get_reward("exact_match")
    assert f([" 42\n", "42", "Yes"], ["42", "43", "yes"]) == [1.0, 0.0, 0.0]
    assert f(["Yes"], ["yes"], case_sensitive=False) == [1.0]
    assert f([" a"], ["a"], strip=False) == [0.0]
    with pytest.raises(ValueError, match="one per response"):
        f(["a", "b"], ["a"])


@pytest.mark.parametrize(
    "text,value",
    [("the answer is 72", 72.0), ("1,234.5 apples", 1234.5), ("x=-3 then 7.", 7.0), ("2e3", 2000.0),
     ("no digits", None), ("from 5 to .5", 0.5), ("#### 18", 18.0)],
)
def test_last_number(text, value):
    assert last_number(text) == value


def test_numeric_match():
    f = get_reward("numeric_match")
    r = ["so it is 18", "I think 17", "nothing", "= 3.0", "-4"]
    g = ["#### 18", "18", "18", "3", "-4"]
    assert f(r, g) == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert f(["1.5"], ["1.5001"], rel_tol=1e-3) == [1.0]


def test_format_rewards():
    f = get_reward("regex_format")
    assert f(["<a>1</a>", "x<a>1</a>"], None, pattern=r"<a>\d+</a>") == [1.0, 0.0]
    assert f(["x<a>1</a>"], None, pattern=r"<a>\d+</a>", fullmatch=False) == [1.0]
    t = get_reward("think_answer_format")
    assert t(["<think>hm</think> <answer>4</answer>", "<answer>4</answer>"], ["4", "4"]) == [1.0, 0.0]
    b = get_reward("boxed_match")
    assert b([r"so \boxed{ 12 }", r"\boxed{\frac{1}{2}}", r"\boxed{3.0}", "12"], ["12", r"\frac{1}{2}", "3", "12"]) == [
        1.0, 1.0, 1.0, 0.0,
    ]


def test_register_custom_reward():
    @register_reward("test_len_reward")
    def length(response_texts, ground_truths, *, scale=1.0):
        return [scale * len(r) for r in response_texts]

    assert get_reward("test_len_reward")(["ab", "c"], ["", ""], scale=2.0) == [4.0, 2.0]
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_len_reward")(lambda r, g: [0.0] * len(r))


class _DigitTok:
    """Stand-in tokenizer: id i decodes to str(i % 10)."""

    def decode(self, ids):
        return "".join(str(i % 10) for i in ids)


def test_rule_reward_engine():
    batch = {
        "responses": torch.tensor([[4, 2, 0], [1, 8, 9]]),
        "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
    }
    eng = RuleRewardEngine("numeric_match", _DigitTok())
    assert eng.decode_responses(batch) == ["42", "189"]
    out = eng.score(batch, ["42", "7"])
    assert out["scores"].tolist() == [1.0, 0.0]
    assert out["token_level_scores"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_reward_model_engine_pools_last_real_token():
    torch.manual_seed(0)
    model = build_reward_model(tiny_qwen2_config(VOCAB), seed=1)
    batch = make_batch(B=5, seed=4)
    out = RewardModelEngine(model, micro_batch_size=2).score(batch)
    assert out["scores"].shape == (5,)
    am = batch["attention_mask"]
    for i in range(5):  # each row alone, unpadded, scored at its final token
        ids = batch["input_ids"][i][am[i].bool()][None]
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state
            ref = model.score(hidden[:, -1])[0, 0]
        assert out["scores"][i] == pytest.approx(float(ref), abs=1e-5)
        last = int(batch["response_mask"][i].sum()) - 1
        assert out["token_level_scores"][i, last] == out["scores"][i]
        assert out["token_level_scores"][i].count_nonzero() <= 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_rule_reward_engine_refuses_a_non_finite_score_naming_the_task(bad):
    # a buggy reward (0/0, a parse failure) used to flow into the advantages and the metrics as NaN, exit 0
    register_reward("test_non_finite_reward", overwrite=True)(lambda texts, truths: [1.0, bad])
    batch = {"responses": torch.tensor([[4, 2], [1, 8]]), "response_mask": torch.tensor([[1, 1], [1, 1]])}
    eng = RuleRewardEngine("test_non_finite_reward", _DigitTok(), task="my_task")
    with pytest.raises(ValueError, match=rf"task 'my_task'.*reward 'test_non_finite_reward'.*{bad}.*1 of 2 "
                                         r"responses.*row 1: response '18', answer '7'.*finite float"):
        eng.score(batch, ["42", "7"])
    plain = RuleRewardEngine("test_non_finite_reward", _DigitTok())  # no task: the reward alone is named
    with pytest.raises(ValueError, match=r"^reward 'test_non_finite_reward' returned"):
        plain.score(batch, ["42", "7"])


def test_special_tokens_sampled_inside_a_response_stay_in_its_text():
    """The text was decoded with pad and bos skipped, so a pad or bos the policy sampled inside its answer vanished:
    '1<pad>8', '<bos>18' and '18<pad>' (no <eos>: never stopped) all scored as the exact answer 18. Only <eos> ends
    a response (its text is cut there); the other special tokens are part of what the policy wrote."""
    from engines.tokenizer import CharTokenizer

    tok = CharTokenizer()
    eng = RuleRewardEngine("exact_match", tok)
    d, pad, bos, eos = tok.token_to_id, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
    rows = [[d["1"], d["8"], eos], [d["1"], pad, d["8"]], [bos, d["1"], d["8"]], [d["1"], d["8"], pad],
            [d["1"], d["8"], eos]]
    mask = torch.tensor([[1, 1, 1]] * 4 + [[1, 1, 0]])  # the last: <eos> outside the mask, as a padded response
    out = eng.score({"responses": torch.tensor(rows), "response_mask": mask}, ["18"] * 5)
    assert out["scores"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    texts = eng.decode_responses({"responses": torch.tensor(rows), "response_mask": mask})
    assert texts[0] == "18" and texts[1] == f"1{tok.id_to_token[pad]}8"
