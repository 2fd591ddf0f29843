"""FSDPEngine.load under changed optimizer hyperparameters: the running config's AdamW settings (weight decay,
betas, eps, like the learning rate) are the ones in effect after the load, and the load says what changed."""

from __future__ import annotations

import dataclasses

import pytest
from engines_testutils import make_batch, model_factory, token_mean_loss

from engines.fsdp import EngineConfig, FSDPEngine

pytestmark = pytest.mark.timeout(300)

SAVED = EngineConfig(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, micro_batch_size=4)


def _saved_checkpoint(path) -> None:
    eng = FSDPEngine(model_factory(0), SAVED)
    eng.train_step(make_batch(B=4), token_mean_loss)
    eng.save(path)


def test_load_applies_the_running_configs_optimizer_hyperparameters(tmp_path, caplog):
    _saved_checkpoint(tmp_path / "ckpt")
    now = dataclasses.replace(SAVED, lr=2e-3, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)
    eng = FSDPEngine(model_factory(1), now)
    with caplog.at_level("WARNING", logger="orchestra"):
        eng.load(tmp_path / "ckpt")
    for group in eng.optimizer.param_groups:
        assert (group["lr"], group["weight_decay"], tuple(group["betas"]), group["eps"]) == (2e-3, 0.1, (0.8, 0.95),
                                                                                            1e-6)
    (msg,) = [r.getMessage() for r in caplog.records if "optimizer hyperparameters" in r.getMessage()]
    assert "weight_decay: 0.0 -> 0.1" in msg and "betas: (0.9, 0.999) -> (0.8, 0.95)" in msg
    assert "eps: 1e-08 -> 1e-06" in msg


def test_load_under_the_same_optimizer_hyperparameters_says_nothing(tmp_path, caplog):
    _saved_checkpoint(tmp_path / "ckpt")
    eng = FSDPEngine(model_factory(1), SAVED)
    with caplog.at_level("WARNING", logger="orchestra"):
        eng.load(tmp_path / "ckpt")
    assert not [r for r in caplog.records if "optimizer hyperparameters" in r.getMessage()]
    group = eng.optimizer.param_groups[0]
    assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.0, (0.9, 0.999), 1e-8)
