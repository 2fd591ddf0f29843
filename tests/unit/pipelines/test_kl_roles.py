"""Why the reward penalty and the loss term use different KL estimators: exact expected gradients on a small
categorical policy (the claims of docs/algorithms.md)."""

import torch

from pipelines.algorithms import kl_penalty

torch.manual_seed(0)
THETA0 = torch.randn(6, dtype=torch.float64)
REF = torch.log_softmax(torch.randn(6, dtype=torch.float64), -1)


def _grad(fn) -> torch.Tensor:
    theta = THETA0.clone().requires_grad_(True)
    fn(torch.log_softmax(theta, -1)).backward()
    return theta.grad


def kl_fwd(logp):  # KL(pi || ref)
    return (logp.exp() * (logp - REF)).sum()


def kl_rev(logp):  # KL(ref || pi)
    return (REF.exp() * (REF - logp)).sum()


def as_reward(kind):
    """Expected policy gradient of the penalty used as a (detached) reward: E_pi[k(x) grad log pi(x)]."""
    return lambda logp: (logp.exp().detach() * kl_penalty(logp, REF, kind).detach() * logp).sum()


def as_loss(kind):
    """Expected gradient of the estimator used as a loss on samples from pi: E_pi[grad k(x)]."""
    return lambda logp: (logp.exp().detach() * kl_penalty(logp, REF, kind)).sum()


def test_k1_as_reward_has_the_kl_gradient_and_k3_does_not():
    fwd, rev = _grad(kl_fwd), _grad(kl_rev)
    torch.testing.assert_close(_grad(as_reward("k1")), fwd)
    k3 = _grad(as_reward("k3"))
    torch.testing.assert_close(k3, fwd - rev)  # the claim: grad KL(pi||ref) - grad KL(ref||pi)
    assert (k3 - fwd).norm() > 0.1 * fwd.norm()


def test_estimators_as_loss_terms():
    torch.testing.assert_close(_grad(as_loss("k3")), _grad(kl_rev))  # k3: the reverse KL's gradient
    torch.testing.assert_close(_grad(as_loss("k2")), _grad(kl_fwd))  # k2: the forward KL's gradient
    assert _grad(as_loss("k1")).abs().max() < 1e-12  # k1 as a loss: zero gradient in expectation
