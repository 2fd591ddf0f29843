"""The trainer reads prompts as LEFT-padded (the last prompt column is a real token, the response follows it): a
right-padded prompt, or a row with no real prompt token, gives wrong log-probs / values silently. compute_log_prob,
compute_values and train_step refuse both, naming the row, as RolloutEngine.generate does."""

from __future__ import annotations

import pytest
import torch
from engines_testutils import VOCAB, make_batch, model_factory, token_mean_loss

from engines.fsdp import EngineConfig, FSDPEngine
from engines.models import build_value_model, tiny_qwen2_config


def _right_padded(batch: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    """``batch`` with row ``row``'s prompt moved to the right (pads after it)."""
    b = {k: v.clone() for k, v in batch.items()}
    P = b["prompts"].shape[1]
    pm = b["attention_mask"][:, :P]
    n = int(pm[row].sum())
    assert 0 < n < P, "pick a row whose prompt is padded"
    b["prompts"][row] = torch.cat([b["prompts"][row, P - n:], torch.zeros(P - n, dtype=b["prompts"].dtype)])
    b["attention_mask"][row, :P] = (torch.arange(P) < n).long()
    b["input_ids"] = torch.cat([b["prompts"], b["responses"]], 1)
    return b


def _empty_prompt(batch: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    b = {k: v.clone() for k, v in batch.items()}
    P = b["prompts"].shape[1]
    b["attention_mask"][row, :P] = 0
    b["prompts"][row] = 0
    b["input_ids"] = torch.cat([b["prompts"], b["responses"]], 1)
    return b


def _padded_row(batch: dict[str, torch.Tensor]) -> int:
    P = batch["prompts"].shape[1]
    return next(i for i in range(batch["prompts"].shape[0]) if 0 < int(batch["attention_mask"][i, :P].sum()) < P)


CASES = [(_right_padded, r"LEFT-padded.*row {row}"), (_empty_prompt, r"row {row} .*no real prompt token")]


@pytest.mark.parametrize("spoil,pattern", CASES, ids=["right_padded", "empty_prompt"])
def test_compute_log_prob_and_train_step_refuse(spoil, pattern):
    eng = FSDPEngine(model_factory(0), EngineConfig())
    good = make_batch(B=5)
    row = _padded_row(good)
    bad = spoil(good, row)
    before = {k: v.clone() for k, v in eng.full_state_dict().items()}
    with pytest.raises(ValueError, match=r"compute_log_prob: .*" + pattern.format(row=row)):
        eng.compute_log_prob(bad)
    with pytest.raises(ValueError, match=r"train_step: .*" + pattern.format(row=row)):
        eng.train_step(bad, token_mean_loss)
    after = eng.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and eng.global_step == 0
    eng.compute_log_prob(good)  # the engine is fine afterwards
    assert eng.train_step(good, token_mean_loss)["skipped"] == 0.0


@pytest.mark.parametrize("spoil,pattern", CASES, ids=["right_padded", "empty_prompt"])
def test_compute_values_refuses(spoil, pattern):
    eng = FSDPEngine(lambda: build_value_model(tiny_qwen2_config(VOCAB), seed=0), EngineConfig())
    good = make_batch(B=5)
    row = _padded_row(good)
    with pytest.raises(ValueError, match=r"compute_values: .*" + pattern.format(row=row)):
        eng.compute_values(spoil(good, row))
    assert eng.compute_values(good)["values"].shape == good["responses"].shape
