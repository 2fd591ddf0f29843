"""One draw of the prompt sampler never holds a record twice: a draw never spans two epochs (two permutations could
give it one record twice), and a draw longer than an epoch is refused, naming the sizes. DAPO's extra sampling
round rounds its prompts up to a multiple of ``resources.rollout_workers``, beyond ``data.prompts_per_step``; on data
of fewer records than that (``num_prompts=3``, ``prompts_per_step=3``, 2 rollout workers: a round of 4) the runner
draws at most an epoch, so the round holds no prompt twice. Before, the sampler ran on into the next epoch's
permutation and the round held a prompt twice."""

from __future__ import annotations

from typing import Any

import pytest

from fake_engine_ckpt import FakeCluster
from pipelines.config import load_config
from pipelines.data import PromptSampler
from pipelines.dynamic_sampling import next_round_prompts
from pipelines.runner import Runner

THREE = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
def test_a_take_longer_than_an_epoch_is_refused_naming_the_sizes(shuffle):
    s = PromptSampler(THREE, batch_size=3, seed=0, shuffle=shuffle)
    next(s)
    with pytest.raises(ValueError, match=r"take\(4\).*3 records"):
        s.take(4)
    assert s.records_per_epoch == 3
    assert sorted(r["prompt"] for r in s.take(3)) == sorted(r["prompt"] for r in THREE)  # the position is unchanged


def test_a_take_of_a_whole_epoch_mid_epoch_starts_the_next_one():
    s = PromptSampler([{"i": i} for i in range(7)], batch_size=3, seed=0)  # shuffled: an epoch is 6 records
    s.take(2)
    drawn = [r["i"] for r in s.take(s.records_per_epoch)]
    assert len(set(drawn)) == 6 and s.epoch == 2


class _Recording:
    """A rollout group that records the prompts of each generate call."""

    def __init__(self) -> None:
        self.prompts: list[list[list[int]]] = []

    def generate(self, batch: Any, micro_batches: int = 1, **kwargs: Any) -> Any:
        self.prompts.append(batch["prompts"].tolist())
        return object()


@pytest.mark.parametrize("shuffle", ["true", "false"])
def test_a_dapo_round_holds_no_prompt_twice_when_the_data_is_short(tmp_path, shuffle):
    cfg = load_config(None, [f"runner.output_dir={tmp_path}", "data.prompts_per_step=3", f"data.shuffle={shuffle}",
                             "task.params={num_prompts: 3}"])
    r = Runner(cfg, progress=False)
    r.cluster = FakeCluster()
    r.cluster.rollout = _Recording()
    next(r.sampler)
    count = next_round_prompts(3, kept=0, seen=3, cap=3, multiple=2)
    assert count == 4  # a multiple of the 2 rollout workers: more than the 3 records an epoch holds
    r._sample_more(0, count)
    (drawn,) = r.cluster.rollout.prompts
    assert len(drawn) == 3 and len({str(p) for p in drawn}) == 3


def test_a_take_from_a_shuffled_sampler_keeping_partial_batches_holds_no_record_twice():
    """Shuffled with drop_last=False, a take longer than the rest of the epoch ran on into the next epoch's
    permutation, and could hold a record twice ("1", "1", "4", "3", "0" for seed 0): it starts the next epoch
    instead, as with drop_last."""
    from pipelines.data import PromptSampler

    recs = [{"prompt": str(i), "answer": str(i)} for i in range(5)]
    for seed in range(50):
        s = PromptSampler(recs, batch_size=2, seed=seed, shuffle=True, drop_last=False)
        next(s), next(s)
        got = [r["prompt"] for r in s.take(s.records_per_epoch)]
        assert len(set(got)) == len(got) == 5, (seed, got)
