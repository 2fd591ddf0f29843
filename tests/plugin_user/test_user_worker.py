"""A user's test file: nothing but the make_group fixture (from the installed orchestra pytest plugin) and
pytest-asyncio's marker. No conftest.py: the plugin is registered by the package's pytest11 entry point."""

from __future__ import annotations

import pytest
import torch
from user_workers import Accumulator

from orchestra import Batch


@pytest.mark.asyncio
async def test_double_splits_rows_over_ranks_and_keeps_their_order(make_group):
    group = await make_group(Accumulator, 0, ranks=2)
    out = await group.double(Batch.from_dict({"x": torch.arange(5)}))
    assert out["y"].tolist() == [0, 2, 4, 6, 8]
    assert out["rank"].tolist() == [0, 0, 0, 1, 1]


@pytest.mark.asyncio
async def test_add_keeps_a_total_on_every_rank(make_group):
    group = await make_group(Accumulator, 10, ranks=2)
    assert await group.add(1) == [11, 11]
    assert await group.add(2) == [13, 13]
    assert await group.total_on_rank_zero() == 13
