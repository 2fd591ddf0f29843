"""Settings that were accepted and then silently did less than they say, or crashed late instead of being refused:

- ``data.shuffle=false`` never trained on the records past the last full batch (the same ones every pass): the
  unshuffled order now wraps around, so every record is trained on and every batch is full;
- ``runner.max_bad_steps``: the count of consecutive non-finite steps was lost on ``--resume`` and on a restart, so
  a run could take up to ``2 x max_bad_steps - 1`` bad steps in a row before stopping;
- ``task.params`` that only generate prompts were ignored when ``data.train_path`` replaces the prompts;
- ``model.num_kv_heads`` / ``model.hidden_size`` that the model cannot be built with crashed (exit 1) when the
  workers built it, instead of being a config error (exit 2).

The workers are fakes where a Runner is needed: only its state (runner.json, the guard, the sampler) matters here.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from fake_engine_ckpt import FakeCluster
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.config import ConfigError, load_config
from pipelines.data import PromptSampler
from pipelines.health import NonFiniteGuard, TrainingDivergedError
from pipelines.runner import Runner, _Rebuilt
from pipelines.taskspec import get_task

RECORDS = [{"prompt": f"p{i}", "i": i} for i in range(10)]


def take(sampler: PromptSampler, k: int) -> list[list[int]]:
    return [[r["i"] for r in next(sampler)] for _ in range(k)]


# -- data.shuffle=false: every record is trained on --------------------------------------------------------------
def test_an_unshuffled_sampler_wraps_around_so_every_record_is_trained_on():
    """10 records, batches of 4: the third batch takes the last 2 records and the first 2 of the next pass (it used
    to restart at record 0, so records 8 and 9 were never drawn)."""
    s = PromptSampler(RECORDS, 4, shuffle=False)
    batches = take(s, 5)
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert sorted(set(sum(batches[:3], []))) == list(range(10))  # every record within the first pass's batches
    assert s.epoch == 2  # 20 records drawn: the next batch starts the third pass


def test_the_runners_sampler_with_data_shuffle_false_draws_every_record(tmp_path):
    cfg = load_config(None, [f"runner.output_dir={tmp_path / 'run'}", "data.shuffle=false", "data.prompts_per_step=4",
                             "task.params={num_prompts: 10}"])
    runner = Runner(cfg, progress=False)
    batches = [next(runner.sampler) for _ in range(5)]
    assert [len(b) for b in batches] == [4] * 5
    drawn = [r for b in batches for r in b]
    assert drawn == [*runner.task.records, *runner.task.records]  # each record, in file order, twice in 5 batches


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.integers(0, 30))
def test_an_unshuffled_resume_continues_with_the_batches_of_an_uninterrupted_run(n, batch, consumed):
    if n < batch:
        return
    records = [{"prompt": str(i), "i": i} for i in range(n)]
    reference = PromptSampler(records, batch, shuffle=False)
    expected = take(reference, consumed + 6)[consumed:]
    first = PromptSampler(records, batch, shuffle=False)
    take(first, consumed)
    resumed = PromptSampler(records, batch, shuffle=False)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as saved in a checkpoint
    assert take(resumed, 6) == expected
    assert all(len(b) == batch for b in expected)
    assert resumed.epoch == reference.epoch


def test_a_take_of_fewer_records_than_a_batch_leaves_the_rest_for_the_next_batch():
    """DAPO's extra sampling round needs only some prompts: it took a whole batch and dropped the rest, so with
    data.shuffle=false the records after its cut were never trained on in that pass. ``take(k)`` draws the next k
    records; the next batch starts after them, and every record is still drawn."""
    s = PromptSampler(RECORDS, 4, shuffle=False)
    assert [r["i"] for r in next(s)] == [0, 1, 2, 3]
    assert [r["i"] for r in s.take(2)] == [4, 5]
    assert take(s, 3) == [[6, 7, 8, 9], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["i"] for r in s.take(5)] == [8, 9, 0, 1, 2]  # across the end of a pass, in file order
    assert s.epoch == 2 and s.state_dict()["record_in_epoch"] == 3  # 23 records drawn: the third pass's 4th is next


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 12), st.integers(1, 4), st.booleans(), st.lists(st.integers(0, 4), max_size=8))
def test_takes_and_batches_draw_each_record_once_a_pass_and_resume_exactly(n, batch, shuffle, takes):
    """Any mix of batches and takes: unshuffled, the stream the batches alone would draw; shuffled, no draw holds a
    record twice and no epoch gives one twice (a draw too large for what is left of an epoch starts the next, the
    rest dropped like the remainder). A state saved between them resumes the same draws."""
    records = [{"prompt": str(i), "i": i} for i in range(n)]

    def stream(s: PromptSampler, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            out += [r["i"] for r in next(s)]
        return out[:k]

    mixed, draws, per_epoch = PromptSampler(records, batch, seed=3, shuffle=shuffle), [], {}
    for k in [*takes, 0]:
        for draw in (lambda: mixed.take(min(k, batch)), lambda: next(mixed)):
            epoch = mixed.epoch
            got = [r["i"] for r in draw()]
            draws.append(got)
            if shuffle and got:
                assert len(set(got)) == len(got)
                # one epoch's: the one it ended in, or the one before when it ended that one exactly
                at = mixed.epoch - 1 if mixed._start == 0 else mixed.epoch
                assert at >= epoch
                per_epoch.setdefault(at, []).extend(got)
    assert all(len(set(v)) == len(v) for v in per_epoch.values())
    resumed = PromptSampler(records, batch, seed=3, shuffle=shuffle)
    resumed.load_state_dict(json.loads(json.dumps(mixed.state_dict())))
    more = [[r["i"] for r in mixed.take(min(3, batch))], [r["i"] for r in next(mixed)]]
    assert [[r["i"] for r in resumed.take(min(3, batch))], [r["i"] for r in next(resumed)]] == more
    if not shuffle:
        drawn = [i for d in draws + more for i in d]
        assert drawn == stream(PromptSampler(records, batch, shuffle=False), len(drawn))


def test_a_shuffled_batch_after_a_take_never_holds_a_record_twice():
    """7 records, batches of 3, shuffled: an epoch is 6 records. After a take of 2 the batch boundaries are shifted,
    and a batch spanning two epochs mixed two permutations (the review found [2, 5, 2]). A draw never spans epochs."""
    s = PromptSampler([{"i": i} for i in range(7)], 3, seed=0)
    s.take(2)
    for _ in range(12):
        epoch = s.epoch
        got = [r["i"] for r in next(s)]
        assert len(set(got)) == 3, got
        assert s.epoch >= epoch


def test_dapos_extra_round_draws_only_the_prompts_it_generates(tmp_path):
    """The runner's extra sampling round (``_sample_more``) asks for 2 prompts: the next step's batch begins with the
    record after them (it began a whole batch later: records 6 and 7 of this pass were skipped)."""
    r = _runner(tmp_path, "data.shuffle=false", "data.prompts_per_step=4", "task.params={num_prompts: 10}")
    generated = []
    r.cluster.rollout = type("Rollout", (), {"generate": lambda self, prompts, **kw: generated.append(prompts)})()
    first = next(r.sampler)
    r._sample_more(0, 2)
    assert len(generated[0]) == 2
    after = next(r.sampler)
    records = r.task.records
    assert first + after == [*records[:4], *records[6:10]]
    assert [rec["prompt"] for rec in records[4:6]] == _prompts_of(r, generated[0])


def _prompts_of(r: Runner, prompts) -> list[str]:
    tok = r.tok
    return [tok.decode([t for t, m in zip(row.tolist(), mask.tolist()) if m], skip_special_tokens=True)
            for row, mask in zip(prompts["prompts"], prompts["attention_mask"])]


def test_an_unshuffled_sampler_state_of_the_old_sampler_resumes_at_the_same_record(caplog):
    """A checkpoint written before the wrap-around (epoch / batch_in_epoch, the tail dropped) resumes with the batch
    the old sampler would have drawn next, then wraps around; a warning says so."""
    old = PromptSampler(RECORDS, 4, shuffle=False).state_dict()
    old = {k: v for k, v in old.items() if k in ("seed", "batch_size", "num_records", "shuffle", "drop_last",
                                                  "records_sha256")}
    old.update(epoch=2, batch_in_epoch=1)  # the old format: the next batch is records 4..7 of the third pass
    s = PromptSampler(RECORDS, 4, shuffle=False)
    with caplog.at_level("WARNING", logger="orchestra"):
        s.load_state_dict(old)
    assert take(s, 3) == [[4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]]
    assert "wraps around" in caplog.text and "data.shuffle" in caplog.text


def test_an_unshuffled_sampler_state_out_of_range_is_refused():
    state = PromptSampler(RECORDS, 4, shuffle=False).state_dict()
    with pytest.raises(ValueError, match="position out of range"):
        PromptSampler(RECORDS, 4, shuffle=False).load_state_dict({**state, "record_in_epoch": 10})
    with pytest.raises(ValueError, match="shuffle: saved False, now True"):
        PromptSampler(RECORDS, 4).load_state_dict(state)


def test_a_shuffled_sampler_keeps_its_order_and_state():
    """shuffle=true is unchanged (a different remainder each epoch, so all are seen over epochs): the same batches
    and the same state keys as before, so its runs and checkpoints are the same."""
    s = PromptSampler(RECORDS, 4, seed=1)
    first = take(s, 3)
    assert s.epoch == 1 and s.state_dict()["batch_in_epoch"] == 1
    assert len(set(sum(first[:2], []))) == 8
    old = {k: v for k, v in s.state_dict().items() if k != "wrap"}  # as written before the wrap-around
    resumed = PromptSampler(RECORDS, 4, seed=1)
    resumed.load_state_dict(old)
    assert take(resumed, 3) == take(s, 3)


# -- runner.max_bad_steps: the count survives a resume and a restart ----------------------------------------------
NAN = math.nan
BAD = {"actor/loss": NAN, "actor/grad_norm": NAN}
GOOD = {"actor/loss": 0.5, "actor/grad_norm": 1.0}


class _FakeSink:
    def __init__(self):
        self.events, self.truncated = [], []

    def truncate(self, step):
        self.truncated.append(step)

    def event(self, event):
        self.events.append(event)


def _runner(tmp_path, *overrides, resume_from=None) -> Runner:
    cfg = load_config(None, [f"runner.output_dir={tmp_path / 'run'}", "runner.max_bad_steps=3", *overrides])
    r = Runner(cfg, progress=False, resume_from=resume_from)
    r.cluster = FakeCluster()
    return r


def test_the_guards_count_round_trips_through_its_state():
    guard = NonFiniteGuard(max_bad_steps=3)
    guard.check(0, BAD)
    guard.check(1, BAD)
    again = NonFiniteGuard(max_bad_steps=3)
    again.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert again.bad_run == 2
    with pytest.raises(TrainingDivergedError, match="3 consecutive steps"):
        again.check(2, BAD)
    with pytest.raises(ValueError, match="bad_run"):
        again.load_state_dict({"bad_run": -1})


async def test_a_resume_after_two_bad_steps_stops_at_the_third(tmp_path):
    first = _runner(tmp_path)
    first.guard.check(0, BAD)
    first.guard.check(1, BAD)
    saved = await first.save(1)
    assert json.loads((saved / "runner.json").read_text())["guard"] == {"bad_run": 2}
    second = _runner(tmp_path, resume_from=saved)
    await second._restore()
    assert second.guard.bad_run == 2 and second.guard.max_bad_steps == 3
    with pytest.raises(TrainingDivergedError, match="3 consecutive steps"):
        second.guard.check(2, BAD)


async def test_a_checkpoint_without_the_count_resumes_with_none(tmp_path):
    first = _runner(tmp_path)
    first.guard.check(0, BAD)
    saved = await first.save(0)
    state = json.loads((saved / "runner.json").read_text())
    del state["guard"]  # written before the count was saved
    second = _runner(tmp_path, resume_from=saved)
    second.guard.bad_run = 1  # whatever it held: a restore sets it
    await second._restore(state)
    assert second.guard.bad_run == 0


async def test_a_checkpoint_with_a_count_that_is_not_one_is_refused(tmp_path):
    from pipelines.checkpoint import CheckpointError

    first = _runner(tmp_path)
    saved = await first.save(0)
    state = {**json.loads((saved / "runner.json").read_text()), "guard": {"bad_run": "2"}}
    second = _runner(tmp_path, resume_from=saved)
    with pytest.raises(CheckpointError, match=r"runner\.json: non-finite guard state: bad_run must be a whole number"):
        await second._restore(state)


async def test_a_restart_counts_from_the_checkpoints_bad_steps(tmp_path):
    """A restart redoes the steps after the checkpoint, so the count is the checkpoint's: steps 0 and 1 bad, the
    checkpoint after step 1, step 2 bad, a worker dies: the redone step 2 is the third bad step in a row."""
    r = _runner(tmp_path)
    r.guard.check(0, BAD)
    r.guard.check(1, BAD)
    await r.save(1)
    r.guard.check(2, GOOD)  # after the checkpoint: any count, the restart does not keep it
    r.restarts = [{"event": "restart", "step": 3, "reason": "a test death"}]
    r._rebuilt = _Rebuilt(0.0, 0.0, 0.0, 0.0)
    await r._recover(_FakeSink(), None)
    assert r.start_step == 2 and r.guard.bad_run == 2
    with pytest.raises(TrainingDivergedError):
        r.guard.check(2, BAD)


async def test_a_restart_before_any_checkpoint_counts_from_zero(tmp_path):
    r = _runner(tmp_path)
    r.guard.check(0, BAD)
    r.restarts = [{"event": "restart", "step": 1, "reason": "a test death"}]
    r._rebuilt = _Rebuilt(0.0, 0.0, 0.0, 0.0)
    await r._recover(_FakeSink(), None)
    assert r.start_step == 0 and r.guard.bad_run == 0


# -- task.params ignored with data.train_path ---------------------------------------------------------------------
def _train_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8)))
    return path


@pytest.mark.parametrize("task, param", [
    ("digits", "num_prompts: 100"), ("digits", "seed: 7"), ("digits", "max_operand: 5"), ("digits", "ops: '+-'"),
    ("digits", "modulo: 10"), ("digits", "min_operand: 1"), ("addition", "num_digits: 3"),
    ("addition", "min_carries: 1"), ("addition", "num_prompts: 64"),
    ("digits", "max_operand: 5, warm_start_steps: 2, warm_start_answers: correct"),
])
def test_task_params_that_only_generate_prompts_are_refused_with_a_train_path(tmp_path, task, param):
    key = param.split(":")[0]
    cfg = load_config(None, [f"task.name={task}", f"task.params={{{param}}}", "data.prompts_per_step=4",
                             f"data.train_path={_train_file(tmp_path)}", "rollout.max_new_tokens=4"])
    refused = rf"task\.params\.{key}: .*data\.train_path .*remove task\.params\.{key}"
    with pytest.raises(ConfigError, match=refused) as e:
        get_task(cfg)
    assert e.value.path == f"task.params.{key}"


def test_a_task_registers_its_prompt_params_among_its_params():
    from pipelines.tasks import get_task_entry, register_task

    assert get_task_entry("digits").prompt_params == {"max_operand", "min_operand", "ops", "modulo", "num_prompts",
                                                      "seed"}
    with pytest.raises(ValueError, match=r"prompt_params \['size'\] are not in its params \['seed'\]"):
        register_task("silent_config_test_task", lambda p: None, params=("seed",), prompt_params=("size",))
    with pytest.raises(ValueError, match=r"answer_pool_params \['seed'\] are not in its prompt_params \[\]"):
        register_task("silent_config_test_task", lambda p: None, params=("seed",), answer_pool_params=("seed",))


@pytest.mark.parametrize("task, params", [
    ("digits", "{format_bonus: 0.2}"), ("addition", "{digit_credit: 0.3, format_bonus: 0.1}"),
    ("digits", "{warm_start_steps: 2, warm_start_answers: correct, warm_start_lr: 0.01}"),
    # a format warm start draws its answers from the pool the generating params shape: they still matter
    ("digits", "{max_operand: 5, ops: '+-', warm_start_steps: 2}"),
    ("addition", "{num_digits: 1, warm_start_steps: 2, warm_start_answers: random}"),
])
def test_task_params_that_still_matter_with_a_train_path_are_accepted(tmp_path, task, params):
    cfg = load_config(None, [f"task.name={task}", f"task.params={params}", f"data.train_path={_train_file(tmp_path)}",
                          "data.prompts_per_step=4", "rollout.max_new_tokens=4"])
    spec = get_task(cfg)
    assert len(spec.records) == 8


# -- model heads: refused at config check, not when the model is built ---------------------------------------------
@pytest.mark.parametrize("overrides, key, fix", [
    (["model.num_kv_heads=3"], "model.num_kv_heads", "one of 1, 2, 4"),
    (["model.num_kv_heads=8"], "model.num_kv_heads", "one of 1, 2, 4"),
    (["model.num_heads=5", "model.hidden_size=80"], "model.num_kv_heads", "one of 1, 5"),  # null: 5 // 2 = 2
    (["model.hidden_size=60"], "model.hidden_size", "64"),  # 4 heads of 15 dims: rotary needs an even head size
    (["model.num_heads=7", "model.hidden_size=63", "model.num_kv_heads=7"], "model.hidden_size", "70"),
])
def test_model_shapes_the_model_cannot_take_are_config_errors(overrides, key, fix):
    with pytest.raises(ConfigError, match=rf"^{key}: .*{fix}") as e:
        load_config(None, overrides)
    assert e.value.path == key


def test_the_config_check_accepts_exactly_the_shapes_the_model_builds():
    """Every (hidden_size, num_heads, num_kv_heads) of a small grid with num_heads dividing hidden_size: the config
    check refuses it, or the tiny model builds from it and runs a forward pass (the check is no stricter than the
    model, and no looser)."""
    from types import SimpleNamespace

    from engines.models import build_causal_lm
    from pipelines.cluster import model_overrides
    from pipelines.config import ModelConfig

    for hidden in (6, 8, 12, 16, 24):
        for heads in (1, 2, 3, 4, 6):
            for kv in (None, 1, 2, 3, 4):
                knobs = {"hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv, "num_layers": 1,
                         "intermediate_size": 8}
                try:
                    load_config(None, [f"model.{k}={'null' if v is None else v}" for k, v in knobs.items()])
                    refused = False
                except ConfigError:
                    refused = True
                if hidden % heads or hidden == heads:
                    # refused, though the model runs: heads narrower than asked (hidden % heads), or heads of one
                    # dimension, whose rotary embedding broadcasts queries and keys to 2 (a silently other model)
                    assert refused, knobs
                    continue
                section = SimpleNamespace(model=ModelConfig(**knobs))  # the section alone: no cross-section check
                try:
                    build_causal_lm(model_overrides(section, 16), seed=0)(torch.randint(0, 16, (1, 5)))
                    builds = True
                except (RuntimeError, ValueError):
                    builds = False
                assert refused != builds, (knobs, refused, builds)


@pytest.mark.parametrize("task, tokens, ok", [("addition", 3, False), ("addition", 4, True), ("digits", 2, False),
                                              ("digits", 3, True)])
def test_a_response_too_short_for_the_longest_answer_and_eos_is_a_config_error(task, tokens, ok):
    """task.name=addition with the default rollout.max_new_tokens=3 was accepted: a 3-digit answer plus <eos> needs
    4 tokens, so no response could both hold the answer and stop, and the truncated ones were what got rewarded."""
    cfg = load_config(None, [f"task.name={task}", f"rollout.max_new_tokens={tokens}"])
    if ok:
        get_task(cfg)
        return
    with pytest.raises(ConfigError, match=rf"rollout.max_new_tokens: bad value {tokens}; the task's longest answer "
                                          rf".* is {tokens if task == 'addition' else 2} tokens, and a response "
                                          rf"needs one more for <eos>: set rollout.max_new_tokens to "
                                          rf"{tokens + 1 if task == 'addition' else 3} or more"):
        get_task(cfg)
