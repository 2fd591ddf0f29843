"""With ``mini_batches > 1`` the update is the same on 1 and 2 data-parallel ranks: optimizer step i trains on
the *global* rows whose index is i modulo the number of mini-batches, whatever the DP size, so every rank holds part
of every mini-batch (docs/algorithms.md, "The objective is always the whole mini-batch's loss")."""

import pytest
import torch
from dp_testutils import update
from pipelines_testutils import policy_batch

from engines._dist import spawn
from pipelines.objectives import PolicyLoss

pytestmark = pytest.mark.timeout(300)  # a bound on a hang; a spawn takes a while on a loaded 2-core box

# 11 rows in 3 mini-batches: global rows {0, 3, 6, 9}, {1, 4, 7, 10}, {2, 5, 8}. On 2 ranks (rows 0-5 and 6-10) each
# rank holds 2 or 1 rows of each. Row 3 has no response token.
ROWS, MINI_BATCHES, EPOCHS = 11, 3, 2
LOSS = PolicyLoss(agg="seq-mean-token-mean", entropy_coef=0.01, kl_coef=0.1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_mini_batches_are_the_same_global_rows_on_any_dp_size():
    batch = policy_batch(B=ROWS)
    one = update(0, 1, batch, LOSS, EPOCHS, MINI_BATCHES)
    two = spawn(update, 2, batch, LOSS, EPOCHS, MINI_BATCHES)
    for rank in range(2):
        m1, m2 = one["metrics"], two[rank]["metrics"]
        assert m2["actor/optimizer_steps"] == m1["actor/optimizer_steps"] == EPOCHS * MINI_BATCHES
        for k in ("actor/loss", "actor/grad_norm", "actor/tokens", "actor/rows", "actor/entropy", "actor/kl_loss",
                  "actor/clipfrac", "actor/skipped"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), f"rank {rank} {k}: DP=2 {m2[k]} DP=1 {m1[k]}"
    state, ref = two[0]["state"], one["state"]
    assert set(state) == set(ref)
    for k, v in ref.items():
        if k.endswith("k_proj.bias"):  # its gradient is rounding noise (see engines_testutils.assert_states_close)
            continue
        assert _rel(state[k], v) < 1e-5, f"{k}: DP=2 weights differ from DP=1 by {_rel(state[k], v):.2e}"


def test_mini_batches_take_every_kth_row_and_every_rank_works_on_each():
    """On one rank, mini-batch i is rows i, i + k, i + 2k, ... (k mini-batches); a rank holding a block of the rows
    takes the same global rows from it, so it holds part of every mini-batch (no rank idles through an optimizer
    step, as with contiguous global slices)."""
    from engines.fsdp import FSDPEngine
    from engines.workers import _mini_batches
    from orchestra import Batch

    eng = FSDPEngine(lambda: torch.nn.Linear(2, 1), model_kind="value")
    b = Batch.from_dict({"x": torch.arange(10)})
    assert [p["x"].tolist() for p in _mini_batches(eng, b, 4, "update")] == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=r"update: the update has 3 rows over 1 data-parallel rank\(s\), fewer than "
                                         r"mini_batches=4"):
        _mini_batches(eng, Batch.from_dict({"x": torch.arange(3)}), 4, "update")


@pytest.mark.parametrize("rank, want", [(0, [[0], [1], [2], []]), (1, [[4], [], [], [3]])])
def test_a_rank_holding_fewer_rows_than_mini_batches_has_none_of_some(monkeypatch, rank, want):
    """5 rows over 2 ranks (3 + 2) in 4 mini-batches: global row g goes to mini-batch g % 4, so rank 1 (global rows
    3 and 4) has rows for mini-batches 0 and 3 only. (Its first row's mini-batch offset was past its row count, and
    ``torch.arange`` counting backwards raised on that rank alone, while rank 0 entered the update's collectives.)"""
    import types

    from engines import workers
    from orchestra import Batch

    def all_gather(out: list, _counts: torch.Tensor) -> None:
        for t, n in zip(out, (3, 2)):
            t.fill_(n)

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    eng = types.SimpleNamespace(device="cpu", dp_size=2, dp_rank=rank)
    rows = torch.arange(3) if rank == 0 else torch.arange(3, 5)
    pieces = workers._mini_batches(eng, Batch.from_dict({"x": rows}), 4, "update")
    assert [p["x"].tolist() for p in pieces] == want
