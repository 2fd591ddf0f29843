"""Where step metrics go: ``metrics.jsonl`` (unless runner.metrics=false), TensorBoard (when asked for; it needs the
tensorboard package), a PNG plot."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from .checkpoint import METRICS, TENSORBOARD, CheckpointError

__all__ = ["MetricsSink", "decode_record", "encode_record", "plot_metrics", "read_metrics"]

log = logging.getLogger("orchestra")

NONFINITE_KEY = "nonfinite"  # the record key that keeps what a null stands for ("NaN", "Infinity", "-Infinity")


def encode_record(rec: dict[str, Any]) -> str:
    """One strict-JSON line for ``rec``: a non-finite float (a diverged loss) becomes ``null`` and its value is kept
    under ``"nonfinite": {key: "NaN" | "Infinity" | "-Infinity"}``. Python's default would write bare ``NaN``
    tokens, which jq and other strict JSON readers refuse; :func:`read_metrics` puts the floats back."""
    if NONFINITE_KEY in rec:
        raise ValueError(f"a metrics record may not have a {NONFINITE_KEY!r} key (metrics.jsonl uses it for "
                         f"non-finite values); rename it: {sorted(rec)}")
    out: dict[str, Any] = {}
    bad: dict[str, str] = {}
    for k, v in rec.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k], bad[k] = None, json.dumps(v)  # 'NaN', 'Infinity' or '-Infinity'
        else:
            out[k] = v
    if bad:
        out[NONFINITE_KEY] = bad
    return json.dumps(out, allow_nan=False)


def decode_record(rec: dict[str, Any]) -> dict[str, Any]:
    """The record :func:`encode_record` was given: the ``nonfinite`` values put back as floats."""
    bad = rec.pop(NONFINITE_KEY, None)
    if isinstance(bad, dict):
        rec.update({k: float(v) for k, v in bad.items()})
    return rec


def _parse_lines(path: Path, *, torn_tail_ok: bool) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` for each non-empty line. A last line cut short by a crash is dropped with a warning
    when ``torn_tail_ok``; any other line that is not a JSON object raises :class:`CheckpointError` naming it."""
    lines = path.read_text().splitlines()
    out: list[tuple[str, dict[str, Any]]] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "step" not in rec:
                raise ValueError("not an object with a 'step'")
        except ValueError as e:
            if torn_tail_ok and no == len(lines):
                log.warning("%s line %d is incomplete (the run stopped while writing it); dropping it", path, no)
                break
            raise CheckpointError(f"{path} line {no} is not valid JSON ({e}); fix or remove that line") from e
        out.append((line, rec))
    return out


class MetricsSink:
    """Appends one strict-JSON object per step to ``metrics.jsonl`` (:func:`encode_record`: a non-finite value is
    ``null`` plus a ``nonfinite`` entry); mirrors numbers to TensorBoard if enabled.

    On resume, step lines after the checkpointed step (``truncate_after``) are dropped so that the file reads as one
    uninterrupted run; event lines (``"event"`` key: a restart) are kept. They are dropped with ``enabled=False``
    (runner.metrics=false) too: the file then ends at the checkpoint instead of describing steps that were undone.
    TensorBoard hides the events of the redone steps the same way (``purge_step``), on a resume and on a restart.
    """

    def __init__(self, out: Path, *, tensorboard: bool = False, truncate_after: int | None = None,
                 enabled: bool = True) -> None:
        """``out``: the run's output_dir; ``truncate_after``: the checkpoint step of a resume (None: a fresh run,
        which starts an empty file); ``enabled``: write metrics.jsonl (runner.metrics)."""
        self.path = Path(out) / METRICS
        self.enabled = enabled
        self._tb: Any = None
        self._tb_dir = Path(out) / TENSORBOARD
        if truncate_after is not None:
            self.truncate(truncate_after)
        elif enabled:
            self.path.write_text("")
        if tensorboard:  # the config refuses runner.tensorboard=true without the package; never no events silently
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(f"runner.tensorboard=true needs the tensorboard package ({e}): pip install "
                                  "tensorboard, or set runner.tensorboard=false") from e
            self._writer = SummaryWriter
            self._tb = self._open_tb(None if truncate_after is None else truncate_after + 1)

    def _open_tb(self, purge_step: int | None) -> Any:
        """A SummaryWriter on ``out/tensorboard``; ``purge_step``: the first step (re)done from here, whose events and
        later ones, written before, TensorBoard then hides (they were undone)."""
        return self._writer(str(self._tb_dir), purge_step=purge_step)

    def write(self, rec: dict[str, Any]) -> None:
        """Record one step's metrics (``rec["step"]``): a line in metrics.jsonl, the numbers in TensorBoard."""
        if self.enabled:
            with self.path.open("a") as f:
                f.write(encode_record(rec) + "\n")
        if self._tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, rec["step"])

    def truncate(self, after: int) -> None:
        """Drop the step lines after step ``after`` (a resume or a restart redoes those steps), also with metrics off;
        event lines (a restart) stay on record. TensorBoard hides its events of those steps (a new writer with
        ``purge_step=after + 1``)."""
        if self.path.exists():
            keep = [line for line, rec in _parse_lines(self.path, torn_tail_ok=True)
                    if rec["step"] <= after or "event" in rec]
            self.path.write_text("".join(line + "\n" for line in keep))
            if not self.enabled:
                log.info("runner.metrics=false: %s keeps the earlier run's lines up to step %d; the steps run now "
                         "are not recorded there", self.path, after)
        if self._tb is not None:
            self._tb.close()
            self._tb = self._open_tb(after + 1)

    def event(self, rec: dict[str, Any]) -> None:
        """Append an event line (``{"event": "restart", "step": k, ...}``): kept when a resume truncates the step
        lines after it, not mirrored to TensorBoard. Readers tell events from steps by the ``event`` key."""
        if "event" not in rec or "step" not in rec:
            raise ValueError(f"an event line needs 'event' and 'step' keys, got {sorted(rec)}")
        if self.enabled:
            with self.path.open("a") as f:
                f.write(encode_record(rec) + "\n")

    def close(self) -> None:
        """Flush and close the TensorBoard writer (metrics.jsonl is closed after every line)."""
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (a bad line raises :class:`CheckpointError` naming it), with the
    non-finite values that :func:`encode_record` wrote as ``null`` put back as floats."""
    return [decode_record(rec) for _, rec in _parse_lines(Path(path), torn_tail_ok=False)]


def plot_metrics(path: str | Path, png: str | Path, keys: tuple[str, ...] = ("reward/mean",)) -> Path | None:
    """Plot ``keys`` by step (with a 10-step moving average) to ``png``; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = read_metrics(path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for key in keys:
        pts = [(r["step"], r[key]) for r in recs if key in r]
        if not pts:
            continue
        steps, vals = zip(*pts)
        ax.plot(steps, vals, alpha=0.35, label=key)
        w = 10
        avg = [sum(vals[max(0, i - w + 1): i + 1]) / len(vals[max(0, i - w + 1): i + 1]) for i in range(len(vals))]
        ax.plot(steps, avg, label=f"{key} (10-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return Path(png)
