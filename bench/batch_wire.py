"""A fast call's small pieces, hot, each against the way it was done before, in the same run.

    python -m bench.batch_wire [--calls 20000] [--rounds 5]

Session 32 cut the per-call work a fast call does on the wire and in its Batches; this bench measures each cut
against what it replaced (the replaced way forced back for the baseline):

- ``plain_reply``: a reply ``{"loss": 0.5, "rows": 4.0}`` pickled by ``dumps_frame`` (``_frame._plain``: no
  reductions table) against the general pickling (``_frame._pickle``: a Pickler with the call's reductions table);
- ``shard_dumps`` / ``shard_loads``: a 4-row Batch frame with its small column inside the pickle, against the same
  column as an out-of-band numpy buffer (``SMALL_COLUMN_BYTES`` set to -1); also the frames' bytes;
- ``split``: a 16-row Batch cut in 4 column by column (``_cut_by_column``) against ``TensorDict.split``;
- ``rebuild``: a flat Batch unpickled with ``TensorDict._new_unsafe`` against TensorDict's constructor;
- ``nbytes``: ``Batch.nbytes`` summed at the top level against the walk of every leaf;
- ``read_only_column``: a tensor made from a read-only array, plainly (torch's one warning spent) against inside a
  ``warnings.catch_warnings()`` filter.

Prints JSON: per case, µs per operation (median over ``--rounds`` rounds of ``--calls``; the two ways alternate),
and their ratio. Hot: each loop's code and data stay in the caches; in a Ray rank the same code costs 3–13x this
(``python -m bench.rank_path``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from orchestra import Batch, _batch, _frame

from ._common import emit


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _us(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _compare(now: Callable[[], Any], before: Callable[[], Any], calls: int, rounds: int,
             setup_before: Callable[[], Any] | None = None) -> dict[str, float]:
    """µs per call of ``now`` and of ``before`` (run under ``setup_before()``, a context manager), alternating."""
    a, b = [], []
    for _ in range(rounds):
        a.append(_us(now, calls))
        if setup_before is None:
            b.append(_us(before, calls))
        else:
            with setup_before():
                b.append(_us(before, calls))
    now_us, before_us = statistics.median(a), statistics.median(b)
    return {"now_us": round(now_us, 3), "before_us": round(before_us, 3), "now_over_before": round(now_us / before_us, 3)}


def measure(calls: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reply = {"loss": 0.5, "rows": 4.0}
    out["plain_reply"] = _compare(lambda: _frame.dumps_frame(reply),
                                  lambda: _frame._framed(*_frame._pickle(reply, _frame._refuse), _frame.FRAME_BYTES),
                                  calls, rounds)

    shard = Batch.from_dict({"x": torch.arange(4)})
    in_band = _frame.dumps_frame(shard)
    with _patched(_batch, "SMALL_COLUMN_BYTES", -1):
        out_of_band = _frame.dumps_frame(shard)
    oob = lambda: _patched(_batch, "SMALL_COLUMN_BYTES", -1)  # noqa: E731 - the baseline's setting
    out["shard_dumps"] = {**_compare(lambda: _frame.dumps_frame(shard), lambda: _frame.dumps_frame(shard), calls,
                                     rounds, oob),
                          "now_bytes": len(in_band), "before_bytes": len(out_of_band)}
    out["shard_loads"] = _compare(lambda: _frame.loads_frame(in_band), lambda: _frame.loads_frame(out_of_band),
                                  calls, rounds)

    batch = Batch.from_dict({"x": torch.arange(16)})
    out["split"] = _compare(lambda: batch.split([4, 4, 4, 4]), lambda: batch.split([4, 4, 4, 4]), calls, rounds,
                            lambda: _patched(_batch, "_cut_by_column", lambda td: False))
    out["rebuild"] = _compare(lambda: _frame.loads_frame(in_band), lambda: _frame.loads_frame(in_band), calls, rounds,
                              lambda: _patched(_batch, "_NEW_UNSAFE", None))
    td = batch._td
    out["nbytes"] = _compare(lambda: batch.nbytes,
                             lambda: sum(t.numel() * t.element_size()
                                         for t in td.values(include_nested=True, leaves_only=True)), calls, rounds)

    arr = np.frombuffer(bytes(64), dtype=np.int64)  # read-only, as a frame's out-of-band column is

    def guarded() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    guarded()  # torch's one warning of this process spent, as orchestra's first such conversion spends it
    out["read_only_column"] = _compare(lambda: torch.from_numpy(arr), guarded, calls, rounds)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    emit({"bench": "batch_wire", "calls": a.calls, "rounds": a.rounds, "results": measure(a.calls, a.rounds)})


if __name__ == "__main__":
    main()
