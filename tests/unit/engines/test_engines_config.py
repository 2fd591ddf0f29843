"""EngineConfig refuses optimizer and schedule settings that would train silently wrong (a negative learning rate
from the schedule, AdamW settings torch only checks at construction), naming the field and its range."""

from __future__ import annotations

import math

import pytest

from engines.fsdp import EngineConfig, lr_factor

BAD = [
    ({"min_lr_ratio": -1.0, "lr_schedule": "cosine", "total_steps": 2}, "min_lr_ratio"),
    ({"min_lr_ratio": 1.5, "lr_schedule": "cosine", "total_steps": 2}, "min_lr_ratio"),
    ({"min_lr_ratio": math.nan}, "min_lr_ratio"),
    ({"lr": 0.0}, "lr"),
    ({"lr": -1e-3}, "lr"),
    ({"lr": math.inf}, "lr"),
    ({"lr": math.nan}, "lr"),
    ({"total_steps": 0}, "total_steps"),
    ({"total_steps": -3, "lr_schedule": "constant"}, "total_steps"),
    ({"grad_clip": math.nan}, "grad_clip"),
    ({"betas": (1.0, 0.999)}, "betas"),
    ({"betas": (0.9, 1.0)}, "betas"),
    ({"betas": (-0.1, 0.999)}, "betas"),
    ({"betas": (0.9, math.nan)}, "betas"),
    ({"betas": (0.9,)}, "betas"),
    ({"eps": 0.0}, "eps"),
    ({"eps": -1e-8}, "eps"),
    ({"eps": math.inf}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"weight_decay": math.nan}, "weight_decay"),
    ({"warmup_steps": -1}, "warmup_steps"),
]


@pytest.mark.parametrize(("kw", "field"), BAD, ids=[f"{f}={list(kw.values())[0]}" for kw, f in BAD])
def test_engine_config_refuses_out_of_range_values(kw, field):
    with pytest.raises(ValueError, match=rf"^EngineConfig\.{field} "):
        EngineConfig(**kw)


def test_engine_config_accepts_the_edges():
    EngineConfig(min_lr_ratio=0.0, lr_schedule="cosine", total_steps=1)
    EngineConfig(min_lr_ratio=1.0, lr_schedule="cosine", total_steps=1)
    EngineConfig(betas=(0.0, 0.0), weight_decay=0.0, grad_clip=None)
    EngineConfig(grad_clip=0.0)  # <= 0 disables clipping (documented)
    EngineConfig(betas=[0.9, 0.95])  # a list, as a JSON config gives it


def test_the_schedule_never_goes_below_zero():
    for r in (0.0, 0.1, 1.0):
        cfg = EngineConfig(lr=1.0, lr_schedule="cosine", total_steps=5, warmup_steps=2, min_lr_ratio=r)
        assert all(0.0 <= lr_factor(cfg, s) <= 1.0 for s in range(12))
        assert lr_factor(cfg, 11) == pytest.approx(r)
