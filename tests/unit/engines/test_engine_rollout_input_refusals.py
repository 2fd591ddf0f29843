"""RolloutEngine.generate refuses prompt ids the trainer refuses: a non-integer dtype (float ids were truncated by
.long() silently) and ids outside the model's vocabulary (a bare IndexError on CPU, a device assert on CUDA),
naming the column and the row; and a prompt mask that is not 0/1."""

from __future__ import annotations

import pytest
import torch
from engines_testutils import VOCAB

from engines.models import build_causal_lm, tiny_qwen2_config
from engines.rollout import RolloutEngine


@pytest.fixture(scope="module")
def ro() -> RolloutEngine:
    return RolloutEngine(build_causal_lm(tiny_qwen2_config(VOCAB), seed=0), eos_token_id=2, pad_token_id=0)


def _prompts() -> torch.Tensor:
    return torch.randint(3, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64])
def test_non_integer_prompt_ids_are_refused(ro, dtype):
    p = _prompts().to(dtype)
    with pytest.raises(ValueError, match=rf"generate: column 'prompts' holds {dtype} values; token ids must be "
                                         r"integers"):
        ro.generate({"prompts": p}, max_new_tokens=2)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 6, -1])
def test_out_of_vocabulary_ids_are_refused_naming_the_row(ro, bad):
    p = _prompts()
    p[1, 2] = bad
    with pytest.raises(ValueError, match=rf"generate: column 'prompts' row 1 holds token id {bad} outside the "
                                         rf"model's vocabulary \[0, {VOCAB}\)"):
        ro.generate({"prompts": p}, max_new_tokens=2)


def test_a_prompt_mask_that_is_not_0_1_is_refused(ro):
    p = _prompts()
    m = torch.ones_like(p)
    m[2, 0] = 2
    with pytest.raises(ValueError, match=r"generate: attention_mask row 2 holds 2 .*; it must be 0/1"):
        ro.generate({"prompts": p, "attention_mask": m}, max_new_tokens=2)


def test_int32_ids_still_work(ro):
    p = _prompts()
    a = ro.generate({"prompts": p}, max_new_tokens=3, temperature=0.0)
    b = ro.generate({"prompts": p.int()}, max_new_tokens=3, temperature=0.0)
    assert torch.equal(a["responses"], b["responses"])
