"""The controller's numpy RNG resumes exactly: the checkpoint keeps the legacy generator's cached Gaussian too
(``has_gauss`` / ``cached_gaussian``), so after an odd number of Gaussian draws (a user's step or reward calling
``np.random.normal``) the resumed stream is the uninterrupted one. Before, a resume dropped the cached value."""

from __future__ import annotations

import json

import numpy as np

from fake_engine_ckpt import FakeCluster
from pipelines.config import load_config
from pipelines.runner import Runner, _rng_state, _set_rng_state


def test_the_numpy_gaussian_stream_resumes_exactly():
    np.random.seed(0)
    np.random.standard_normal()  # an odd number of draws: one Gaussian is cached
    saved = json.loads(json.dumps(_rng_state()))  # as runner.json keeps it
    want = np.random.standard_normal(5).tolist()
    np.random.seed(123)  # a fresh process on resume
    _set_rng_state(saved)
    assert np.random.standard_normal(5).tolist() == want


def test_a_state_without_the_cached_gaussian_still_loads():
    """A checkpoint written before the cached Gaussian was kept: the generator resumes at its saved position, with
    nothing cached (what those checkpoints always resumed to)."""
    np.random.seed(0)
    np.random.standard_normal()
    old = {k: v for k, v in json.loads(json.dumps(_rng_state())).items() if k in ("python", "numpy", "numpy_pos",
                                                                                   "torch")}
    _set_rng_state(old)
    _, key, pos, has_gauss, cached = np.random.get_state()
    assert has_gauss == 0 and cached == 0.0
    assert key.tolist() == old["numpy"] and pos == old["numpy_pos"]


async def test_a_checkpoint_restores_the_numpy_gaussian_stream(tmp_path):
    cfg = load_config(None, [f"runner.output_dir={tmp_path / 'run'}"])
    first = Runner(cfg, progress=False)
    first.cluster = FakeCluster()
    np.random.seed(7)
    np.random.normal(size=3)
    saved = await first.save(0)
    want = np.random.normal(size=4).tolist()
    np.random.seed(99)
    second = Runner(cfg, progress=False, resume_from=saved)
    second.cluster = FakeCluster()
    await second._restore()
    assert np.random.normal(size=4).tolist() == want
