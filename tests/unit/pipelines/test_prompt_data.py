"""load_prompts (jsonl / parquet, errors naming file and row) and the resumable PromptSampler."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.data import PromptSampler, load_prompts


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_jsonl(tmp_path):
    text = '{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n'
    path = write(tmp_path, "p.jsonl", text)
    assert load_prompts(path, required_keys=("answer",)) == [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2=", "answer": "4"},
    ]


def test_load_renames_prompt_key_and_accepts_chat(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    path = write(tmp_path, "q.jsonl", json.dumps({"question": chat, "id": 3}) + "\n")
    assert load_prompts(path, prompt_key="question") == [{"prompt": chat, "id": 3}]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\n{"prompt": "b"\n', r"p\.jsonl:line 2: invalid JSON"),
        ('{"prompt": "a"}\n\n[1, 2]\n', r"p\.jsonl:line 3: expected a JSON object, got list"),
        ('{"text": "a"}\n', r"p\.jsonl:line 1: missing key\(s\) 'prompt'; keys present: \['text'\]"),
        ('{"prompt": ""}\n', r"p\.jsonl:line 1: 'prompt' must be a non-empty string"),
        ('{"prompt": 5}\n', r"p\.jsonl:line 1: 'prompt' must be a non-empty string"),
        ('{"prompt": [{"role": "user"}]}\n', r"line 1: 'prompt' must be a non-empty string or a list"),
        ("\n\n", r"p\.jsonl: no records"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_prompts(write(tmp_path, "p.jsonl", text))


def test_load_required_and_conflicting_keys(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"line 2: missing key\(s\) 'answer'"):
        load_prompts(path, required_keys=("answer",))
    both = write(tmp_path, "b.jsonl", '{"prompt": "a", "q": "b"}\n')
    with pytest.raises(ValueError, match="has both 'q' and 'prompt'"):
        load_prompts(both, prompt_key="q")


def test_load_unsupported_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'; expected one of \.jsonl"):
        load_prompts(write(tmp_path, "p.csv", "prompt\na\n"))


def test_load_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["1+1=", "2+2="], "answer": ["2", "4"]}), path)
    assert load_prompts(path, prompt_key="q") == [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["ok", None]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet:row 1: 'prompt' must be a non-empty string"):
        load_prompts(bad)


RECORDS = [{"prompt": f"p{i}", "i": i} for i in range(10)]


def ids(batches):
    return [[r["i"] for r in b] for b in batches]


def take(sampler, k):
    return ids(next(sampler) for _ in range(k))


def test_sampler_is_deterministic_per_seed_and_covers_each_epoch():
    a, b, c = (PromptSampler(RECORDS, 4, seed=s) for s in (1, 1, 2))
    run_a = take(a, 6)
    assert run_a == take(b, 6)
    assert run_a != take(c, 6)
    assert a.batches_per_epoch == 2 and a.epoch == 3  # 10 // 4 with drop_last
    for e in range(3):
        epoch = run_a[2 * e] + run_a[2 * e + 1]
        assert len(set(epoch)) == 8  # 8 distinct records, the 2 left over are dropped
    assert run_a[0] + run_a[1] != run_a[2] + run_a[3]  # a fresh permutation each epoch


def test_sampler_keep_last_and_no_shuffle():
    s = PromptSampler(RECORDS, 4, shuffle=False, drop_last=False)
    assert s.batches_per_epoch == 3
    assert take(s, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]
    shuffled = PromptSampler(RECORDS, 4, seed=5, drop_last=False)
    assert sorted(sum(take(shuffled, 3), [])) == list(range(10))


def test_sampler_returns_copies():
    s = PromptSampler(RECORDS, 2, shuffle=False)
    next(s)[0]["prompt"] = "changed"
    assert RECORDS[0]["prompt"] == "p0"


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 5])  # fresh, mid-epoch, epoch boundary, later
def test_sampler_resume_matches_uninterrupted_run(consumed):
    reference = PromptSampler(RECORDS, 3, seed=7)
    expected = take(reference, consumed + 8)[consumed:]
    first = PromptSampler(RECORDS, 3, seed=7)
    take(first, consumed)
    state = json.loads(json.dumps(first.state_dict()))  # as saved in a checkpoint
    resumed = PromptSampler(RECORDS, 3, seed=7)
    resumed.load_state_dict(state)
    assert take(resumed, 8) == expected


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.booleans(), st.integers(0, 30), st.integers(0, 1000))
def test_sampler_resume_property(n, batch, drop_last, consumed, seed):
    if drop_last and n < batch:
        return
    records = [{"prompt": str(i), "i": i} for i in range(n)]
    reference = PromptSampler(records, batch, seed=seed, drop_last=drop_last)
    expected = take(reference, consumed + 5)[consumed:]
    first = PromptSampler(records, batch, seed=seed, drop_last=drop_last)
    take(first, consumed)
    resumed = PromptSampler(records, batch, seed=seed, drop_last=drop_last)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 5) == expected


def test_sampler_refuses_foreign_state():
    state = PromptSampler(RECORDS, 3, seed=7).state_dict()
    with pytest.raises(ValueError, match=r"seed: saved 7, now 8; num_records: saved 10, now 9"):
        PromptSampler(RECORDS[:9], 3, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="position out of range"):
        PromptSampler(RECORDS, 3, seed=7).load_state_dict({**state, "batch_in_epoch": 3})


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptSampler(RECORDS, 0)
    with pytest.raises(ValueError, match="10 records cannot fill one batch of 11"):
        PromptSampler(RECORDS, 11)
    with pytest.raises(ValueError, match="no records"):
        PromptSampler([], 1)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        PromptSampler(RECORDS, 1, seed=-1)


def test_sampler_refuses_the_state_of_other_records_of_the_same_count():
    """Other records of the same number (another task.params, another file with as many rows) would resume at the
    same position in another data set: refused, naming the records."""
    state = PromptSampler(RECORDS, 3, seed=7).state_dict()
    others = [{**r, "prompt": r["prompt"] + "!"} for r in RECORDS]
    with pytest.raises(ValueError, match="records"):
        PromptSampler(others, 3, seed=7).load_state_dict(state)
    PromptSampler([dict(r) for r in RECORDS], 3, seed=7).load_state_dict(state)  # equal records: accepted


def test_sampler_state_of_an_older_checkpoint_without_a_records_digest_still_loads(caplog):
    state = PromptSampler(RECORDS, 3, seed=7).state_dict()
    del state["records_sha256"]
    with caplog.at_level("WARNING", logger="orchestra"):
        PromptSampler(RECORDS, 3, seed=7).load_state_dict(state)
    assert "cannot check" in caplog.text

