"""Digit-arithmetic task: determinism, difficulty knobs, jsonl io, reward."""

import pytest

from pipelines.tasks import (
    digit_accuracy,
    digit_reward,
    is_well_formed,
    make_digit_task,
    read_jsonl,
    write_digit_task_jsonl,
    write_jsonl,
)


def test_deterministic_for_seed():
    a = make_digit_task(50, seed=3)
    assert a == make_digit_task(50, seed=3)
    assert a != make_digit_task(50, seed=4)
    assert len(a) == 50 and make_digit_task(0, seed=1) == []


def test_default_is_single_digit_addition():
    recs = make_digit_task(500, seed=0)
    for r in recs:
        assert isinstance(r["prompt"], str) and isinstance(r["answer"], str)
        assert r["prompt"] == f"{r['a']}+{r['b']}="
        assert 0 <= r["a"] <= 9 and 0 <= r["b"] <= 9
        assert int(r["answer"]) == r["a"] + r["b"]
    assert {int(r["answer"]) for r in recs} == set(range(19))


@pytest.mark.parametrize("op", ["+", "-", "*"])
def test_ops_and_modulo(op):
    recs = make_digit_task(200, seed=1, ops=(op,), max_operand=12, min_operand=2, modulo=10)
    fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}[op]
    for r in recs:
        assert 2 <= r["a"] <= 12 and r["op"] == op
        assert r["answer"] == str(fn(r["a"], r["b"]) % 10)


def test_subtraction_can_be_negative():
    recs = make_digit_task(200, seed=2, ops=("-",))
    assert any(r["answer"].startswith("-") for r in recs)
    assert all(int(r["answer"]) == r["a"] - r["b"] for r in recs)


def test_bad_args():
    with pytest.raises(ValueError):
        make_digit_task(-1)
    with pytest.raises(ValueError):
        make_digit_task(3, max_operand=2, min_operand=5)
    with pytest.raises(ValueError):
        make_digit_task(3, ops=("/",))


def test_jsonl_roundtrip(tmp_path):
    recs = make_digit_task(20, seed=5)
    p = write_jsonl(recs, tmp_path / "sub" / "train.jsonl")
    assert read_jsonl(p) == recs
    p2 = write_digit_task_jsonl(tmp_path / "t2.jsonl", 20, seed=5)
    assert read_jsonl(p2) == recs


def test_reward_correctness_only_by_default():
    answers = ["8", "12", "0", "5"]
    texts = ["8", " 12 ", "00", "55"]
    assert digit_reward(texts, answers) == [1.0, 1.0, 0.0, 0.0]
    assert digit_accuracy(texts, answers) == 0.5
    assert digit_accuracy([], []) == 0.0
    with pytest.raises(ValueError):
        digit_reward(["1"], ["1", "2"])


def test_reward_format_bonus_for_well_formed_wrong_answers():
    answers = ["8"] * 6
    texts = ["8", "9", "17", "08", "9 ", "+9"]
    assert digit_reward(texts, answers, format_bonus=0.1) == [1.0, 0.1, 0.1, 0.0, 0.0, 0.0]
    # the accuracy metric ignores the shaping
    assert digit_accuracy(texts, answers) == pytest.approx(1 / 6)


def test_well_formed():
    assert all(map(is_well_formed, ["0", "7", "18", "-3"]))
    assert not any(map(is_well_formed, ["", "007", "1 2", " 5", "5+", "-"]))
