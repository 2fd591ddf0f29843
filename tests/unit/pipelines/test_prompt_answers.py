"""Answers no response can ever match are refused before anything starts.

``prompt_batch`` hands the reward ``str(answer)``: a ``null`` answer became ``"None"``, ``8.0`` became ``"8.0"``, and
an answer with characters the task's tokenizer cannot write (``"eight"``) can never be produced. Such records were
rewarded 0 forever and the run exited 0. Now an answer must be a string or an integer (not a bool) that the task's
tokenizer encodes; anything else is a ConfigError naming the file, the line and the value."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from local_jobs import LOCAL_TINY

import orchestra
import pipelines.runner
from pipelines.cli import main as cli_main
from pipelines.config import ConfigError, load_config
from pipelines.taskspec import TaskSpec, get_task


def _rows(answer: object) -> list[dict]:
    """Eight rows, the second with ``answer``."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    rows[1] = {"prompt": "3+5=", "answer": answer}
    return rows


def _jsonl(tmp_path: Path, rows: list[dict], blank_first: bool = True) -> Path:
    """The rows as jsonl, after a blank line (so the line number is not the record's index)."""
    f = tmp_path / "p.jsonl"
    f.write_text(("\n" if blank_first else "") + "".join(json.dumps(r) + "\n" for r in rows))
    return f


def _cfg(task: str, path: Path):
    return load_config(None, [f"task.name={task}", f"data.train_path={path}", "data.prompts_per_step=8",
                              "rollout.max_new_tokens=4", "model.max_seq_len=16"])


@pytest.mark.parametrize("task", ["digits", "addition"])
@pytest.mark.parametrize("answer, shown", [(None, "null"), (8.0, "8.0"), (True, "true"), ([8], "[8]"),
                                           ({"v": 8}, '{"v": 8}')])
def test_an_answer_that_is_not_a_string_or_an_integer_is_refused(tmp_path, task, answer, shown):
    f = _jsonl(tmp_path, _rows(answer))
    with pytest.raises(ConfigError) as e:
        get_task(_cfg(task, f))
    msg = str(e.value)
    assert msg.startswith(f"data.train_path: {f}:line 3: answer {shown} ")  # line 1 is blank
    assert "is not a string or an integer" in msg and e.value.path == "data.train_path"


@pytest.mark.parametrize("task", ["digits", "addition"])
@pytest.mark.parametrize("answer", ["eight", "8.0", "８"])
def test_an_answer_the_tasks_tokenizer_cannot_write_is_refused(tmp_path, task, answer):
    f = _jsonl(tmp_path, _rows(answer))
    with pytest.raises(ConfigError) as e:
        get_task(_cfg(task, f))
    msg = str(e.value)
    assert msg.startswith(f"data.train_path: {f}:line 3: answer {json.dumps(answer, ensure_ascii=False)} ")
    assert "tokenizer" in msg and "0123456789+-*=? " in msg  # what it can write


def test_a_bad_answer_in_parquet_names_the_row(tmp_path):
    f = tmp_path / "p.parquet"
    rows = _rows("x")
    pq.write_table(pa.Table.from_pylist(rows), f)
    with pytest.raises(ConfigError, match=rf"data\.train_path: {f}:row 1: answer \"x\" "):
        get_task(_cfg("digits", f))


@pytest.mark.parametrize("answer, text", [(8, "8"), (-12, "-12"), ("8", "8")])
def test_integer_and_encodable_string_answers_are_taken(tmp_path, answer, text):
    from engines.tokenizer import CharTokenizer
    from pipelines.taskspec import prompt_batch

    spec = get_task(_cfg("digits", _jsonl(tmp_path, _rows(answer))))
    assert prompt_batch(spec.records[1:2], CharTokenizer())["answer"] == [text]


def test_a_task_that_generates_an_unanswerable_record_is_refused(monkeypatch):
    from pipelines import tasks

    @tasks.register_task("_unanswerable_test", params=())
    def build(params):
        return TaskSpec(name="_unanswerable_test", records=[{"prompt": "1=", "answer": "1"}] * 3
                        + [{"prompt": "1=", "answer": None}], reward_fn=tasks.digit_reward)

    try:
        cfg = load_config(None, ["task.name=_unanswerable_test", "data.prompts_per_step=4"])
        with pytest.raises(ConfigError, match=r"task\.name: task '_unanswerable_test' record 3: answer null ") as e:
            get_task(cfg)
        assert e.value.path == "task.name"
    finally:
        tasks.registry._REGISTRY.pop("_unanswerable_test")


def test_the_cli_exits_2_naming_the_row(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(orchestra, "init", refuse)
    monkeypatch.setattr(pipelines.runner, "build_cluster", refuse)
    f = _jsonl(tmp_path, _rows(None), blank_first=False)
    code = cli_main(["train", *LOCAL_TINY, f"runner.output_dir={tmp_path / 'run'}", f"data.train_path={f}",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"orchestra train: data.train_path: {f}:line 2: answer null ")
    assert "Traceback" not in err


@pytest.mark.parametrize("task", ["digits", "addition"])
@pytest.mark.parametrize("answer", ["", " ", "\t"])
def test_a_blank_answer_is_refused_as_null_is(tmp_path, task, answer):
    # a lost answer written as "" (not null) was taken, and the response that stops at once was paid as solved
    f = _jsonl(tmp_path, _rows(answer))
    with pytest.raises(ConfigError) as e:
        get_task(_cfg(task, f))
    msg = str(e.value)
    assert msg.startswith(f"data.train_path: {f}:line 3: answer {json.dumps(answer)} is blank")
    assert e.value.path == "data.train_path"


@pytest.mark.parametrize("task", ["digits", "addition"])
def test_a_chat_prompt_is_refused_naming_its_row_not_a_bare_type_error(tmp_path, task):
    # load_prompts takes chats (a list of role/content messages); these tasks' tokenizers take text: it was a
    # TypeError ("unhashable type: 'dict'") from the tokenizer, naming no file or row
    rows = _rows("8")
    rows[1] = {"prompt": [{"role": "user", "content": "3+5="}], "answer": "8"}
    f = _jsonl(tmp_path, rows)
    with pytest.raises(ConfigError) as e:
        get_task(_cfg(task, f))
    msg = str(e.value)
    assert msg.startswith(f"data.train_path: {f}:line 3: the prompt is a list (a chat of role/content messages)")
    assert "write the prompt as one string" in msg


def test_a_parquet_file_without_pyarrow_is_a_config_error_exit_2(tmp_path, monkeypatch, capsys):
    import sys

    f = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(_rows("8")), f)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.chdir(tmp_path)
    code = cli_main(["train", f"data.train_path={f}", *LOCAL_TINY, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"orchestra train: data.train_path: reading {f} needs pyarrow")
