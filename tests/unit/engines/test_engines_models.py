"""Model builders: seeded random init, offline loading from a local directory, heads."""

from __future__ import annotations

import pytest
import torch
from engines_testutils import VOCAB

from engines.models import build_causal_lm, build_reward_model, build_value_model, tiny_qwen2_config


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_seeded_init_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(1234)
    before = torch.rand(1)
    torch.manual_seed(1234)
    a = build_causal_lm(tiny_qwen2_config(VOCAB), seed=3)
    after = torch.rand(1)
    assert torch.equal(before, after)
    assert _same(a, build_causal_lm(tiny_qwen2_config(VOCAB), seed=3))
    assert not _same(a, build_causal_lm(tiny_qwen2_config(VOCAB), seed=4))
    assert a.config.vocab_size == VOCAB and a.config.num_hidden_layers == 2
    # a dict without model_type is read as overrides of the tiny Qwen2 config
    b = build_causal_lm({"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64}, seed=0)
    assert b.config.hidden_size == 32 and b.config.model_type == "qwen2"
    assert build_causal_lm(tiny_qwen2_config(VOCAB), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_load_from_local_directory(tmp_path):
    a = build_causal_lm(tiny_qwen2_config(VOCAB), seed=3)
    a.save_pretrained(tmp_path)
    assert _same(a, build_causal_lm(path=tmp_path))
    v = build_value_model(path=tmp_path, seed=1)  # LM backbone + fresh value head
    assert torch.equal(v.model.embed_tokens.weight, a.model.embed_tokens.weight)
    assert v.config.num_labels == 1
    with pytest.raises(FileNotFoundError, match="local directory"):
        build_causal_lm(path=tmp_path / "missing")


def test_value_and_reward_heads():
    v = build_value_model(tiny_qwen2_config(VOCAB), seed=0)
    ids = torch.randint(3, VOCAB, (2, 5))
    assert v(input_ids=ids).logits.shape == (2, 5, 1)
    assert v.dropout.p == 0.0
    r = build_reward_model(tiny_qwen2_config(VOCAB, pad_token_id=0), seed=0)
    assert r(input_ids=ids).logits.shape == (2, 1)
