"""The adaptive KL controller's state goes into the runner's checkpoint and comes back on resume (the workers are
fakes: only runner.json matters here)."""

import json

import pytest

from fake_engine_ckpt import FakeCluster
from pipelines.config import load_config
from pipelines.runner import Runner


def _runner(tmp_path, resume_from=None):
    cfg = load_config(None, [f"runner.output_dir={tmp_path / 'run'}", "algorithm.kl_coef=0.1",
                             "algorithm.kl_target=0.05", "algorithm.kl_horizon=100"])
    r = Runner(cfg, progress=False, resume_from=resume_from)
    r.cluster = FakeCluster()
    return r


async def test_adaptive_kl_state_is_saved_and_restored(tmp_path):
    first = _runner(tmp_path)
    first.kl_ctl.update(0.5, n_steps=10)  # error capped at 0.2: 0.1 * (1 + 0.2 * 10 / 100) = 0.102
    saved = await first.save(3)
    state = json.loads((saved / "runner.json").read_text())["kl_ctl"]
    assert state == {"coef": pytest.approx(0.102, rel=1e-12), "target": 0.05, "horizon": 100}
    second = _runner(tmp_path, resume_from=saved)
    assert second.kl_ctl.coef == 0.1
    await second._restore()
    assert second.kl_ctl.state_dict() == first.kl_ctl.state_dict() and second.start_step == 4


async def test_a_resume_with_a_new_kl_target_and_horizon_uses_them(tmp_path):
    """A resume that changes algorithm.kl_target / kl_horizon (logged as a change) runs with the new ones; only the
    coefficient comes from the checkpoint. (The checkpoint's target and horizon overwrote the config's, silently.)"""
    first = _runner(tmp_path)
    first.kl_ctl.update(0.5, n_steps=10)
    saved = await first.save(3)
    cfg = load_config(None, [f"runner.output_dir={tmp_path / 'run'}", "algorithm.kl_coef=0.1",
                             "algorithm.kl_target=5.0", "algorithm.kl_horizon=80"])
    second = Runner(cfg, progress=False, resume_from=saved)
    second.cluster = FakeCluster()
    await second._restore()
    assert second.kl_ctl.state_dict() == {"coef": pytest.approx(0.102, rel=1e-12), "target": 5.0, "horizon": 80}
