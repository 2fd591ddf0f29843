"""Shared setup for the core unit tests: one torch thread (the CI box has 2 cores); no Ray cluster is started.
``seq``: a Sequencer of the in-process backend for one test (closed afterwards)."""

from collections.abc import Iterator

import pytest
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
