"""Shared setup for the core unit tests: one torch thread (the CI box has 2 cores); no Ray cluster is started.
``seq``: a Sequencer of the in-process backend for one test (closed afterwards); ``no_ray``: a module fixture that
fails a module of in-process tests that started Ray (``pytestmark = pytest.mark.usefixtures("no_ray")``)."""

from collections.abc import Iterator

import pytest
import ray
import torch

from orchestra.testing import Sequencer

torch.set_num_threads(1)


@pytest.fixture
def seq() -> Iterator[Sequencer]:
    s = Sequencer(backend="local")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def no_ray() -> Iterator[None]:
    """Nothing in the module may start Ray (it would cost seconds and belong to the slow tier)."""
    before = ray.is_initialized()
    yield
    if not before:
        assert not ray.is_initialized(), "a test of the in-process backend started Ray"
