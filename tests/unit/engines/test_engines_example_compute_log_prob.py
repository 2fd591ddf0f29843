"""examples/compute_log_prob.py without a cluster: the checkpoint it writes loads offline as a user's would, and
its check flags a disagreement between trainer and sampler log-probs while accepting fp32 round-off."""

from __future__ import annotations

import pytest
import torch

from orchestra import Batch


@pytest.fixture(scope="module")
def example(load_example):
    return load_example("compute_log_prob")


def rollout_batch() -> tuple[Batch, Batch]:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    batch = Batch.from_dict({"rollout_log_probs": lp, "response_mask": mask})
    return batch, Batch.from_dict({"old_log_probs": lp.clone()})


def test_compare_sums_log_probs_over_response_tokens(example):
    batch, scored = rollout_batch()
    rows, per_token, bad = example.compare(batch, scored)
    assert rows == [(3, -3.5, -3.5), (1, -0.25, -0.25)] and per_token == 0.0 and bad == []


def test_compare_accepts_round_off_and_flags_a_real_disagreement(example):
    batch, scored = rollout_batch()
    scored["old_log_probs"][0] += 1e-6  # fp32 round-off scale
    assert example.compare(batch, scored)[2] == []
    scored["old_log_probs"][1, 0] -= 0.1  # e.g. scored at another temperature
    rows, per_token, bad = example.compare(batch, scored)
    assert bad == [1] and per_token == pytest.approx(0.1)


def test_compare_ignores_log_probs_past_the_response(example):
    batch, scored = rollout_batch()
    scored["old_log_probs"][1, 2] = -7.0  # padding: masked out
    assert example.compare(batch, scored)[2] == []


def test_the_saved_checkpoint_loads_offline_like_a_users(example, tmp_path):
    from transformers import AutoTokenizer

    from engines.models import build_causal_lm
    from engines.tokenizer import CharTokenizer

    example.save_tiny_checkpoint(str(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in tmp_path.iterdir()}
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    chars = CharTokenizer()
    assert tok("7+8=")["input_ids"] == chars.encode("7+8=", add_bos=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        chars.bos_token_id, chars.eos_token_id, chars.pad_token_id)
    assert tok.decode(chars.encode("1 2", add_eos=True), skip_special_tokens=True) == "1 2"
    model = build_causal_lm(path=str(tmp_path))
    assert model.config.vocab_size == chars.vocab_size and model.config.eos_token_id == chars.eos_token_id
    assert torch.equal(model.lm_head.weight, build_causal_lm(model.config, seed=0).lm_head.weight)
