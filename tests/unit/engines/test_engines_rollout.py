"""RolloutEngine: agreement with HF generate and with the trainer's log-probs, seeding, stops."""

from __future__ import annotations

import pytest
import torch
from engines_testutils import VOCAB, model_factory

from engines.fsdp import EngineConfig, FSDPEngine
from engines.models import build_causal_lm, tiny_qwen2_config
from engines.rollout import RolloutEngine, SamplingParams, filter_logits

pytestmark = pytest.mark.timeout(60)


def _prompts(B: int = 4, P: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return {"prompts": prompts * mask, "attention_mask": mask, "uid": torch.arange(B)}


@pytest.fixture(scope="module")
def engine() -> RolloutEngine:
    return RolloutEngine(build_causal_lm(tiny_qwen2_config(VOCAB), seed=0), eos_token_id=2, pad_token_id=0)


def test_greedy_matches_hf_generate(engine):
    batch = _prompts()
    out = engine.generate(batch, max_new_tokens=10, temperature=0.0, stop_token_ids=())
    hf = engine.model.generate(
        input_ids=batch["prompts"], attention_mask=batch["attention_mask"], do_sample=False,
        max_new_tokens=10, eos_token_id=None, pad_token_id=0,
    )
    assert torch.equal(out["responses"], hf[:, batch["prompts"].shape[1]:])
    assert out["response_mask"].all()


def test_layout_and_prompt_major_rows(engine):
    batch = _prompts(B=3)
    out = engine.generate(batch, SamplingParams(n=2, max_new_tokens=5, temperature=0.0, stop_token_ids=()))
    assert out.batch_size == torch.Size([6])
    P = batch["prompts"].shape[1]
    assert torch.equal(out["uid"], torch.tensor([0, 0, 1, 1, 2, 2]))
    assert torch.equal(out["prompts"], batch["prompts"].repeat_interleave(2, 0))
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"][:, :P], batch["attention_mask"].repeat_interleave(2, 0))
    assert torch.equal(out["attention_mask"][:, P:], out["response_mask"])
    assert torch.equal(out["responses"][0::2], out["responses"][1::2])  # greedy: samples agree


def test_seeded_sampling_is_deterministic(engine):
    batch = _prompts()
    p = SamplingParams(n=3, max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=123, stop_token_ids=())
    a, b = engine.generate(batch, p), engine.generate(batch, p)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
    c = engine.generate(batch, p, seed=124)
    assert not torch.equal(a["responses"], c["responses"])
    g = torch.Generator().manual_seed(123)
    d = engine.generate(batch, p, generator=g)
    assert torch.equal(a["responses"], d["responses"])


def test_stop_tokens_end_responses(engine):
    stop = tuple(range(3, 24))  # a third of the vocabulary: most rows stop within a few tokens
    out = engine.generate(_prompts(B=4), n=4, max_new_tokens=16, seed=0, stop_token_ids=stop)
    resp, mask, lp = out["responses"], out["response_mask"], out["rollout_log_probs"]
    stopped = 0
    for r, m, l in zip(resp, mask, lp):
        n = int(m.sum())
        assert torch.equal(m[:n], torch.ones(n, dtype=m.dtype)) and not m[n:].any()  # right-padded
        is_stop = torch.isin(r[:n], torch.tensor(stop))
        assert not is_stop[:-1].any()  # no stop token before the last real token
        if is_stop[-1]:
            stopped += 1
        else:
            assert n == 16  # ran to the cap
        assert (r[n:] == 0).all() and (l[n:] == 0).all() and (l[:n] < 0).all()
    assert stopped > 0
    assert resp.shape[1] == int(mask.sum(-1).max())  # R is the longest response
    # every token stops -> one token per row, R == 1
    one = engine.generate(_prompts(), max_new_tokens=8, seed=0, stop_token_ids=tuple(range(VOCAB)))
    assert one["responses"].shape[1] == 1
    padded = engine.generate(
        _prompts(), max_new_tokens=8, seed=0, stop_token_ids=tuple(range(VOCAB)), pad_to_max_new_tokens=True
    )
    assert padded["responses"].shape[1] == 8 and padded["response_mask"].sum() == 4


def test_rollout_log_probs_match_trainer_after_load_weights():
    trainer = FSDPEngine(model_factory(5), EngineConfig())
    rollout = RolloutEngine(build_causal_lm(tiny_qwen2_config(VOCAB), seed=99), eos_token_id=2, pad_token_id=0)
    assert rollout.load_weights(trainer.full_state_dict()) > 0
    batch = _prompts()
    for temperature in (1.0, 0.7):
        out = rollout.generate(
            batch, n=2, max_new_tokens=12, temperature=temperature, top_p=0.8, top_k=30, seed=7,
            stop_token_ids=(2, 3, 4, 5),
        )
        ref = trainer.compute_log_prob(out, temperature=temperature)["log_probs"]
        torch.testing.assert_close(out["rollout_log_probs"], ref, atol=1e-4, rtol=0)


def test_micro_batched_generation_equals_single_pass():
    model = build_causal_lm(tiny_qwen2_config(VOCAB), seed=0)
    whole = RolloutEngine(model, eos_token_id=2, pad_token_id=0)
    chunked = RolloutEngine(model, eos_token_id=2, pad_token_id=0, micro_batch_size=3)
    p = SamplingParams(n=2, max_new_tokens=6, temperature=0.0, stop_token_ids=(5, 6, 7, 8))
    a, b = whole.generate(_prompts(), p), chunked.generate(_prompts(), p)
    assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["response_mask"], b["response_mask"])


def test_filter_logits_and_top_k1_is_greedy(engine):
    z = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert torch.isinf(filter_logits(z, 2, 1.0)).tolist() == [[False, False, True, True]]
    # probs ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.7 keeps the first two
    assert torch.isinf(filter_logits(z, 0, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(z, 0, 0.5)).tolist() == [[False, True, True, True]]
    batch = _prompts()
    greedy = engine.generate(batch, max_new_tokens=6, temperature=0.0, stop_token_ids=())
    k1 = engine.generate(batch, max_new_tokens=6, temperature=1.0, top_k=1, seed=3, stop_token_ids=())
    assert torch.equal(greedy["responses"], k1["responses"])


def test_bad_inputs(engine):
    with pytest.raises(KeyError, match="prompts"):
        engine.generate({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    right_padded = {"prompts": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    with pytest.raises(ValueError, match="LEFT-padded"):
        engine.generate(right_padded)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(KeyError, match="no weights given"):
        engine.load_weights({})


def test_generation_seeds_keep_every_bit_of_the_base_seed():
    """A base seed of 2**32 or more used to be cut to its low 32 bits (2**32 sampled as 0 did); seeds of valid
    32-bit bases are unchanged (golden values), and a negative base is refused."""
    from engines.workers import generation_seed

    assert generation_seed(5, 1, 2) == 8757564332041839212
    assert generation_seed(0, 0, 0) == 6375474604893067239
    assert generation_seed(2**32, 0, 0) != generation_seed(0, 0, 0)
    with pytest.raises(ValueError, match="base seed"):
        generation_seed(-1, 0, 0)
