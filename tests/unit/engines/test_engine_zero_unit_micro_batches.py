"""A micro-batch with no loss unit (e.g. every response masked out) weighs 0 in the step: it must contribute exactly
nothing, even when the loss is 0/0 there (sum / mask.sum() gives NaN, and NaN * 0 is NaN), so the step does not
depend on micro_batch_size. A step skipped for a non-finite gradient says so."""

from __future__ import annotations

import logging

import pytest
import torch
from engines_testutils import make_batch, model_factory, token_mean_loss

from engines.fsdp import EngineConfig, FSDPEngine


def _step(mbs: int, batch: dict[str, torch.Tensor], loss_fn) -> tuple[dict[str, float], list[torch.Tensor]]:
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=mbs))
    r = eng.train_step(batch, loss_fn)
    return r, list(eng.full_state_dict().values())


def test_a_micro_batch_without_response_tokens_contributes_nothing_at_any_micro_batch_size(caplog):
    b = make_batch(B=4)
    b["response_mask"][3] = 0  # a row masked out entirely (an overlong-filtered sample): its micro-batch is empty
    calls: list[int] = []

    def loss(outputs, mb):  # the repo's plain sum / m.sum(): NaN on a micro-batch without a token
        calls.append(int(mb["response_mask"].sum()))
        return token_mean_loss(outputs, mb)

    with caplog.at_level(logging.WARNING, logger="orchestra"):
        results = {mbs: _step(mbs, b, loss) for mbs in (4, 2, 1)}
    assert 0 not in calls, "the loss function was called on a micro-batch without a loss unit"
    ref, ref_w = results[4]
    assert ref["skipped"] == 0.0 and ref["step"] == 1.0
    for mbs, (r, w) in results.items():
        assert r["skipped"] == 0.0, mbs
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), mbs
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), mbs
        assert r["entropy"] == pytest.approx(ref["entropy"], rel=1e-5), mbs
        assert all(torch.allclose(a, c, atol=1e-6) for a, c in zip(ref_w, w)), mbs
    assert not [r for r in caplog.records if "not finite" in r.getMessage()]


def test_a_step_skipped_for_a_non_finite_gradient_logs_a_warning(caplog):
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2))
    b = make_batch(B=4)

    def nan_loss(outputs, mb):
        return outputs["log_probs"].sum() * float("nan"), {}

    with caplog.at_level(logging.WARNING, logger="orchestra"):
        r = eng.train_step(b, nan_loss)
    assert r["skipped"] == 1.0 and r["step"] == 0.0
    (msg,) = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert "grad_norm=nan" in msg and "step 1" in msg and "skipped" in msg and "4 rows" in msg, msg


class _TokenMeanWithRowsMetric:
    """A token-mean loss (NaN over no token) that also reports a per-row metric: a micro-batch without tokens but
    with rows calls it for that metric; its token-scaled metric there is 0/0."""

    loss_scale = "tokens"
    metric_scales = {"rows_seen": "rows"}

    def __call__(self, outputs, mb):
        m = mb["response_mask"].float()
        lp = outputs["log_probs"]
        tok_mean = (lp * m).sum() / m.sum()  # NaN where the micro-batch has no token
        return -tok_mean, {"tok_metric": float(tok_mean.detach()), "rows_seen": float((m.sum(-1) > 0).float().mean())}


def test_a_token_metric_of_a_micro_batch_without_tokens_adds_nothing_not_nan():
    # the micro-batch without a token is called for its per-row metric; its token metric (0/0) was added as NaN x 0
    b = make_batch(B=4)
    b["response_mask"][3] = 0
    results = {mbs: _step(mbs, b, _TokenMeanWithRowsMetric())[0] for mbs in (4, 1)}
    for mbs, r in results.items():
        assert r["skipped"] == 0.0 and torch.isfinite(torch.tensor(r["tok_metric"])), (mbs, r)
        assert r["tok_metric"] == pytest.approx(results[4]["tok_metric"], rel=1e-5), mbs
        assert r["rows_seen"] == pytest.approx(results[4]["rows_seen"], rel=1e-5), mbs
