"""FSDPEngine.train_step checks the columns its loss reads before computing anything: a missing column, one of the
wrong shape or dtype raises an error naming the column, its shape and the expected one (and what to pass), instead
of a bare KeyError or a torch broadcasting error from inside the loss."""

import pytest
import torch
from pipelines_testutils import policy_batch, policy_model

from engines.fsdp import EngineConfig, FSDPEngine
from engines.models import build_value_model, tiny_qwen2_config
from pipelines.objectives import PolicyLoss, ValueLoss

B, R = 6, 8


@pytest.fixture(scope="module")
def engine() -> FSDPEngine:
    return FSDPEngine(policy_model, EngineConfig(lr=1e-3, micro_batch_size=4), model_kind="causal_lm")


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return policy_batch(B=B, R=R)


def _without(batch, key):
    return {k: v for k, v in batch.items() if k != key}


CASES = [
    ("missing old_log_probs", lambda b: _without(b, "old_log_probs"), PolicyLoss(), KeyError,
     r"train_step: PolicyLoss needs column 'old_log_probs' \[rows, response_len\] = \(6, 8\).*compute_log_prob"),
    ("missing advantages", lambda b: _without(b, "advantages"), PolicyLoss(), KeyError,
     r"PolicyLoss needs column 'advantages' \[rows\] = \(6,\) or \[rows, response_len\] = \(6, 8\)"),
    ("kl without ref_log_probs", lambda b: _without(b, "ref_log_probs"), PolicyLoss(kl_coef=0.1), KeyError,
     r"PolicyLoss needs column 'ref_log_probs'.*kl_coef=0.1.*compute_ref_log_prob.*kl_coef=0"),
    ("tis without rollout_log_probs", lambda b: b, PolicyLoss(rollout_is_cap=2.0), KeyError,
     r"PolicyLoss needs column 'rollout_log_probs'.*rollout_is_cap=2.0"),
    ("advantages [B, R+1]", lambda b: {**b, "advantages": torch.zeros(B, R + 1)}, PolicyLoss(), ValueError,
     r"train_step: column 'advantages' has shape \(6, 9\) on rank 0; PolicyLoss needs \[rows\] = \(6,\) or "
     r"\[rows, response_len\] = \(6, 8\)"),
    ("old_log_probs [B, R-1]", lambda b: {**b, "old_log_probs": torch.zeros(B, R - 1)}, PolicyLoss(), ValueError,
     r"column 'old_log_probs' has shape \(6, 7\) on rank 0; PolicyLoss needs \[rows, response_len\] = \(6, 8\)"),
    ("old_log_probs int", lambda b: {**b, "old_log_probs": b["old_log_probs"].long()}, PolicyLoss(), ValueError,
     r"column 'old_log_probs' has dtype torch.int64 on rank 0; PolicyLoss needs a floating-point tensor"),
    ("response_mask [B, R-1]", lambda b: {**b, "response_mask": b["response_mask"][:, :R - 1]}, PolicyLoss(),
     ValueError, r"column 'response_mask' has shape \(6, 7\) on rank 0; it must be \[rows, response_len\] = \(6, 8\)"),
    ("missing responses", lambda b: _without(b, "responses"), PolicyLoss(), KeyError,
     r"train_step: batch needs 'responses' \[rows, response_len\]"),
]


@pytest.mark.parametrize(("make", "loss", "error", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_train_step_names_the_bad_column(engine, batch, make, loss, error, match):
    step = engine.global_step
    with pytest.raises(error, match=match):
        engine.train_step(make(batch), loss)
    assert engine.global_step == step


def test_value_loss_columns():
    eng = FSDPEngine(lambda: build_value_model(tiny_qwen2_config(64), seed=0), EngineConfig(micro_batch_size=4),
                     model_kind="value")
    b = policy_batch(B=B, R=R)
    b = {**b, "values": torch.zeros(B, R), "returns": torch.ones(B, R)}
    with pytest.raises(KeyError, match=r"ValueLoss needs column 'returns' \[rows, response_len\] = \(6, 8\)"):
        eng.train_step(_without(b, "returns"), ValueLoss())
    with pytest.raises(ValueError, match=r"column 'values' has shape \(6,\) on rank 0; ValueLoss needs \[rows, "
                                         r"response_len\] = \(6, 8\)"):
        eng.train_step({**b, "values": torch.zeros(B)}, ValueLoss())
    assert eng.train_step(b, ValueLoss())["skipped"] == 0.0


def test_well_formed_batches_still_train(engine, batch):
    for adv in (batch["advantages"], batch["advantages"][:, None].expand(B, R).contiguous()):
        assert engine.train_step({**batch, "advantages": adv}, PolicyLoss(kl_coef=0.1))["skipped"] == 0.0
