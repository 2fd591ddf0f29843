"""What the controller's per-call checks of a Batch cost on the event loop, against what they replace.

    python -m bench.batch_checks [--rows 8192,65536] [--iters 7]

- ``write_check``: a call sent later remembers its Batch arguments as they were made and compares them at the send
  (``_invocation._mark`` / ``_changed``). An object column of strings is compared by its elements' identity
  (``_ObjectPrint``); the baseline, measured in the same run, is what that replaced: the column pickled at the call
  and again at the send (``_fingerprint``). A column of dicts is pickled either way (its values can change in place).
- ``wire_check``: every pickle of a Batch refuses a TensorDict value the wire would drop (``Batch._check_wire``);
  the baseline is the pickle itself, of a 6-column Batch of 8 rows.

Prints JSON: per case, the median milliseconds of ``iters`` runs, each case timed in a block of its own after the
previous one (not interleaved, no warm-up run: the cases differ by 5x and more, beyond what ordering moves here).
``pickle_us`` includes the pickle's own ``_check_wire``; ``_fingerprint`` is today's (it pickles through
``_frame.dumps_frame``), so a change to it changes this baseline too.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from orchestra import Batch
from orchestra._invocation import _changed, _fingerprint, _mark

from ._common import emit


def _median_ms(fn: Callable[[], Any], iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(samples), 4)


def _write_check(rows: int, iters: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    columns = {"strings": [f"prompt number {i} " * 4 for i in range(rows)], "dicts": [{"i": i} for i in range(rows)]}
    for kind, values in columns.items():
        b = Batch.from_dict({"x": torch.arange(rows), "c": values})
        col = b.non_tensors["c"]
        mark = _mark(b)
        assert _changed(b, mark) is None
        out[kind] = {
            "mark_ms": _median_ms(lambda: _mark(b), iters),
            "check_ms": _median_ms(lambda: _changed(b, mark), iters),
            "pickled_baseline_ms": _median_ms(lambda: _fingerprint(col), iters),  # once at the call, once at the send
        }
    return out


def _wire_check(iters: int) -> dict[str, Any]:
    b = Batch.from_dict({k: torch.zeros(8, 4) for k in "abcdef"})
    reps = 2000
    return {"check_us": round(1e3 * _median_ms(lambda: [b._check_wire() for _ in range(reps)], iters) / reps, 3),
            "pickle_us": round(1e3 * _median_ms(lambda: [pickle.dumps(b) for _ in range(reps)], iters) / reps, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8192,65536")
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    emit({"bench": "batch_checks", "iters": args.iters,
          "write_check": {int(n): _write_check(int(n), args.iters) for n in args.rows.split(",")},
          "wire_check": _wire_check(args.iters)})


if __name__ == "__main__":
    main()
