"""What ``perf/step_s``, ``perf/tokens_per_s`` and ``actor/tokens`` measure. With ``runner.max_staleness=1`` a step's
rollout is launched during the step before, and ``perf/step_s`` counted from that launch: the overlapped run, which
is faster, logged longer steps and fewer tokens a second. ``actor/tokens`` summed every epoch's pass over the same
rows (4x with ppo_epochs=4), while ``actor/rows`` was per mini-batch."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from local_jobs import local_runner

from engines.workers import _train
from orchestra import Batch


class _Engine:
    """Enough of an engine for ``_train``: each step reports the rows and response tokens it trained on."""

    dp_size, dp_rank, device = 1, 0, torch.device("cpu")

    def collective(self, what: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # one rank: nothing to guard

    def train_step(self, tensors: object, loss_fn: object, **kw: object) -> dict[str, float]:
        mask = tensors["response_mask"]
        return {"loss": 1.0, "tokens": float(mask.sum()), "rows": float(len(mask))}


def test_tokens_and_rows_count_the_update_rows_once_whatever_the_epochs():
    batch = Batch.from_dict({"response_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])})
    for epochs, minis in ((1, 1), (4, 1), (3, 2)):
        out = _train(_Engine(), batch, lambda o, mb: (None, {}), epochs, minis, "actor", "update_actor")
        assert (out["actor/tokens"], out["actor/rows"]) == (9.0, 4.0), (epochs, minis)
        assert out["actor/optimizer_steps"] == epochs * minis


@pytest.mark.slow  # a real (in-process) 3-step job, ~5 s
async def test_step_seconds_are_the_time_between_recorded_steps_also_when_rollouts_overlap(tmp_path):
    hist = await local_runner(tmp_path / "run", "runner.max_staleness=1", "runner.total_steps=3").run()
    for prev, cur in zip(hist, hist[1:]):
        assert cur["perf/step_s"] == pytest.approx(cur["time"] - prev["time"], abs=1e-9)
        assert cur["perf/tokens_per_s"] == pytest.approx(cur["actor/tokens"] / cur["perf/step_s"])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["perf/step_s"] for r in lines] == [h["perf/step_s"] for h in hist]
