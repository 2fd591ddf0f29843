"""A train_step with no response token on any rank has nothing to train on: it must not touch the optimizer (no
momentum or weight-decay update, no schedule step) and reports ``skipped=1`` with a warning saying why."""

from __future__ import annotations

import contextlib

import pytest
import torch
from dp_engine_testutils import masked_token_mean_loss, token_less_step_worker
from engines_testutils import make_batch, model_factory

from engines._dist import spawn
from engines.fsdp import EngineConfig, FSDPEngine

pytestmark = pytest.mark.timeout(300)


def test_a_step_without_response_tokens_leaves_the_weights_alone(caplog):
    eng = FSDPEngine(model_factory(0), EngineConfig(lr=1e-2, weight_decay=0.1, lr_schedule="cosine", total_steps=4))
    batch = make_batch(B=4)
    eng.train_step(batch, masked_token_mean_loss)
    before = {k: v.clone() for k, v in eng.full_state_dict().items()}
    lr_before, step_before = eng.lr, eng.global_step
    masked = {**batch, "response_mask": torch.zeros_like(batch["response_mask"])}
    with caplog.at_level("WARNING", logger="orchestra"):
        m = eng.train_step(masked, masked_token_mean_loss)
    after = eng.full_state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert not moved, f"a step without response tokens changed {moved[:3]}..."
    assert (m["skipped"], m["tokens"], m["step"], m["grad_norm"]) == (1.0, 0.0, float(step_before), 0.0)
    assert (eng.lr, eng.global_step) == (lr_before, step_before)  # the schedule did not advance
    (msg,) = [r.getMessage() for r in caplog.records if "no response token" in r.getMessage()]
    assert "response_mask" in msg and "skipped" in msg
    assert eng.train_step(batch, masked_token_mean_loss)["skipped"] == 0.0  # the next step trains as usual


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_token_less_steps_on_two_ranks():
    """No token on either rank: both skip, in step. No token on rank 0 only: rank 1's tokens train both."""
    per_rank = spawn(token_less_step_worker, 2)
    for rank, (none, one_sided) in enumerate(per_rank):
        assert none["metrics"]["skipped"] == 1.0 and not none["moved"], rank
        assert one_sided["metrics"]["skipped"] == 0.0 and one_sided["moved"], rank
        assert one_sided["metrics"]["tokens"] > 0


def test_update_metrics_keep_the_loss_metrics_when_the_first_step_was_skipped():
    """``_train`` averages every metric any step reports (a token-less step reports no loss_fn metrics)."""
    from engines.workers import _train
    from orchestra import Batch

    class Scripted:
        def __init__(self) -> None:
            self.steps = iter([{"loss": 0.0, "skipped": 1.0, "step": 0.0, "lr": 1.0},
                               {"loss": 2.0, "pg_loss": 3.0, "skipped": 0.0, "step": 1.0, "lr": 1.0}])

        def collective(self, what):
            return contextlib.nullcontext()  # one rank: nothing to guard

        def train_step(self, batch, loss_fn, **kw):
            return next(self.steps)

    out = _train(Scripted(), Batch.from_dict({"x": torch.arange(2)}), lambda o, m: (0, {}), 2, 1, "actor", "update")
    assert out["actor/pg_loss"] == 3.0 and out["actor/skipped"] == 1.0 and out["actor/step"] == 1.0
