"""DAPO's dynamic-sampling stage and the ReMax step, on a fake cluster whose reward reads a planted score column.

Pure helpers first (round sizing, how many groups are trained, prompt padding), then the stage: groups with
all-equal rewards dropped, extra rounds until the batch is full, the bound on rounds, the all-dropped case.
"""

import pytest
import torch

from orchestra import Batch
from pipelines.config import load_config
from pipelines.dapo import dapo_step
from pipelines.dynamic_sampling import gather_groups, groups_to_train, left_pad_prompts, next_round_prompts
from pipelines.grpo import grpo_step
from pipelines.stage import StepContext
from step_fakes import FakeFuture


def _value(x):
    return x.value if isinstance(x, FakeFuture) else x


class Endpoint:
    def __init__(self, calls, name, fn):
        self.calls, self.name, self.fn = calls, name, fn

    def options(self, **_):
        return self

    def __call__(self, *args, **kwargs):
        self.calls.append((self.name, {**kwargs, "_args": args}))
        return FakeFuture(self.fn(*args, **kwargs))


def _moments(b):
    """The advantage workers' moments of the union handed to them (rows and controller-made advantages)."""
    from pipelines.advantage_worker import AdvantageWorker

    cols = {k: part[k] for part in _parts(b) for k in ("response_mask", "advantages", "advantage_mask") if k in part}
    return AdvantageWorker.moments(AdvantageWorker.__new__(AdvantageWorker), Batch.from_dict(cols))


def _cluster(calls):
    def score(rollouts):
        b = _value(rollouts)
        return Batch.from_dict({"scores": b["planted"].float(), "token_level_scores": b["response_mask"].float()})

    def lengths(rollouts):
        return Batch.from_dict({"response_length": _value(rollouts)["response_mask"].sum(-1)})

    class C:
        pass
    c = C()
    ep = lambda name, fn: Endpoint(calls, name, fn)  # noqa: E731
    c.reward = C()
    c.reward.score = ep("reward.score", score)
    c.actor = C()
    c.actor.compute_log_prob = ep("actor.compute_log_prob", lambda b: None)
    c.actor.compute_ref_log_prob = ep("actor.compute_ref_log_prob", lambda b: None)
    c.actor.update_actor = ep("actor.update_actor", lambda b, **kw: {"actor/loss": 0.1})
    c.advantage = C()
    c.advantage.response_lengths = ep("advantage.response_lengths", lengths)
    c.advantage.moments = ep("advantage.moments", _moments)
    c.advantage.gather_groups = ep("advantage.gather_groups", lambda *rounds, picks, pad_id: gather_groups(
        [_value(r) for r in rounds], picks, pad_id))
    return c


def rollouts(group_scores, prompt_width=3, resp=2, tag=0):
    """Rollout rows of groups (prompt-major); each group's scores planted for the fake reward; ``tag`` marks rows."""
    scores = [s for g in group_scores for s in g]
    B = len(scores)
    prompts = torch.full((B, prompt_width), 5)
    responses = torch.full((B, resp), 7)
    return Batch.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.ones(B, prompt_width + resp, dtype=torch.long),
        "response_mask": torch.ones(B, resp, dtype=torch.long), "planted": torch.tensor(scores),
        "tag": torch.full((B,), tag), "answer": ["x"] * B})


async def _run(step_fn, overrides, first, more=(), greedy=None):
    cfg = load_config(None, overrides)
    calls, asked = [], []
    queue = list(more)

    def sample_more(k):
        asked.append(k)
        return FakeFuture(queue.pop(0))

    ctx = StepContext(_cluster(calls), cfg, 0, sample_more=sample_more,
                      greedy=FakeFuture(greedy) if greedy is not None else None)
    metrics = await step_fn(ctx, FakeFuture(first))
    await ctx.settle()
    update = [kw for n, kw in calls if n == "actor.update_actor"]
    assert len(update) == 1
    return update[0], asked, metrics


def _parts(x):
    """The Batches inside the (possibly nested) union handed to update_actor."""
    x = _value(x)
    if isinstance(x, Batch):
        return [x]
    if isinstance(x, tuple):
        return [b for part in x[1:] for b in _parts(part)]
    return []


def _trained(update):
    parts = _parts(update["_args"][0])
    rows = next(b for b in parts if "tag" in b)
    adv = next(b for b in parts if "advantages" in b)
    return rows, adv["advantages"].tolist()


# ---------------------------------------------------------------------------------------------------- pure helpers
def test_next_round_prompts_scales_by_the_keep_rate_within_bounds():
    assert next_round_prompts(3, kept=5, seen=10, cap=8) == 6  # 3 / 0.5
    assert next_round_prompts(3, kept=5, seen=10, cap=8, multiple=4) == 8  # 6 -> 8
    assert next_round_prompts(1, kept=9, seen=10, cap=8, multiple=2) == 2  # 1.1 -> 2 -> at least one per worker
    assert next_round_prompts(4, kept=1, seen=10, cap=8) == 8  # 40 capped at the batch
    assert next_round_prompts(4, kept=0, seen=8, cap=8) == 8  # nothing kept yet: a full batch
    assert next_round_prompts(4, kept=0, seen=8, cap=7, multiple=2) == 8  # the cap rounded up to the workers
    for bad in ({"missing": 0, "kept": 1, "seen": 2}, {"missing": 1, "kept": 3, "seen": 2}):
        with pytest.raises(ValueError):
            next_round_prompts(cap=8, **bad)


def test_groups_to_train():
    assert groups_to_train(kept=10, dropped=3, target=8, min_groups=1) == (8, 0)  # extra kept groups cut
    assert groups_to_train(kept=5, dropped=3, target=8, min_groups=1) == (5, 0)  # bound hit: train on what is kept
    assert groups_to_train(kept=0, dropped=3, target=8, min_groups=2) == (0, 2)  # all dropped: filler, never empty
    assert groups_to_train(kept=1, dropped=0, target=8, min_groups=2) == (1, 0)  # no filler left
    with pytest.raises(ValueError):
        groups_to_train(-1, 0, 1, 1)


def test_left_pad_prompts_moves_the_prompt_right_and_masks_the_pad():
    b = rollouts([[1.0]], prompt_width=2, resp=1)
    p = left_pad_prompts(b, 4, pad_id=0)
    assert p["prompts"].tolist() == [[0, 0, 5, 5]] and p["input_ids"].tolist() == [[0, 0, 5, 5, 7]]
    assert p["attention_mask"].tolist() == [[0, 0, 1, 1, 1]] and p["responses"].tolist() == [[7]]
    assert left_pad_prompts(b, 2, 0) is b
    with pytest.raises(ValueError):
        left_pad_prompts(b, 1, 0)


# ----------------------------------------------------------------------------------------------- the DAPO stage
DAPO = ["algorithm.name=dapo", "data.prompts_per_step=2", "rollout.n=2", "runner.micro_batches_per_step=1",
        "resources.actor_workers=1", "resources.rollout_workers=1"]


async def test_all_equal_groups_are_dropped_and_one_more_round_fills_the_batch():
    first = rollouts([[1.0, 1.0], [1.0, 0.0]], tag=0)  # group 0 all equal: dropped
    second = rollouts([[0.0, 0.0], [0.0, 1.0], [0.5, 0.0]], prompt_width=5, tag=1)  # wider prompts concatenate
    update, asked, m = await _run(dapo_step, DAPO, first, [second])
    assert asked == [2]  # 1 missing group at keep rate 1/2
    rows, adv = _trained(update)
    assert rows["tag"].tolist() == [0, 0, 1, 1]  # group 1 of round 0, then the first kept group of round 1
    assert rows["prompts"].shape[1] == 5 and rows["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    # GRPO advantages of [1, 0] and [0, 1]: (s - 0.5) / (std 0.7071 + 1e-6)
    assert adv == pytest.approx([0.70711, -0.70711, -0.70711, 0.70711], abs=1e-4)
    assert m["dynamic_sampling/rounds"] == 2 and m["dynamic_sampling/groups"] == 5
    assert (m["dynamic_sampling/kept_groups"], m["dynamic_sampling/dropped_groups"]) == (3, 2)
    assert (m["dynamic_sampling/trained_groups"], m["dynamic_sampling/bound_hit"]) == (2, 0)
    # reward/* over every sampled response (10), the trained groups' mean apart
    assert m["reward/mean"] == pytest.approx(4.5 / 10) and m["dynamic_sampling/trained_reward_mean"] == 0.5


async def test_no_extra_round_when_the_first_round_is_diverse():
    update, asked, m = await _run(dapo_step, DAPO, rollouts([[1.0, 0.0], [0.1, 0.0]]))
    assert asked == [] and m["dynamic_sampling/rounds"] == 1 and m["dynamic_sampling/keep_rate"] == 1.0


async def test_bound_hit_trains_on_what_was_kept_and_says_so(caplog):
    first = rollouts([[1.0, 1.0], [1.0, 0.0]], tag=0)
    more = [rollouts([[0.0, 0.0], [0.0, 0.0]], tag=1)]
    update, asked, m = await _run(dapo_step, [*DAPO, "algorithm.dynamic_sampling_max_rounds=1"], first, more)
    rows, adv = _trained(update)
    assert rows["tag"].tolist() == [0, 0] and len(adv) == 2
    assert m["dynamic_sampling/bound_hit"] == 1 and m["dynamic_sampling/extra_rounds"] == 1
    assert m["dynamic_sampling/trained_groups"] == 1 and m["dynamic_sampling/filler_groups"] == 0
    assert "kept 1 of 2 groups after 1 extra round(s)" in caplog.text


async def test_all_groups_dropped_fills_the_update_with_zero_advantage_groups(caplog):
    first = rollouts([[1.0, 1.0], [0.0, 0.0]], tag=0)
    update, asked, m = await _run(dapo_step, [*DAPO, "algorithm.dynamic_sampling_max_rounds=0",
                                              "actor.mini_batches=3"], first)
    rows, adv = _trained(update)
    # 3 mini-batches on 1 rank need 3 rows: 2 groups of 2 rows (ceil(3 / 2)); all advantages 0
    assert asked == [] and len(rows) == 4 and adv == [0.0] * 4
    assert (m["dynamic_sampling/trained_groups"], m["dynamic_sampling/filler_groups"]) == (0, 2)
    assert m["dynamic_sampling/bound_hit"] == 1 and "plus 2 all-equal group(s)" in caplog.text


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
async def test_filler_groups_carry_advantage_zero_under_the_overlong_penalty(estimator):
    # group 0 kept ([1, 0]); group 1 all equal (dropped) with responses of 1 and 3 tokens: the overlong penalty
    # (max 3, buffer 2) gives its rows 0 and -1, which used to give the filler rows advantages of +-0.71
    first = rollouts([[1.0, 0.0], [0.0, 0.0]], resp=3, tag=0)
    first["response_mask"][2] = torch.tensor([1, 0, 0])
    update, _, m = await _run(dapo_step, [*DAPO, "algorithm.dynamic_sampling_max_rounds=0", "actor.mini_batches=3",
                                          "rollout.max_new_tokens=3", "algorithm.overlong_buffer=2",
                                          f"algorithm.adv_estimator={estimator}"], first)
    assert (m["dynamic_sampling/trained_groups"], m["dynamic_sampling/filler_groups"]) == (1, 1)
    rows, adv = _trained(update)
    parts = _parts(update["_args"][0])
    mask = next(b for b in parts if "advantage_mask" in b)["advantage_mask"].tolist()
    assert rows["tag"].tolist() == [0, 0, 0, 0] and mask == [1.0, 1.0, 0.0, 0.0]
    assert adv[2:] == [0.0, 0.0] and adv[0] > 0 > adv[1]
    if estimator == "reinforce_pp_baseline":  # whitened over the kept rows only: +-0.5 on 3 tokens each
        assert (m["adv/mean"], m["adv/std"]) == (pytest.approx(0.0), pytest.approx(0.5))


async def test_one_sample_groups_are_a_config_error_for_dapo():
    from pipelines.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.n: bad value 1; DAPO needs at least 2"):
        load_config(None, [*DAPO, "rollout.n=1"])
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: bad value 'reinforce_pp'; DAPO"):
        load_config(None, [*DAPO, "algorithm.adv_estimator=reinforce_pp"])


async def test_dapo_overlong_penalty_and_clip_higher_reach_the_update():
    first = rollouts([[1.0, 0.0], [1.0, 0.0]], resp=3)
    update, _, m = await _run(dapo_step, [*DAPO, "rollout.max_new_tokens=3", "algorithm.overlong_buffer=2",
                                          "actor.clip_ratio_high=0.28"], first)
    assert update["loss_fn"].clip_ratio_high == 0.28
    # length 3 = max: penalty -1 on every row -> -1 mean, advantages unchanged (a constant shift)
    assert m["reward/overlong_penalty"] == -1.0


# --------------------------------------------------------------------------------------------------------- ReMax
REMAX = ["algorithm.adv_estimator=remax", "data.prompts_per_step=2", "rollout.n=2", "runner.micro_batches_per_step=1"]


async def test_remax_advantage_is_the_score_minus_the_greedy_score_of_its_prompt():
    sampled = rollouts([[1.0, 0.0], [0.1, 1.0]])
    greedy = rollouts([[0.1], [1.0]])  # one greedy row per prompt
    update, _, m = await _run(grpo_step, REMAX, sampled, greedy=greedy)
    _, adv = _trained(update)
    assert adv == pytest.approx([1.0 - 0.1, 0.0 - 0.1, 0.1 - 1.0, 1.0 - 1.0])
    assert m["reward/greedy_mean"] == pytest.approx(0.55)


async def test_remax_with_one_sample_per_prompt_and_equal_scores():
    update, _, _ = await _run(grpo_step, [*REMAX, "rollout.n=1"], rollouts([[1.0], [0.0]]),
                              greedy=rollouts([[1.0], [0.0]]))
    assert _trained(update)[1] == [0.0, 0.0]


async def test_remax_without_the_greedy_rollout_names_what_is_missing():
    with pytest.raises(RuntimeError, match="remax needs the greedy rollout"):
        await _run(grpo_step, REMAX, rollouts([[1.0, 0.0], [0.1, 1.0]]))


@pytest.mark.parametrize("example,name,estimator", [("dapo_digits.yaml", "dapo", "grpo"),
                                                    ("remax_digits.yaml", "grpo", "remax"),
                                                    ("study_addition.yaml", "grpo", "grpo")])
def test_example_configs_load(example, name, estimator):
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[3] / "examples" / example)
    assert (cfg.algorithm.name, cfg.algorithm.adv_estimator) == (name, estimator)


def test_remax_config_rules():
    from pipelines.config import ConfigError

    assert load_config(None, ["algorithm.adv_estimator=remax", "rollout.n=1"]).rollout.n == 1  # no group needed
    with pytest.raises(ConfigError, match="PPO computes GAE"):
        load_config(None, ["algorithm.name=ppo", "rollout.n=1", "algorithm.adv_estimator=remax"])
    with pytest.raises(ConfigError, match="algorithm.kl_in: bad value 'reward'"):
        load_config(None, ["algorithm.adv_estimator=remax", "algorithm.kl_in=reward"])
    with pytest.raises(ConfigError, match="DAPO's dynamic sampling keeps the prompt groups"):
        load_config(None, ["algorithm.name=dapo", "algorithm.adv_estimator=remax"])
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling_max_rounds: bad value -1"):
        load_config(None, ["algorithm.name=dapo", "algorithm.dynamic_sampling_max_rounds=-1"])
