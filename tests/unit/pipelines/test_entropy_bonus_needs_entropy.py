"""PolicyLoss(entropy_coef > 0) needs the policy's entropy: without it (train_step(with_entropy=False)) the bonus
was dropped silently. Now the engine refuses the call before computing anything, and the loss object refuses
outputs without entropy, each naming what to pass."""

import pytest
import torch
from pipelines_testutils import policy_batch, policy_model

from engines.fsdp import EngineConfig, FSDPEngine
from pipelines.objectives import PolicyLoss


def test_train_step_refuses_an_entropy_bonus_without_entropy():
    eng = FSDPEngine(policy_model, EngineConfig(lr=1e-3), model_kind="causal_lm")
    batch = policy_batch(B=4)
    with pytest.raises(ValueError, match=r"train_step: PolicyLoss needs the engine output 'entropy'.*"
                                         r"with_entropy=True"):
        eng.train_step(batch, PolicyLoss(entropy_coef=0.5), with_entropy=False)
    assert eng.global_step == 0
    assert eng.train_step(batch, PolicyLoss(entropy_coef=0.0), with_entropy=False)["skipped"] == 0.0


def test_policy_loss_refuses_outputs_without_entropy():
    batch = policy_batch(B=4)
    outputs = {"log_probs": batch["old_log_probs"].clone().requires_grad_(True)}
    with pytest.raises(ValueError, match=r"PolicyLoss: entropy_coef=0.5 needs outputs\['entropy'\].*"
                                         r"with_entropy=True"):
        PolicyLoss(entropy_coef=0.5)(outputs, batch)
    loss, _ = PolicyLoss(entropy_coef=0.5)({**outputs, "entropy": torch.ones_like(outputs["log_probs"])}, batch)
    assert torch.isfinite(loss)
    assert PolicyLoss(entropy_coef=0.5).required_outputs == ("log_probs", "entropy")
    assert PolicyLoss().required_outputs == ("log_probs",)
