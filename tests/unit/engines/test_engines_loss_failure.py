"""A ``loss_fn`` that fails on one rank stops every rank's ``train_step`` at once, with the failing rank's own
error there and one naming it elsewhere, and leaves the engine as it was before the step (was: the other ranks
waited in the backward's gradient collectives until the process group timed out)."""

from __future__ import annotations

import pytest
import torch
from dp_engine_testutils import loss_fails_on_one_rank_worker

from engines._dist import spawn

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # spawns ranks
@pytest.mark.parametrize("how", ["raise", "detached"])
def test_a_loss_that_fails_on_one_rank_stops_every_rank_and_trains_nothing(how):
    r0, r1 = spawn(loss_fails_on_one_rank_worker, 2, how)
    if how == "raise":
        assert r1["error"] == "ArithmeticError: my loss failed here", r1["error"]
    else:
        assert r1["error"].startswith("ValueError: train_step: loss_fn returned a loss that does not depend on "
                                      "the model's outputs"), r1["error"]
    assert r0["error"].startswith("RuntimeError: train_step: loss_fn raised on rank(s) [1] in micro-batch 1"), r0["error"]
    for r in (r0, r1):
        assert r["step_after_failure"] == 0 and r["unchanged"], r
        torch.testing.assert_close(r["good"], r["fresh"])  # nothing of the failed step is left
