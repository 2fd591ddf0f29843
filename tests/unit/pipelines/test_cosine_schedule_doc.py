"""The documented end of the cosine schedule is what engines.fsdp.lr_factor does: min_lr_ratio x lr at optimizer
step ``total_steps``, one past the last step a run takes (steps 0 .. total_steps - 1), so the last step runs
slightly above it. (Changing the schedule instead would change the main job's learning rates; the doc was wrong.)"""

import pytest

from engines.fsdp import EngineConfig, lr_factor
from pipelines.config import ActorConfig, CriticConfig


@pytest.mark.parametrize(("total", "warmup"), [(4, 0), (4, 2), (16, 8), (2400, 80)])
def test_cosine_reaches_min_lr_ratio_one_step_after_the_last(total, warmup):
    cfg = EngineConfig(lr=1.0, lr_schedule="cosine", total_steps=total, warmup_steps=warmup, min_lr_ratio=0.1)
    assert lr_factor(cfg, total) == pytest.approx(0.1)
    assert lr_factor(cfg, total - 1) > 0.1  # the last step that runs


def test_the_config_help_says_where_the_cosine_schedule_ends():
    for section in (ActorConfig, CriticConfig):
        text = section.model_fields["lr_schedule"].description + " " + \
            section.model_fields["min_lr_ratio"].description
        assert "at the last optimizer step" not in text, text
        assert "one step after the last optimizer step" in text, text
