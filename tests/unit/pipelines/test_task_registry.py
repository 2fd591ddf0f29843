"""The task registry (``pipelines.tasks``): lookup with a did-you-mean, registration, config selection; the digits
task unchanged by the move into the package; the addition task: determinism, carries, reward on hand cases."""

import hashlib
import json

import pytest

from pipelines import tasks
from pipelines.config import ConfigError, load_config
from pipelines.tasks import (
    UnknownTaskError,
    addition_reward,
    check_task_params,
    count_carries,
    get_task_entry,
    make_addition_task,
    make_digit_task,
    register_task,
    task_names,
)
from pipelines.taskspec import TaskSpec, get_task


def test_builtin_tasks_are_registered():
    assert {"digits", "addition"} <= set(task_names())
    assert get_task_entry("digits").build is tasks.digits.build_digits


def test_unknown_task_names_the_known_ones_and_a_near_miss():
    with pytest.raises(UnknownTaskError, match=r"unknown task 'digit' \(did you mean 'digits'\?\); known tasks: "
                                               r"addition, digits"):
        get_task_entry("digit")
    with pytest.raises(ConfigError, match=r"task.name: unknown task 'additon' \(did you mean 'addition'\?\)"):
        load_config(None, ["task.name=additon"])


def test_unknown_task_params_are_a_config_error_at_load_time():
    with pytest.raises(ConfigError, match=r"task.params: unknown key\(s\) \['num_digits'\] for task 'digits'"):
        load_config(None, ["task.params.num_digits=3"])
    check_task_params("addition", {"num_digits": 3, "min_carries": 1})


def test_register_task_as_decorator_and_refuses_a_taken_name():
    @register_task("_test_echo", params=("seed",))
    def build(params):
        return TaskSpec(name="_test_echo", records=[{"prompt": "1=", "answer": "1"}] * 4,
                        reward_fn=tasks.digit_reward)

    try:
        assert register_task("_test_echo", build) is build  # the same builder again: fine
        with pytest.raises(ValueError, match="already registered"):
            register_task("_test_echo", lambda p: None)
        cfg = load_config(None, ["task.name=_test_echo", "data.prompts_per_step=4"])
        assert get_task(cfg).records[0] == {"prompt": "1=", "answer": "1"}
    finally:
        tasks.registry._REGISTRY.pop("_test_echo")
    with pytest.raises(ValueError, match="non-empty string"):
        register_task("")


def test_digits_task_is_unchanged():
    # the records the main job trains on (4096 from seed 1234): hash taken from the pre-registry pipelines/tasks.py
    recs = make_digit_task(4096, seed=1234)
    assert hashlib.sha256(json.dumps(recs).encode()).hexdigest()[:16] == "89bb553521083294"
    spec = get_task(load_config("examples/grpo_digits.yaml"))
    assert spec.name == "digits" and spec.records == recs and spec.reward_fn is tasks.digit_reward
    assert spec.reward_kwargs == {"format_bonus": 0.1} and spec.answer_pool == tuple(str(i) for i in range(19))


def test_bad_task_param_values_are_config_errors():
    with pytest.raises(ConfigError, match="task.params: min_carries must be in"):
        get_task(load_config(None, ["task.name=addition", "task.params.min_carries=3"]))
    with pytest.raises(ConfigError, match="task.params: need format_bonus >= 0"):
        get_task(load_config(None, ["task.name=addition", "task.params={format_bonus: 0.5, digit_credit: 0.5}"]))


def test_count_carries_by_hand():
    assert count_carries(47, 38) == 1  # 7+8=15 carries; 4+3+1=8 does not
    assert count_carries(99, 1) == 2  # 9+1, then 9+0+1
    assert count_carries(55, 55) == 2  # 5+5, 5+5+1
    assert count_carries(12, 34) == 0 and count_carries(0, 0) == 0
    assert count_carries(999, 1) == 3
    with pytest.raises(ValueError):
        count_carries(-1, 2)


def test_addition_records_are_deterministic_and_right():
    a = make_addition_task(300, seed=7)
    assert a == make_addition_task(300, seed=7) and a != make_addition_task(300, seed=8)
    for r in a:
        assert 10 <= r["a"] <= 99 and 10 <= r["b"] <= 99
        assert r["prompt"] == f"{r['a']}+{r['b']}=" and r["answer"] == str(r["a"] + r["b"])
        assert r["carries"] == count_carries(r["a"], r["b"])
    assert any(len(r["answer"]) == 3 for r in a) and any(len(r["answer"]) == 2 for r in a)
    assert make_addition_task(0) == []


def test_addition_min_carries_and_digit_knobs():
    recs = make_addition_task(200, seed=1, min_carries=2)
    assert all(r["carries"] == 2 for r in recs)
    one = make_addition_task(200, seed=1, num_digits=1)
    assert all(0 <= r["a"] <= 9 for r in one)
    three = make_addition_task(50, seed=1, num_digits=3)
    assert all(100 <= r["a"] <= 999 for r in three)
    for bad in ({"num_digits": 0}, {"num_digits": 10}, {"min_carries": 3}, {"min_carries": -1}):
        with pytest.raises(ValueError):
            make_addition_task(3, **bad)
    with pytest.raises(ValueError):
        make_addition_task(-1)


def test_addition_reward_on_hand_cases():
    answers = ["85"] * 7
    texts = ["85", " 85 ", "84", "185", "085", "8 5", ""]
    # exact (stripped) -> 1; well-formed wrong -> format bonus; leading zero / inner space / empty -> 0
    assert addition_reward(texts, answers) == [1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 0.0]
    # digit credit: "84" has 1 of 2 digits right (the tens), "185" 2 of 3 (aligned from the units), "75" 1 of 2
    got = addition_reward(["84", "185", "75", "12"], ["85"] * 4, format_bonus=0.1, digit_credit=0.4)
    assert got == pytest.approx([0.1 + 0.2, 0.1 + 0.4 * 2 / 3, 0.1 + 0.2, 0.1])
    assert addition_reward(["100"], ["100"], digit_credit=0.4) == [1.0]
    assert addition_reward([], []) == []
    with pytest.raises(ValueError, match="responses but"):
        addition_reward(["1"], ["1", "2"])
    with pytest.raises(ValueError, match="< 1"):
        addition_reward(["1"], ["1"], format_bonus=0.5, digit_credit=0.5)


def test_addition_task_spec_from_config():
    cfg = load_config(None, ["task.name=addition", "rollout.max_new_tokens=4",
                             "task.params={num_prompts: 64, min_carries: 1, digit_credit: 0.2}"])
    spec = get_task(cfg)
    assert spec.name == "addition" and len(spec.records) == 64 and all(r["carries"] >= 1 for r in spec.records)
    assert spec.reward_fn is addition_reward and spec.reward_kwargs == {"format_bonus": 0.1, "digit_credit": 0.2}
    assert all(len(a) <= 3 for a in spec.answer_pool)
    # every prompt and answer fits the character tokenizer the digits task uses
    tok = spec.tokenizer()
    for r in spec.records:
        tok.encode(r["prompt"] + r["answer"])


@pytest.mark.parametrize("task", ["digits", "addition"])
def test_warm_start_answers_random_or_correct(task):
    """``warm_start_answers=random`` teaches the format with pool answers; ``correct`` is supervised on the right
    answers (a partly trained policy for RL to start from). The same step and seed give the same rows."""
    base = [f"task.name={task}", "rollout.max_new_tokens=4", "algorithm.kl_coef=0"]
    correct = get_task(load_config(None, [*base, "task.params={warm_start_steps: 3, warm_start_answers: correct}"]))
    random_ = get_task(load_config(None, [*base, "task.params={warm_start_steps: 3}"]))
    assert (correct.warm_start_steps, correct.warm_start_answers, random_.warm_start_answers) == (3, "correct", "random")
    tok = correct.tokenizer()
    by_prompt = {r["prompt"]: r["answer"] for r in correct.records}
    for spec, right in ((correct, True), (random_, False)):
        batch = spec.warm_start_batch(step=1, rows=64, seed=0, max_new_tokens=4)
        prompts = [tok.decode(row.tolist()) for row in batch["prompts"]]
        texts = [tok.decode(tok.truncate_at_eos(row.tolist())) for row in batch["responses"]]
        hits = [by_prompt[p] == t for p, t in zip(prompts, texts)]
        assert all(hits) if right else sum(hits) < 32  # random pool answers are mostly wrong
        assert all(t in spec.answer_pool for t in texts)
        again = spec.warm_start_batch(step=1, rows=64, seed=0, max_new_tokens=4)
        assert (again["responses"] == batch["responses"]).all()
    with pytest.raises(ConfigError, match="warm_start_answers must be one of"):
        get_task(load_config(None, [*base, "task.params={warm_start_answers: right}"]))


def test_warm_start_with_a_kl_term_is_a_config_error():
    # the reference model keeps the initial weights: a KL to it would pull the warm-started policy back
    with pytest.raises(ConfigError, match="task.params.warm_start_steps.*reference model holds the initial"):
        get_task(load_config(None, ["algorithm.kl_coef=0.05", "task.params={warm_start_steps: 5}"]))
    get_task(load_config(None, ["algorithm.kl_coef=0.05", "task.params={warm_start_steps: 0}"]))
    # a quoted number or a fraction is not quietly converted (it was: "3" passed the check, then ran 3 steps)
    for bad in ('"3"', "2.7", "true", ".inf", ".nan"):
        with pytest.raises(ConfigError, match="warm_start_steps must be a whole number"):
            get_task(load_config(None, ["algorithm.kl_coef=0", f"task.params={{warm_start_steps: {bad}}}"]))


def test_a_task_builder_that_warm_starts_by_itself_is_checked_too():
    """The check is on the built task, so a user's task whose builder sets the warm start is refused as well."""

    @register_task("warm_by_itself_for_test", params=())
    def build(params):
        return TaskSpec(name="warm_by_itself_for_test", records=[{"prompt": "1+1=", "answer": "2"}],
                        reward_fn=tasks.digit_reward, warm_start_steps=50, answer_pool=("2",))

    try:
        with pytest.raises(ConfigError, match="50 warm-start steps with algorithm.kl_coef=0.05"):
            get_task(load_config(None, ["task.name=warm_by_itself_for_test", "algorithm.kl_coef=0.05"]))
    finally:
        tasks.registry._REGISTRY.pop("warm_by_itself_for_test", None)


def test_prompts_longer_than_the_models_positions_are_a_config_error():
    """``model.max_seq_len`` is the tiny model's positions (prompt + response): a setting that cannot hold the task's
    longest prompt (bos included) plus ``rollout.max_new_tokens`` used to be accepted and silently ignored."""
    cfg = load_config(None, ["model.max_seq_len=4", "rollout.max_new_tokens=3"])
    with pytest.raises(ConfigError, match=r"model.max_seq_len.*longest prompt is \d+ tokens.*at least \d+"):
        get_task(cfg)
    spec = get_task(load_config(None, []))  # the defaults fit
    longest = max(len(spec.tokenizer().encode(r["prompt"], add_bos=True)) for r in spec.records)
    get_task(load_config(None, [f"model.max_seq_len={longest + 3}", "rollout.max_new_tokens=3"]))  # exactly fits
    with pytest.raises(ConfigError, match="model.max_seq_len"):
        get_task(load_config(None, [f"model.max_seq_len={longest + 2}", "rollout.max_new_tokens=3"]))
