"""On --resume the runner compares the config with the one the checkpoint was written with and logs what changed;
the checkpoint's runner.json is read once for that check and for the restore (the workers are fakes: only the
runner's own files matter here)."""

import json
import logging

import pytest

import pipelines.runner as runner_mod
from fake_engine_ckpt import FakeCluster
from pipelines import checkpoint as ckpt
from pipelines.config import config_to_dict, load_config
from pipelines.runner import Runner, _warn_config_changes


class _Stop(Exception):
    """Ends run() right after the restore: the rest of the run is not what these tests look at."""


def _cfg(tmp_path, *more):
    return load_config(None, [f"runner.output_dir={tmp_path / 'run'}", "resources.backend=local", *more])


def _changed(caplog):
    return [r.getMessage() for r in caplog.records if "--resume with a changed config" in r.getMessage()]


def test_each_changed_training_key_is_logged_against_the_state_given(tmp_path, caplog):
    """The stored config comes from the parsed runner.json handed in (config.json is not needed); keys that only
    change reporting are not listed."""
    before = config_to_dict(_cfg(tmp_path))
    now = config_to_dict(_cfg(tmp_path, "actor.lr=0.01", "runner.plot=true"))
    with caplog.at_level("WARNING", logger="orchestra"):
        _warn_config_changes({"step": 1, "config": before}, tmp_path / "absent.json", now)
    msgs = _changed(caplog)
    assert len(msgs) == 1 and f"actor.lr: {before['actor']['lr']!r} -> 0.01" in msgs[0]
    assert "runner.plot" not in msgs[0]


def test_a_checkpoint_without_a_stored_config_is_compared_with_config_json(tmp_path, caplog):
    """Checkpoints from before runner.json kept the config: the run's config.json stands in for it."""
    before = config_to_dict(_cfg(tmp_path))
    fallback = tmp_path / "config.json"
    fallback.write_text(json.dumps(before))
    with caplog.at_level("WARNING", logger="orchestra"):
        _warn_config_changes({"step": 1}, fallback, config_to_dict(_cfg(tmp_path, "runner.total_steps=7")))
    msgs = _changed(caplog)
    assert len(msgs) == 1 and "runner.total_steps:" in msgs[0] and "LR schedule" in msgs[0]


async def test_a_resume_reads_runner_json_once(tmp_path, monkeypatch, caplog):
    """run() reads the checkpoint's runner.json once and both the config check and the restore use it."""
    first = Runner(_cfg(tmp_path, "runner.total_steps=1"), progress=False)
    first.cluster = FakeCluster()
    saved = await first.save(0)

    reads = []
    read_json = ckpt.read_json

    def counting(path):
        reads.append(path)
        return read_json(path)

    async def stop(self):
        raise _Stop

    monkeypatch.setattr(ckpt, "read_json", counting)
    monkeypatch.setattr(runner_mod, "build_cluster", lambda cfg, task: FakeCluster())
    monkeypatch.setattr(Runner, "_sync_rollout", stop)
    second = Runner(_cfg(tmp_path, "runner.total_steps=3"), progress=False, resume_from=saved)
    with caplog.at_level(logging.WARNING, logger="orchestra"), pytest.raises(_Stop):
        await second.run()
    assert [p for p in reads if p.name == "runner.json"] == [saved / "runner.json"]
    assert second.start_step == 1  # restored from the state read in run()
    assert len(_changed(caplog)) == 1 and "runner.total_steps: 1 -> 3" in _changed(caplog)[0]


@pytest.mark.parametrize("field,value", [
    ("step", -4), ("step", 4.0), ("step", True), ("actor_version", "3"), ("actor_version", -1),
    ("kl_ctl", {"coef": float("nan")}), ("kl_ctl", {"coef": -7.0}), ("kl_ctl", {}), ("kl_ctl", 3),
    ("rng", {"python": "not a state"}), ("rng", 5),
])
async def test_a_runner_json_whose_values_are_not_the_runners_is_refused_before_anything_starts(
        tmp_path, monkeypatch, field, value):
    """runner.json's values were taken as written (engine_state.json's are checked): a NaN or negative KL
    coefficient, a negative or float step, a string actor version loaded and the run went on with them; a missing
    coef or a malformed RNG state failed with a raw KeyError / ValueError."""
    cfg = ["algorithm.kl_target=0.1", "algorithm.kl_coef=0.05"]
    first = Runner(_cfg(tmp_path, "runner.total_steps=2", *cfg), progress=False)
    first.cluster = FakeCluster()
    first.kl_ctl = runner_mod.make_kl_controller(first.cfg)
    saved = await first.save(0)
    state = json.loads((saved / "runner.json").read_text())
    state[field] = value
    monkeypatch.setattr(ckpt, "read_json", lambda path: state if path.name == "runner.json" else {})
    started = []
    monkeypatch.setattr(runner_mod, "build_cluster", lambda cfg, task: started.append(1) or FakeCluster())
    second = Runner(_cfg(tmp_path, "runner.total_steps=9", *cfg), progress=False, resume_from=saved)
    with pytest.raises(ckpt.CheckpointError, match=rf"runner.json.*{field}"):
        await second.run()
    assert not started  # refused before the cluster was built
