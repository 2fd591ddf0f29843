"""EngineConfig refuses step and row counts that are not integers (a warmup of 1.5 steps gave fractional LR
factors; micro_batch_size=2.5 failed deep in slicing) and a cosine schedule whose total_steps do not go past the
warmup (the LR jumped from the warmup's end straight to min_lr)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.fsdp import EngineConfig


@pytest.mark.parametrize("kw,pattern", [
    ({"micro_batch_size": 2.5}, r"EngineConfig\.micro_batch_size must be an integer >= 1.*, got 2\.5"),
    ({"micro_batch_size": True}, r"EngineConfig\.micro_batch_size must be an integer >= 1.*, got True"),
    ({"forward_micro_batch_size": 4.0}, r"EngineConfig\.forward_micro_batch_size must be an integer >= 1 or None"),
    ({"warmup_steps": 1.5}, r"EngineConfig\.warmup_steps must be an integer >= 0.*, got 1\.5"),
    ({"schedule_start": 2.0}, r"EngineConfig\.schedule_start must be an integer >= 0.*, got 2\.0"),
    ({"total_steps": 2.5, "lr_schedule": "cosine"}, r"EngineConfig\.total_steps must be an integer >= 1 or None"),
    ({"lr_schedule": "cosine", "warmup_steps": 10, "total_steps": 5},
     r"total_steps \(5\) must be greater than warmup_steps \(10\).*cosine"),
    ({"lr_schedule": "cosine", "warmup_steps": 10, "total_steps": 10},
     r"total_steps \(10\) must be greater than warmup_steps \(10\).*cosine"),
])
def test_bad_schedule_and_batch_fields_are_refused(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        EngineConfig(**kw)


def test_good_values_pass():
    EngineConfig(lr_schedule="cosine", warmup_steps=10, total_steps=11)
    EngineConfig(warmup_steps=10, total_steps=5)  # a constant schedule has no decay to start: total_steps unused
    EngineConfig(micro_batch_size=np.int64(4), warmup_steps=np.int64(2), forward_micro_batch_size=None)
