"""Loading a checkpoint from ``path``: weights the model needs but the checkpoint lacks, or weights the checkpoint
holds that the model does not use, are refused (transformers would initialise them at random, with its load report
hidden by TRANSFORMERS_VERBOSITY=error). Legitimate cases load: tied weights, a head model (critic / reward model)
built from a causal-LM checkpoint (only the new head is initialised, the LM head is unused)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from engines_testutils import VOCAB
from safetensors.torch import save_file

from engines.models import build_causal_lm, build_reward_model, build_value_model, tiny_qwen2_config


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_checkpoint_with_prefixed_keys_is_refused(tmp_path):
    src = build_causal_lm(tiny_qwen2_config(VOCAB), seed=0)
    src.config.save_pretrained(tmp_path)
    save_file({f"module.{k}": v.contiguous() for k, v in src.state_dict().items()},
              os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"(?s)missing from the checkpoint \(27\).*model\.embed_tokens\.weight"
                                         r".*unused by the model \(27\).*module\.model\.embed_tokens\.weight"
                                         r".*prefix"):
        build_causal_lm(path=tmp_path, seed=123)


def test_a_critic_checkpoint_given_as_an_lm_path_is_refused(tmp_path):
    build_value_model(tiny_qwen2_config(VOCAB), seed=0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"(?s)Qwen2ForCausalLM.*missing from the checkpoint \(1\): lm_head\.weight"
                                         r".*unused by the model \(2\): score\.bias, score\.weight"):
        build_causal_lm(path=tmp_path, seed=5)


def test_an_extra_tensor_in_an_lm_checkpoint_is_refused(tmp_path):
    src = build_causal_lm(tiny_qwen2_config(VOCAB), seed=0)
    src.config.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in src.state_dict().items()}
    sd["model.extra.weight"] = torch.zeros(3)
    save_file(sd, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"unused by the model \(1\): model\.extra\.weight"):
        build_causal_lm(path=tmp_path)


@pytest.mark.parametrize("tie", [False, True])
def test_tied_and_untied_lm_checkpoints_load(tmp_path, tie, caplog):
    src = build_causal_lm(tiny_qwen2_config(VOCAB, tie_word_embeddings=tie), seed=0)
    src.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="orchestra"):
        assert _same(src, build_causal_lm(path=tmp_path, seed=9))
    assert not [r for r in caplog.records if "newly initial" in r.getMessage()]
    if tie:  # the lm_head tensor written out explicitly (some exporters do): still one model
        save_file({k: v.contiguous().clone() for k, v in src.state_dict().items()},
                  os.path.join(tmp_path, "model.safetensors"))
        assert _same(src, build_causal_lm(path=tmp_path))


@pytest.mark.parametrize("tie", [False, True])
def test_a_critic_from_an_lm_checkpoint_initialises_only_its_head_and_says_so(tmp_path, tie, caplog):
    src = build_causal_lm(tiny_qwen2_config(VOCAB, tie_word_embeddings=tie), seed=0)
    src.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="orchestra"):
        v = build_value_model(path=tmp_path, seed=1)
    assert torch.equal(v.model.embed_tokens.weight, src.model.embed_tokens.weight)
    msgs = [r.getMessage() for r in caplog.records if r.name == "orchestra"]
    assert any("newly initialised" in m and "score.weight" in m and "score.bias" in m for m in msgs), msgs
    # and a critic checkpoint loads back as a critic, whole
    d = tmp_path / "critic"
    v.save_pretrained(d)
    assert _same(v, build_value_model(path=d, seed=2))


def test_a_reward_model_from_an_lm_checkpoint_warns_its_head_is_random(tmp_path, caplog):
    build_causal_lm(tiny_qwen2_config(VOCAB), seed=0).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="orchestra"):
        build_reward_model(path=tmp_path, seed=1)
    assert any(r.levelno == logging.WARNING and "score.weight" in r.getMessage() for r in caplog.records)


def test_a_head_model_still_refuses_a_checkpoint_missing_backbone_weights(tmp_path):
    src = build_causal_lm(tiny_qwen2_config(VOCAB), seed=0)
    src.config.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in src.state_dict().items() if k != "model.norm.weight"}
    save_file(sd, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing from the checkpoint \(1\): model\.norm\.weight"):
        build_value_model(path=tmp_path)
