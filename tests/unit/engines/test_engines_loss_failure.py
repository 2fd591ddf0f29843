"""A ``loss_fn`` that fails on one rank stops every rank's ``train_step`` at once, with the failing rank's own
error there and one naming it elsewhere, and leaves the engine as it was before the step (was: the other ranks
waited in the backward's gradient collectives until the process group timed out). With
``accumulate_without_sync`` the gradients of the step's earlier micro-batches, which FSDP holds unreduced, are
dropped too (was: the next step added them in). A constant zero loss on one rank is legal and trains that
micro-batch on nothing (was: that rank skipped the backward's collectives and gloo aborted the process)."""

from __future__ import annotations

import pytest
import torch
from dp_engine_testutils import loss_fails_on_one_rank_worker
from engines_testutils import make_batch, model_factory

from engines._dist import spawn
from engines.fsdp import EngineConfig, FSDPEngine

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # spawns ranks
@pytest.mark.parametrize("how, accumulate, micro", [("raise", False, 1), ("detached", False, 1), ("raise", True, 1),
                                                    ("raise", True, 2)])
def test_a_loss_that_fails_on_one_rank_stops_every_rank_and_trains_nothing(how, accumulate, micro):
    r0, r1 = spawn(loss_fails_on_one_rank_worker, 2, how, accumulate, micro)
    if how == "raise":
        assert r1["error"] == "ArithmeticError: my loss failed here", r1["error"]
    else:
        assert r1["error"].startswith("ValueError: train_step: loss_fn returned a loss that does not depend on "
                                      "the model's outputs"), r1["error"]
    assert r0["error"].startswith(f"RuntimeError: train_step: loss_fn raised on rank(s) [1] in micro-batch {micro}"), \
        r0["error"]
    for r in (r0, r1):
        assert r["step_after_failure"] == 0 and r["unchanged"], r
        torch.testing.assert_close(r["good"], r["fresh"], rtol=0, atol=0)  # nothing of the failed step is left


@pytest.mark.slow  # spawns ranks
def test_a_constant_zero_loss_on_one_rank_is_legal():
    r0, r1 = spawn(loss_fails_on_one_rank_worker, 2, "zero")
    assert r0["error"] == r1["error"] == "", (r0["error"], r1["error"])
    torch.testing.assert_close(r0["failed_step_loss"], r1["failed_step_loss"])  # one global step, the same on both
    assert r0["step_after_failure"] == r1["step_after_failure"] == 1


def test_a_metric_that_is_not_a_number_is_named():
    engine = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4))
    batch = make_batch(B=4)

    def loss(outputs, mb):
        m = mb["response_mask"].float()
        return -(outputs["log_probs"] * m).sum() / m.sum(), {"per_row": m.sum(-1)}

    with pytest.raises(ValueError, match=r"loss_fn's metric 'per_row' must be a number or a one-element tensor, "
                                         r"got Tensor of shape \(4,\)"):
        engine.train_step(batch, loss)
    assert engine.global_step == 0
