"""FSDPEngine.train_step / compute_log_prob refuse inputs they would otherwise train on silently wrong, with
errors that name the argument or column, what it was and what to pass."""

from __future__ import annotations

import math

import pytest
from engines_testutils import make_batch, model_factory, token_mean_loss

from engines.fsdp import EngineConfig, FSDPEngine

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine() -> FSDPEngine:
    return FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4))


@pytest.mark.parametrize("temperature", [-1.0, 0.0, math.nan])
def test_train_step_refuses_a_temperature_compute_log_prob_refuses(engine, temperature):
    batch = make_batch(B=4)
    before = engine.global_step
    with pytest.raises(ValueError, match="train_step: temperature must be a finite number > 0"):
        engine.train_step(batch, token_mean_loss, temperature=temperature)
    with pytest.raises(ValueError, match="compute_log_prob: temperature must be a finite number > 0"):
        engine.compute_log_prob(batch, temperature=temperature)
    assert engine.global_step == before
