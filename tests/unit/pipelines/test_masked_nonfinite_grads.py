"""Masked positions never influence a loss *or its gradient*, even when they hold NaN or inf
(pipelines/algorithms/masked.py's promise): every policy loss and the value loss, every aggregation mode."""

import pytest
import torch

from pipelines.algorithms import (AGG_MODES, KL_KINDS, cispo_loss, gmpo_loss, gspo_loss, kl_loss, policy_loss,
                                 value_loss)

MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])


def _poison(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(MASK.bool(), x, torch.tensor(value, dtype=x.dtype))


def _grad(fn, *args, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    x = args[0].clone().requires_grad_(True)
    loss, _ = fn(x, *args[1:], **kw)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("fn", [policy_loss, gspo_loss, gmpo_loss, cispo_loss], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_policy_losses_ignore_non_finite_values_at_masked_positions(fn, agg, bad):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g) * 2
    old = logp + 0.1 * torch.randn(3, 4, generator=g)
    adv = torch.randn(3, 4, generator=g)
    clean_loss, clean_grad = _grad(fn, logp, old, _poison(adv, 0.0), MASK, agg=agg)
    for args in ((logp, old, _poison(adv, bad)), (logp, _poison(old, bad), _poison(adv, 0.0)),
                 (_poison(logp, bad), old, _poison(adv, 0.0))):
        loss, grad = _grad(fn, *args, MASK, agg=agg)
        assert torch.isfinite(grad).all(), f"{fn.__name__}/{agg}: non-finite gradient from a masked {bad}"
        torch.testing.assert_close(loss, clean_loss)
        torch.testing.assert_close(grad, clean_grad)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("clip_range", [0.2, None])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_value_loss_ignores_non_finite_values_at_masked_positions(agg, clip_range, bad):
    g = torch.Generator().manual_seed(1)
    values, old, returns = (torch.randn(3, 4, generator=g) for _ in range(3))
    clean_loss, clean_grad = _grad(value_loss, values, old, returns, MASK, clip_range=clip_range, agg=agg)
    for args in ((values, old, _poison(returns, bad)), (values, _poison(old, bad), returns),
                 (_poison(values, bad), old, returns)):
        loss, grad = _grad(value_loss, *args, MASK, clip_range=clip_range, agg=agg)
        assert torch.isfinite(grad).all(), f"value_loss/{agg}: non-finite gradient from a masked {bad}"
        torch.testing.assert_close(loss, clean_loss)
        torch.testing.assert_close(grad, clean_grad)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("kind", KL_KINDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_kl_loss_ignores_non_finite_values_at_masked_positions(kind, agg, bad):
    """k2's ``d**2 / 2`` backpropagated ``2 * d * 0`` = NaN from a masked non-finite ``d`` (the aggregation's
    ``where`` came after the arithmetic); every estimator now masks ``d`` first."""
    g = torch.Generator().manual_seed(2)
    logp = -torch.rand(3, 4, generator=g) * 2
    ref = logp + 0.3 * torch.randn(3, 4, generator=g)

    def kl(x, r, mask, agg):
        return kl_loss(x, r, mask, kind=kind, agg=agg), None

    clean_loss, clean_grad = _grad(kl, logp, ref, MASK, agg=agg)
    for args in ((_poison(logp, bad), ref), (logp, _poison(ref, bad)), (_poison(logp, bad), _poison(ref, bad))):
        loss, grad = _grad(kl, *args, MASK, agg=agg)
        assert torch.isfinite(grad).all(), f"kl_loss {kind}/{agg}: non-finite gradient from a masked {bad}"
        torch.testing.assert_close(loss, clean_loss)
        torch.testing.assert_close(grad, clean_grad)
