"""train_step reduces the loss_fn metrics over the DP ranks *by name*: a metric only some ranks (or micro-batches)
report counts as 0 where it is missing, so ranks with different metric names never add unrelated values."""

from __future__ import annotations

import pytest
from dp_engine_testutils import metric_keys_worker

from engines._dist import spawn

pytestmark = pytest.mark.timeout(300)  # a bound on a hang; spawns take minutes on a loaded 2-core box


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_metrics_with_different_names_on_the_ranks_are_reduced_by_name():
    r0, r1 = spawn(metric_keys_worker, 2)
    assert r0 == r1  # every rank returns the same global metrics
    # 20 tokens in all: rank 0's 16 report long_frac = 100, rank 1's 4 report short_frac = 1 (0 where missing)
    assert r0["tokens"] == 20.0
    assert r0["long_frac"] == pytest.approx(100.0 * 16 / 20)
    assert r0["short_frac"] == pytest.approx(1.0 * 4 / 20)
