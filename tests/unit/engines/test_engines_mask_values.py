"""``response_mask`` is a 0/1 mask: the engine multiplies its outputs by it and counts its sum as tokens, while the
losses count ``mask.bool()``. Other values (a 0.5 "weight", a mask added twice) are refused, naming the tensor."""

from __future__ import annotations

import pytest
import torch
from dp_engine_testutils import bad_mask_on_one_rank_worker, masked_token_mean_loss
from engines_testutils import make_batch, model_factory

from engines._dist import spawn
from engines.fsdp import EngineConfig, FSDPEngine

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine() -> FSDPEngine:
    return FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4))


@pytest.mark.parametrize("scale", [0.5, 2, -1, float("nan")])
def test_a_mask_with_values_other_than_0_and_1_is_refused(engine, scale):
    batch = make_batch(B=4)
    bad = {**batch, "response_mask": batch["response_mask"] * scale}
    with pytest.raises(ValueError, match=r"compute_log_prob: response_mask must hold only 0 and 1.*rank 0"):
        engine.compute_log_prob(bad)
    step = engine.global_step
    with pytest.raises(ValueError, match=r"train_step: response_mask must hold only 0 and 1.*rank 0"):
        engine.train_step(bad, masked_token_mean_loss)
    assert engine.global_step == step


def test_bool_and_float_0_1_masks_are_accepted(engine):
    batch = make_batch(B=4)
    ref = engine.compute_log_prob(batch)["log_probs"]
    for mask in (batch["response_mask"].bool(), batch["response_mask"].float()):
        torch.testing.assert_close(engine.compute_log_prob({**batch, "response_mask": mask})["log_probs"], ref)
    assert engine.train_step({**batch, "response_mask": batch["response_mask"].bool()},
                             masked_token_mean_loss)["skipped"] == 0.0


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_a_bad_mask_on_one_rank_stops_every_rank():
    r0, r1 = spawn(bad_mask_on_one_rank_worker, 2)
    for call in ("compute_log_prob", "train_step"):
        assert "response_mask must hold only 0 and 1" in r1[call] and "rank 1" in r1[call], r1[call]
        assert "rank 1" in r0[call] and "refused" in r0[call], r0[call]
