"""examples/grpo_single_process.py scores responses as the pipeline's rule reward does: cut at <eos>, and the other
special tokens a response holds stay in its text (skipped, a pad sampled inside an answer made ``1<pad>5`` read as
``15``, and the example rewarded it as correct while the distributed job did not)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def example(load_example):
    return load_example("grpo_single_process")


def test_a_pad_sampled_inside_an_answer_is_not_read_as_the_answer(example):
    tok = example.CharTokenizer()
    one, five = tok.encode("1"), tok.encode("5")
    ids = torch.tensor([[*one, tok.pad_token_id, *five, tok.eos_token_id],
                        [*one, *five, tok.eos_token_id, tok.pad_token_id]])
    texts = example.decode_responses(tok, ids)
    assert texts[1] == "15"
    assert texts[0] != "15"
    assert example.digit_reward(texts, ["15", "15"], format_bonus=0.1) == [0.0, 1.0]
