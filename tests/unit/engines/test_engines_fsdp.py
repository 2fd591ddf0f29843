"""FSDPEngine numerics: 2-rank FSDP vs an unsharded single-process reference, accumulation
invariance, value models, checkpoints, schedules and error messages."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from engines_testutils import (
    VOCAB,
    assert_states_close,
    make_batch,
    model_factory,
    parity_and_save_load_worker,
    ref_log_probs,
    reference_steps,
    row_mean_loss,
    token_mean_loss,
)

from engines._dist import spawn
from engines.fsdp import EngineConfig, FSDPEngine, lr_factor
from engines.models import build_causal_lm, build_value_model, tiny_qwen2_config

pytestmark = pytest.mark.timeout(300)  # a bound on a hang; spawns take minutes on a loaded 2-core box


# 7 rows -> rank 0 holds 4 (2 micro-batches of 3+1), rank 1 holds 3 (1 micro-batch):
# uneven micro-batch counts exercise the zero-weight dummy path.
PARITY_BATCH = make_batch(B=7)
PARITY_CFG = EngineConfig(lr=1e-3, weight_decay=0.01, warmup_steps=2, grad_clip=0.5, micro_batch_size=3)
SAVE_LOAD_BATCH = make_batch(B=4, seed=5)
SAVE_LOAD_CFG = EngineConfig(lr=1e-3, warmup_steps=3, micro_batch_size=2)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> tuple[list, list, object]:
    """The module's two 2-rank runs in one spawn (each spawn starts a fresh torch process per rank): per rank, the
    parity run's results and the save/load run's, and the save/load run's checkpoint directory."""
    ckpt = tmp_path_factory.mktemp("fsdp_round_trip") / "ckpt"
    variant = replace(PARITY_CFG, accumulate_without_sync=True, gradient_checkpointing=True)
    per_rank = spawn(parity_and_save_load_worker, 2, ([PARITY_CFG, variant], PARITY_BATCH, 2),
                     (SAVE_LOAD_CFG, SAVE_LOAD_BATCH, str(ckpt)))
    return [p for p, _ in per_rank], [s for _, s in per_rank], ckpt


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_two_rank_fsdp_matches_unsharded_reference(two_rank_runs):
    batch, cfg = PARITY_BATCH, PARITY_CFG
    per_rank = two_rank_runs[0]

    ref_model, ref_losses = reference_steps(cfg, batch, steps=2)
    ref0 = build_causal_lm(tiny_qwen2_config(VOCAB), seed=0)
    with torch.no_grad():
        ref_lp = ref_log_probs(ref0, batch)
    for which in range(2):
        results = [r[which] for r in per_rank]
        for r in results:
            a, b = r["rows"]
            torch.testing.assert_close(r["log_probs"], ref_lp[a:b], atol=1e-5, rtol=0)
            assert r["entropy"].shape == (b - a, batch["responses"].shape[1])
        assert [r["dp"] for r in results] == [(0, 2, True), (1, 2, True)]

        m0 = results[0]["metrics"]
        assert m0 == results[1]["metrics"]  # metrics are global
        for s in range(2):
            assert m0[s]["loss"] == pytest.approx(ref_losses[s], rel=1e-5, abs=1e-6)
            assert m0[s]["lr"] == pytest.approx(cfg.lr * (s + 1) / 2)
            assert m0[s]["tokens"] == float(batch["response_mask"].sum())
            assert m0[s]["rows"] == 7.0
            assert m0[s]["grad_norm"] > cfg.grad_clip  # clipping was active
        assert results[1]["state"] == {}  # rank0_only gather
        assert_states_close(results[0]["state"], ref_model.state_dict())


@pytest.mark.parametrize("scale,loss_fn", [("tokens", token_mean_loss), ("rows", row_mean_loss)])
def test_result_independent_of_micro_batch_size(scale, loss_fn):
    batch = make_batch(B=6, seed=3)
    states, metrics = [], []
    for mbs in (1, 4, 6):
        cfg = EngineConfig(lr=1e-3, grad_clip=None, micro_batch_size=mbs, loss_scale=scale)
        eng = FSDPEngine(model_factory(0), cfg)
        metrics.append(eng.train_step(batch, loss_fn))
        states.append(eng.full_state_dict())
    for m in metrics[1:]:
        assert m["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5)
        assert m["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-4)
    for s in states[1:]:
        assert_states_close(s, states[0])
    # full batch in one micro-batch equals the plain reference
    ref_model, ref_losses = reference_steps(
        EngineConfig(lr=1e-3, grad_clip=None), batch, steps=1, scale=scale
    )
    assert metrics[-1]["loss"] == pytest.approx(ref_losses[0], rel=1e-5)
    assert_states_close(states[-1], ref_model.state_dict())


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_save_load_round_trip(two_rank_runs):
    cfg = SAVE_LOAD_CFG
    _, res, ckpt = two_rank_runs
    assert res[0]["loaded_equal"] is True
    assert res[0]["max_diff_after_step"] == 0.0  # optimizer state and lr restored too
    ma, mb = res[0]["metrics"]
    assert ma["lr"] == mb["lr"] == pytest.approx(cfg.lr * 2 / 3)
    assert res[0]["step"] == 2
    # resharding: the 2-rank checkpoint loads into a 1-rank engine in this process
    eng = FSDPEngine(model_factory(7), cfg)
    eng.load(ckpt)
    assert eng.global_step == 1
    assert eng.lr == pytest.approx(cfg.lr * 2 / 3)


def test_value_model_engine():
    batch = make_batch(B=5, seed=2)
    cfg = EngineConfig(lr=1e-3, micro_batch_size=2)
    eng = FSDPEngine(lambda: build_value_model(tiny_qwen2_config(VOCAB), seed=4), cfg)
    assert eng.model_kind == "value"
    vals = eng.compute_values(batch)["values"]
    ref = build_value_model(tiny_qwen2_config(VOCAB), seed=4).eval()
    am = batch["attention_mask"]
    with torch.no_grad():
        out = ref(input_ids=batch["input_ids"], attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0))
    R = batch["responses"].shape[1]
    torch.testing.assert_close(vals, out.logits[:, -R - 1 : -1, 0] * batch["response_mask"], atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="compute_values"):
        eng.compute_log_prob(batch)

    def mse(outputs, mb):
        m = mb["response_mask"].float()
        return (((outputs["values"] - 1.0) ** 2) * m).sum() / m.sum(), {}

    first = eng.train_step(batch, mse)["loss"]
    for _ in range(5):
        last = eng.train_step(batch, mse)["loss"]
    assert last < first


def test_temperature_and_entropy():
    batch = make_batch(B=3, seed=9)
    eng = FSDPEngine(model_factory(0), EngineConfig())
    out = eng.compute_log_prob(batch, temperature=0.7, with_entropy=True)
    ref = build_causal_lm(tiny_qwen2_config(VOCAB), seed=0)
    with torch.no_grad():
        torch.testing.assert_close(out["log_probs"], ref_log_probs(ref, batch, 0.7), atol=1e-5, rtol=0)
    m = batch["response_mask"].bool()
    assert (out["entropy"][m] > 0).all() and (out["entropy"][m] <= math.log(VOCAB) + 1e-4).all()
    assert (out["entropy"][~m] == 0).all()


def test_lr_schedule():
    c = EngineConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    f = [lr_factor(c, s) for s in range(8)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0) and f[2] == pytest.approx(1.0)
    assert f[4] == pytest.approx(0.1 + 0.9 * 0.5)
    assert f[6] == pytest.approx(0.1) and f[7] == pytest.approx(0.1)
    assert lr_factor(EngineConfig(), 100) == 1.0
    with pytest.raises(ValueError, match="total_steps"):
        EngineConfig(lr_schedule="cosine")


def test_schedule_start_and_a_steps_own_lr():
    """A warm start's steps run at their own rate and do not use up the schedule: with ``schedule_start=3`` the
    warmup and cosine begin at optimizer step 3."""
    c = EngineConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=6, min_lr_ratio=0.1, schedule_start=3)
    plain = EngineConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    assert [lr_factor(c, s + 3) for s in range(8)] == [lr_factor(plain, s) for s in range(8)]
    with pytest.raises(ValueError, match="schedule_start"):
        EngineConfig(schedule_start=-1)
    eng = FSDPEngine(model_factory(0), EngineConfig(lr=1e-3, warmup_steps=4, schedule_start=1))
    batch = make_batch(B=2)
    assert eng.train_step(batch, token_mean_loss, lr=5e-2)["lr"] == pytest.approx(5e-2)  # the warm start's rate
    assert eng.train_step(batch, token_mean_loss)["lr"] == pytest.approx(1e-3 / 4)  # the schedule's step 0
    with pytest.raises(ValueError, match="lr must be a finite number"):
        eng.train_step(batch, token_mean_loss, lr=float("nan"))


def test_errors_and_cpu_offload():
    eng = FSDPEngine(model_factory(0), EngineConfig())
    batch = make_batch(B=2)
    with pytest.raises(KeyError, match="response_mask"):
        eng.train_step({k: v for k, v in batch.items() if k != "response_mask"}, token_mean_loss)
    with pytest.raises(KeyError, match="attention_mask"):
        eng.compute_log_prob({k: v for k, v in batch.items() if k != "attention_mask"})
    with pytest.raises(ValueError, match="float32"):
        FSDPEngine(lambda: build_causal_lm(tiny_qwen2_config(VOCAB), dtype=torch.bfloat16), EngineConfig())
    assert eng.offload() == 0 and eng.onload() == 0  # CPU engine: nothing moves
    eng.compute_log_prob(batch)  # still usable


def test_tensordict_input_with_non_tensor_columns():
    from tensordict import NonTensorData, TensorDict

    batch = make_batch(B=3)
    td = TensorDict(batch, batch_size=[3])
    td["text"] = NonTensorData(["x", "y", "z"], batch_size=[3])
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2))
    out = eng.compute_log_prob(td)
    assert out.batch_size == torch.Size([3])
    torch.testing.assert_close(out["log_probs"], eng.compute_log_prob(batch)["log_probs"])
    seen = []
    eng.train_step(td, lambda o, mb: (seen.append(sorted(mb)) or token_mean_loss(o, mb)))
    assert "text" not in seen[0] and "advantages" in seen[0]


class _LogProbProbe:
    """A token-mean loss that also reports how far train_step's log-probs are from ``old_log_probs``."""

    def __call__(self, outputs, mb):
        m = mb["response_mask"].float()
        gap = ((outputs["log_probs"] - mb["old_log_probs"]).abs() * m).max()
        return -(outputs["log_probs"] * m).sum() / m.sum(), {"gap": gap.detach()}


@pytest.mark.parametrize("where", ["config", "module"])
def test_training_runs_without_the_models_dropout(where, caplog):
    """A model with dropout (a checkpoint's attention_dropout, or an nn.Dropout of one's own) kept it on in
    train_step (train mode) while compute_log_prob ran in eval mode: with the same weights the update saw other
    log-probs than the old ones (up to 0.125 apart per token at attention_dropout=0.2), so the PPO ratio was not 1
    and clipping hit random tokens. The engine turns dropout off and says so."""
    def build():
        if where == "config":
            return build_causal_lm(tiny_qwen2_config(VOCAB, attention_dropout=0.5), seed=0)
        model = build_causal_lm(tiny_qwen2_config(VOCAB), seed=0)
        model.model.embed_tokens = torch.nn.Sequential(model.model.embed_tokens, torch.nn.Dropout(0.5))
        return model

    eng = FSDPEngine(build, EngineConfig(lr=1e-12, micro_batch_size=8))
    assert "dropout" in caplog.text and "turned off" in caplog.text
    batch = make_batch(B=8, R=8)
    batch["old_log_probs"] = eng.compute_log_prob(batch)["log_probs"]
    assert eng.train_step(batch, _LogProbProbe())["gap"] < 1e-5
