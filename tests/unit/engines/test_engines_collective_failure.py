"""An error that one rank raises inside the collective work of a call, which the ranks did not agree on (in the
backward, in the model's forward, a KeyboardInterrupt in ``loss_fn``), stops every rank: the failing rank leaves its
error in the store, aborts its process groups and calls ``on_abort``; its peers' collectives fail once its process
ends (here: when the spawned function returns; an orchestra rank is declared dead, and its group's close ends it)
instead of at the process group's timeout (30 minutes on gloo by default: a hung job with no error). The failing rank
raises its own error, the others an ``EngineAbortedError`` naming it, and the engine refuses every later call (its
process group is gone)."""

from __future__ import annotations

import pytest
from dp_engine_testutils import collective_failure_on_one_rank_worker

from engines._dist import spawn

pytestmark = pytest.mark.timeout(300)

_OWN = {"backward": "RuntimeError: one of the variables needed for gradient computation has been modified by an "
                    "inplace operation",
        "interrupt": "KeyboardInterrupt: stopped inside my loss",
        "forward": "FloatingPointError: my model failed in its forward",
        "log_prob_forward": "FloatingPointError: my model failed in its forward"}


@pytest.mark.slow  # spawns ranks
@pytest.mark.parametrize("where", list(_OWN))
def test_a_failure_inside_a_collective_on_one_rank_stops_every_rank_at_once(where):
    r0, r1 = spawn(collective_failure_on_one_rank_worker, 2, where)
    what = "compute_log_prob" if where == "log_prob_forward" else "train_step"
    assert r1["error"].startswith(_OWN[where]), r1["error"]
    assert f"note: {what} on rank 1: this error was raised inside the call's collective work and no other rank had " \
           f"reported one" in r1["error"], r1["error"]
    # rank 0 was waiting in a collective: it fails at once, naming rank 1 and what it raised (not the timeout)
    assert r0["error"].startswith(f"EngineAbortedError: {what} on rank 0: rank(s) [1] failed inside the call's "
                                  f"collective work (rank 1: {_OWN[where]}"), r0["error"]
    for r in (r0, r1):
        assert r["later"].startswith("EngineAbortedError: FSDPEngine.train_step: this engine can no longer be used"), r
    # on_abort (an orchestra worker's declare_dead) is told once per rank, with the first failure and its error
    assert r1["on_abort"].startswith(f"FSDPEngine.{what}: rank 1 raised {_OWN[where].split(':')[0]} inside {what}'s "
                                     f"collective work, and no other rank had reported an error ({_OWN[where]}"), r1
    assert r0["on_abort"].startswith(f"FSDPEngine.{what}: rank(s) [1] failed inside {what}'s collective work ("), r0


def test_only_engines_made_before_an_abort_refuse_calls(monkeypatch):
    """An abort leaves the engines of that process without process groups; one made afterwards (on a new process
    group) is not refused."""
    import engines.fsdp as fsdp
    from engines_testutils import make_batch, model_factory

    from engines.fsdp import EngineAbortedError, EngineConfig, FSDPEngine

    before = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4))
    monkeypatch.setattr(fsdp, "_aborts", [*fsdp._aborts, "rank 1 raised RuntimeError inside train_step's collective "
                                                          "work, and no other rank had reported an error"])
    with pytest.raises(EngineAbortedError, match=r"FSDPEngine.compute_log_prob: this engine can no longer be used: "
                                                  r"rank 1 raised RuntimeError inside train_step's collective work"):
        before.compute_log_prob(make_batch(B=2))
    after = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4))
    assert after.compute_log_prob(make_batch(B=2))["log_probs"].shape[0] == 2


@pytest.mark.slow  # spawns ranks
@pytest.mark.parametrize("where, failing", [("shard", 1), ("index", 0)])
def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_the_engine_goes_on(tmp_path, where, failing):
    """Was: the rank that could not write raised alone, and the others waited in the save's collectives (gathering
    the shard list, the final barrier) until the process group's timeout."""
    from dp_engine_testutils import save_fails_on_one_rank_worker

    results = spawn(save_fails_on_one_rank_worker, 2, str(tmp_path), where)
    own, other = results[failing], results[1 - failing]
    assert own["error"].startswith(f"CheckpointError: {tmp_path / 'bad'}: rank {failing} could not write its part "
                                   f"of the checkpoint ([Errno 28] No space left on device)"), own["error"]
    assert other["error"].startswith(f"CheckpointError: {tmp_path / 'bad'}: rank(s) [{failing}] could not write "
                                     f"their part of the checkpoint"), other["error"]
    for r in results:
        assert r["step_after"] == 2.0 and r["loaded_step"] == 2, r


@pytest.mark.slow  # spawns ranks
def test_a_load_that_fails_on_one_rank_after_its_checks_stops_every_rank(tmp_path):
    """Was: the rank whose copy into its shards failed raised alone with a half-loaded engine, and every rank then
    trained on (the model's shards a mix of the checkpoint's and the old weights, silently)."""
    from dp_engine_testutils import load_fails_after_its_checks_on_one_rank_worker

    r0, r1 = spawn(load_fails_after_its_checks_on_one_rank_worker, 2, str(tmp_path))
    assert r1["error"].startswith("MemoryError: could not allocate while copying the checkpoint"), r1["error"]
    assert "note: load on rank 1: this error was raised inside the call's collective work" in r1["error"], r1
    assert r1["later"].startswith("EngineAbortedError: FSDPEngine.train_step: this engine can no longer be used"), r1
    assert r1["on_abort"].startswith("FSDPEngine.load: rank 1 raised MemoryError inside load's collective work"), r1
    # rank 0's own load may finish (its copy is local), but it trains no more: its next collective names rank 1
    assert "EngineAbortedError" in r0["error"] + r0["later"], r0
    assert "rank(s) [1] failed inside" in r0["error"] + r0["later"], r0


@pytest.mark.slow  # spawns ranks
def test_a_worker_update_failing_on_one_rank_before_the_engines_collectives_stops_every_rank():
    """Was: rank 1's update raised in its mini-batch split, before any collective, while rank 0 went on into the
    update's collectives and waited there until the process group's timeout (30 minutes on gloo by default)."""
    from dp_engine_testutils import update_prep_fails_on_one_rank_worker

    r0, r1 = spawn(update_prep_fails_on_one_rank_worker, 2)
    assert r1["error"].startswith("RuntimeError: upper bound and lower bound inconsistent"), r1["error"]
    assert "note: update_actor on rank 1: this error was raised inside the call's collective work" in r1["error"], r1
    assert r0["error"].startswith("EngineAbortedError: update_actor on rank 0: rank(s) [1] failed inside the call's "
                                  "collective work (rank 1: RuntimeError: upper bound"), r0["error"]
    for r in (r0, r1):
        assert r["later"].startswith("EngineAbortedError: FSDPEngine.train_step: this engine can no longer be used"), r
        assert r["on_abort"].count("FSDPEngine.update_actor") == 1 and "train_step" not in r["on_abort"], r


@pytest.mark.slow  # spawns ranks
def test_an_update_every_rank_refuses_alike_leaves_the_engine_usable():
    """With the worker's guard around the whole update, an argument train_step refuses on every rank alike (here a
    temperature of 0) aborted the process groups: the engine was lost for an argument mistake."""
    from dp_engine_testutils import update_refused_alike_on_every_rank_worker

    for r in spawn(update_refused_alike_on_every_rank_worker, 2):
        assert r["error"].startswith("ValueError: train_step: temperature"), r
        assert r["later"] == "", r
