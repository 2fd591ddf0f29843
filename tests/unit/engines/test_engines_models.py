"""Model builders: seeded random init, offline loading from a local directory, heads."""

from __future__ import annotations

import pytest
import torch
from engines_testutils import VOCAB

from engines.models import build_causal_lm, build_reward_model, build_value_model, tiny_qwen2_config


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_seeded_init_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(1234)
    before = torch.rand(1)
    torch.manual_seed(1234)
    a = build_causal_lm(tiny_qwen2_config(VOCAB), seed=3)
    after = torch.rand(1)
    assert torch.equal(before, after)
    assert _same(a, build_causal_lm(tiny_qwen2_config(VOCAB), seed=3))
    assert not _same(a, build_causal_lm(tiny_qwen2_config(VOCAB), seed=4))
    assert a.config.vocab_size == VOCAB and a.config.num_hidden_layers == 2
    # a dict without model_type is read as overrides of the tiny Qwen2 config
    b = build_causal_lm({"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64}, seed=0)
    assert b.config.hidden_size == 32 and b.config.model_type == "qwen2"
    assert build_causal_lm(tiny_qwen2_config(VOCAB), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_load_from_local_directory(tmp_path):
    a = build_causal_lm(tiny_qwen2_config(VOCAB), seed=3)
    a.save_pretrained(tmp_path)
    assert _same(a, build_causal_lm(path=tmp_path))
    v = build_value_model(path=tmp_path, seed=1)  # LM backbone + fresh value head
    assert torch.equal(v.model.embed_tokens.weight, a.model.embed_tokens.weight)
    assert v.config.num_labels == 1
    with pytest.raises(FileNotFoundError, match="local directory"):
        build_causal_lm(path=tmp_path / "missing")


def test_value_and_reward_heads():
    v = build_value_model(tiny_qwen2_config(VOCAB), seed=0)
    ids = torch.randint(3, VOCAB, (2, 5))
    assert v(input_ids=ids).logits.shape == (2, 5, 1)
    assert v.dropout.p == 0.0
    r = build_reward_model(tiny_qwen2_config(VOCAB, pad_token_id=0), seed=0)
    assert r(input_ids=ids).logits.shape == (2, 1)


def test_seeded_builds_on_two_threads_give_the_serial_weights(monkeypatch):
    # The in-process backend builds each worker on its own thread (split placement: actor and rollout at once).
    # The init draws from torch's global RNG: with thread A paused inside its seeded build and thread B's build
    # entered, A's fork_rng restore used to clobber B's seed (B got other weights). The interleaving is forced with
    # events (no timing): A waits until B is inside its build or queued behind A's; B waits until A is done.
    import threading

    import engines.models as models

    cfg = tiny_qwen2_config(VOCAB, hidden_size=16, num_layers=1, num_heads=2)
    serial = build_causal_lm(cfg, seed=0)
    real_resolve, real_lock = models.resolve_config, getattr(models, "_SEEDED_BUILD_LOCK", None)
    cond = threading.Condition()
    state = {"a_inside": False, "b_inside_or_queued": False, "a_done": False}
    names = {"A", "B"}

    def mark(key):
        with cond:
            state[key] = True
            cond.notify_all()

    def wait_for(key):
        with cond:
            cond.wait_for(lambda: state[key])

    def resolve(*args, **kwargs):  # runs inside the seeded part of each build, before the init draws
        who = threading.current_thread().name
        if who == "A":
            mark("a_inside")
            wait_for("b_inside_or_queued")
        elif who == "B":
            mark("b_inside_or_queued")
            wait_for("a_done")
        return real_resolve(*args, **kwargs)

    class QueueSpy:  # the process-wide lock, telling when B queues behind A
        def __enter__(self):
            if threading.current_thread().name == "B":
                mark("b_inside_or_queued")
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    monkeypatch.setattr(models, "resolve_config", resolve)
    if real_lock is not None:
        monkeypatch.setattr(models, "_SEEDED_BUILD_LOCK", QueueSpy())
    built = {}

    def build(name):
        built[name] = build_causal_lm(cfg, seed=0)
        if name == "A":
            mark("a_done")

    a = threading.Thread(target=build, args=("A",), name="A")
    b = threading.Thread(target=build, args=("B",), name="B")
    a.start()
    wait_for("a_inside")
    b.start()
    a.join()
    b.join()
    assert set(built) == names
    assert _same(built["A"], serial) and _same(built["B"], serial)
