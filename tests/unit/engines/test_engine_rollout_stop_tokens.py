"""RolloutEngine's stop set: the eos id given (or the model config's) plus every id of the model's
``generation_config.eos_token_id`` (chat models list several end-of-turn ids there), deduplicated, in order. With
no stop id at all it warns, once, that responses always run to max_new_tokens."""

from __future__ import annotations

import logging

import torch
from engines_testutils import VOCAB
from transformers import GenerationConfig

from engines.models import build_causal_lm, tiny_qwen2_config
from engines.rollout import RolloutEngine


def _prompts() -> torch.Tensor:
    return torch.randint(3, VOCAB, (4, 5), generator=torch.Generator().manual_seed(0))


def test_generation_config_eos_ids_join_the_stop_set():
    m = build_causal_lm(tiny_qwen2_config(VOCAB, eos_token_id=2), seed=0)
    greedy = RolloutEngine(m, eos_token_id=()).generate({"prompts": _prompts()}, max_new_tokens=3, temperature=0.0)
    eot = int(greedy["responses"][0, 1])  # the token row 0 emits second: make it an end-of-turn id
    m.generation_config = GenerationConfig(eos_token_id=[2, eot, 2], pad_token_id=VOCAB - 1)
    ro = RolloutEngine(m)
    assert ro.eos_token_ids == (2, eot)
    out = ro.generate({"prompts": _prompts()}, max_new_tokens=8, temperature=0.0)
    assert out["response_mask"][0].tolist() == [1, 1] + [0] * (out["responses"].shape[1] - 2)
    assert int(out["responses"][0, 1]) == eot
    # an explicit eos id (a tokenizer's, as the workers pass it) comes first; generation_config's ids still stop
    ro2 = RolloutEngine(m, eos_token_id=7, pad_token_id=0)
    assert ro2.eos_token_ids == (7, 2, eot) and ro2.pad_token_id == 0


def test_no_stop_token_warns_once(caplog):
    m = build_causal_lm(tiny_qwen2_config(VOCAB, eos_token_id=None, pad_token_id=None), seed=0)
    ro = RolloutEngine(m)
    assert ro.eos_token_ids == ()
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        out = ro.generate({"prompts": _prompts()}, max_new_tokens=4, seed=0)
        ro.generate({"prompts": _prompts()}, max_new_tokens=4, seed=0)
    assert out["response_mask"].sum(-1).tolist() == [4] * 4
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1, msgs
    assert "max_new_tokens" in msgs[0] and "eos_token_id" in msgs[0] and "stop_token_ids" in msgs[0]


def test_explicit_stop_token_ids_do_not_warn(caplog):
    m = build_causal_lm(tiny_qwen2_config(VOCAB, eos_token_id=None, pad_token_id=None), seed=0)
    with caplog.at_level(logging.WARNING, logger="orchestra"):
        RolloutEngine(m).generate({"prompts": _prompts()}, max_new_tokens=2, stop_token_ids=(5,), seed=0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
