"""Prompt datasets: load records from jsonl / parquet, and sample batches resumably.

A record is a dict with at least a ``"prompt"`` field (a string, or a chat as a list of
``{"role", "content"}`` dicts); every other field (answers, ids, task metadata) rides along.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("orchestra")

PROMPT_KEY = "prompt"
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")


def _check_record(
    row: Any, where: str, prompt_key: str, required_keys: Sequence[str]
) -> dict[str, Any]:
    """Validate one raw row and rename ``prompt_key`` to ``"prompt"``; ``where`` names file and row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in (prompt_key, *required_keys) if k not in row]
    if missing:
        raise ValueError(
            f"{where}: missing key(s) {', '.join(map(repr, missing))}; keys present: {sorted(row)}"
        )
    prompt = row[prompt_key]
    is_chat = isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    )
    if not ((isinstance(prompt, str) or is_chat) and prompt):
        raise ValueError(
            f"{where}: {prompt_key!r} must be a non-empty string or a list of "
            f"{{'role', 'content'}} messages, got {prompt!r:.80}"
        )
    if prompt_key != PROMPT_KEY:
        if PROMPT_KEY in row:
            raise ValueError(
                f"{where}: has both {prompt_key!r} and {PROMPT_KEY!r}; cannot rename {prompt_key!r} "
                f"to {PROMPT_KEY!r}"
            )
        row = {PROMPT_KEY if k == prompt_key else k: v for k, v in row.items()}
    return row


def load_prompts(
    path: str | Path, *, prompt_key: str = PROMPT_KEY, required_keys: Sequence[str] = (),
    check: Callable[[dict[str, Any], str], None] | None = None,
) -> list[dict[str, Any]]:
    """Read a ``.jsonl`` or ``.parquet`` file into a list of records.

    The prompt is read from column ``prompt_key`` and stored under ``"prompt"``; ``required_keys``
    (e.g. ``("answer",)``) must be present too.  A bad row raises ``ValueError`` naming the file
    and the line (jsonl, 1-based; blank lines are skipped) or row (parquet, 0-based).  ``check``:
    the caller's own check of each record, given it and that file-and-row name (it raises).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    records: list[dict[str, Any]] = []
    if suffix in _JSONL_SUFFIXES:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:line {lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                records.append(_check_record(row, where, prompt_key, required_keys))
                if check is not None:
                    check(records[-1], where)
    elif suffix in _PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow: pip install 'orchestra-rl[data]'",
                              name="pyarrow") from e
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            records.append(_check_record(row, f"{path}:row {i}", prompt_key, required_keys))
            if check is not None:
                check(records[-1], f"{path}:row {i}")
    else:
        allowed = ", ".join(_JSONL_SUFFIXES + _PARQUET_SUFFIXES)
        raise ValueError(f"{path}: unsupported file type {suffix!r}; expected one of {allowed}")
    if not records:
        raise ValueError(f"{path}: no records")
    return records


class PromptSampler:
    """Endless iterator of prompt batches, epoch after epoch, deterministic for a seed.

    Epoch ``e`` visits the records in the order of a permutation drawn from ``(seed, e)`` (or in
    file order with ``shuffle=False``).  With ``drop_last`` (the default) every batch is full: shuffled,
    the ``len(records) % batch_size`` records left over at the end of an epoch are dropped (other ones
    each epoch, so every record is seen over epochs); unshuffled, where dropping would skip the same
    records every pass, the order wraps around instead: the last batch of a pass is filled from the
    start of the next, so every record is trained on.  ``drop_last=False`` keeps a partial last batch.
    ``take(k)`` draws the next ``k`` records of the same stream (the next batch starts after them).
    The position is two integers, so ``state_dict()`` saved with a checkpoint and ``load_state_dict()``
    on a fresh sampler continue with exactly the batches an uninterrupted run would have produced,
    mid-epoch included.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not records:
            raise ValueError("no records to sample from")
        if drop_last and len(records) < batch_size:
            raise ValueError(
                f"{len(records)} records cannot fill one batch of {batch_size} with drop_last=True"
            )
        self._records = records
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._epoch = 0
        self._start = 0  # where the next batch starts in the epoch's order (a multiple of batch_size unless wrap)
        self._order_epoch = -1
        self._order = np.arange(0)
        self._digest: str | None = None

    @property
    def wraps(self) -> bool:
        """True when a batch may run past the end of a pass into the next (unshuffled with ``drop_last``)."""
        return self.drop_last and not self.shuffle

    @property
    def batches_per_epoch(self) -> int:
        """Batches it takes to draw every record once: ``len // batch_size`` when shuffled with drop_last (the
        remainder is dropped), else rounded up (the partial last batch, or the one that wraps around)."""
        n = len(self._records)
        return n // self.batch_size if self.drop_last and self.shuffle else -(-n // self.batch_size)

    @property
    def epoch(self) -> int:
        """Epoch (pass over the records) that the next batch's first record comes from."""
        return self._epoch

    def _epoch_order(self) -> np.ndarray:
        """Record indices in the order of the current epoch (cached per epoch)."""
        if self._order_epoch != self._epoch:
            n = len(self._records)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self._epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self._epoch
        return self._order

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """The sampler is its own (endless) iterator; stop after the steps you need."""
        return self

    def __next__(self) -> list[dict[str, Any]]:
        """The next batch, as a list of (shallow-copied) records."""
        size = self.batch_size
        if not self.drop_last:  # a partial batch at the end of an epoch, as ever
            size = min(size, len(self._records) - self._start)
        return self._draw(size)

    def take(self, count: int) -> list[dict[str, Any]]:
        """The next ``count`` records of the batches' stream, in order (running on into the next epoch if need
        be); the next batch starts after them. For a draw of another size than a batch (DAPO's extra sampling
        rounds): taking a whole batch and dropping the rest would skip records the run never trains on. A draw holds
        each record at most once, so ``count`` is at most :attr:`records_per_epoch` (more is refused); shuffled, a
        draw longer than the rest of the epoch starts the next one, and the rest is not drawn this epoch (as
        drop_last's remainder; without drop_last too, where running on would mix two permutations)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        limit = self._epoch_length()
        if count > limit:
            dropped = len(self._records) - limit
            raise ValueError(
                f"take({count}): one draw holds each record at most once, and an epoch holds {limit} records"
                + (f" ({len(self._records)}, less the {dropped} left over by batches of {self.batch_size})"
                   if dropped else "")
                + f"; take at most {limit}, or sample from more records")
        return self._draw(count)

    @property
    def records_per_epoch(self) -> int:
        """The most records one draw can hold (:meth:`take`): an epoch's stream, without the remainder shuffled
        batches drop."""
        return self._epoch_length()

    def _epoch_length(self) -> int:
        """Records an epoch's stream holds: all of them, less the dropped remainder when shuffled with drop_last."""
        n = len(self._records)
        return n // self.batch_size * self.batch_size if self.drop_last and self.shuffle else n

    def _draw(self, count: int) -> list[dict[str, Any]]:
        """The next ``count`` records of the stream: the epochs' orders one after another. Shuffled, one draw never
        spans two epochs (two permutations could give it one record twice): an epoch's last records too few for it
        are dropped, as its remainder is."""
        idx: list[int] = []
        length = self._epoch_length()
        if length <= 0:
            raise RuntimeError("the sampler has no records left to draw (its record list was emptied)")
        if self.shuffle and self._start and length - self._start < count:  # (a batch without drop_last never is)
            self._epoch, self._start = self._epoch + 1, 0
        while len(idx) < count:
            order = np.arange(len(self._records)) if self.wraps else self._epoch_order()
            m = min(count - len(idx), length - self._start)
            idx.extend(order[self._start:self._start + m].tolist())
            self._start += m
            if self._start >= length:
                self._epoch, self._start = self._epoch + 1, 0
        return [dict(self._records[i]) for i in idx]

    def records_digest(self) -> str:
        """sha256 of the records (canonical JSON; a value JSON cannot hold by its repr): a resume must sample the
        same records, not just as many (another ``task.params`` or data file of the same length would pass a count)."""
        if self._digest is None:
            h = hashlib.sha256()
            for r in self._records:
                h.update(json.dumps(r, sort_keys=True, default=repr).encode())
                h.update(b"\n")
            self._digest = h.hexdigest()
        return self._digest

    def state_dict(self) -> dict[str, int | bool | str]:
        """JSON-serializable position plus the settings a resume must share. The position is ``epoch`` and
        ``batch_in_epoch``, or ``epoch`` and ``record_in_epoch`` with the wrap-around or when a ``take`` of another
        size than a batch left the position between batch boundaries (a sampler of the code before ``take`` cannot
        load such a state)."""
        aligned = not self.wraps and self._start % self.batch_size == 0
        where: dict[str, int] = ({"batch_in_epoch": self._start // self.batch_size} if aligned
                                 else {"record_in_epoch": self._start})
        return {
            "epoch": self._epoch,
            **where,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_records": len(self._records),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "wrap": self.wraps,
            "records_sha256": self.records_digest(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position; refuses a state saved with other data or settings. An unshuffled state
        written before the wrap-around (no ``wrap`` key) resumes at the same record, with a warning."""
        mine = self.state_dict()
        mismatched = [
            f"{k}: saved {state.get(k)!r}, now {mine[k]!r}"
            for k in ("seed", "batch_size", "num_records", "shuffle", "drop_last")
            if state.get(k) != mine[k]
        ]
        if "wrap" in state and state["wrap"] != mine["wrap"] and not mismatched:
            mismatched.append(f"wrap: saved {state['wrap']!r}, now {mine['wrap']!r}")
        if "records_sha256" not in state:
            log.warning("the sampler state predates record digests: cannot check that the resumed run samples the "
                        "same records (only as many)")
        elif state["records_sha256"] != mine["records_sha256"]:
            mismatched.append(f"records: {len(self._records)} as before, but not the same ones (sha256 "
                              f"{str(state['records_sha256'])[:12]}... saved, {str(mine['records_sha256'])[:12]}... "
                              f"now: another task.params or data file?)")
        if mismatched:
            raise ValueError("sampler state does not match this sampler: " + "; ".join(mismatched))
        n, size = len(self._records), self.batch_size
        epoch = int(state["epoch"])
        if "record_in_epoch" in state:
            start = int(state["record_in_epoch"])
            ok = 0 <= start < self._epoch_length()
            where = f"record_in_epoch={start} (records in an epoch: {self._epoch_length()})"
        else:
            batch = int(state["batch_in_epoch"])
            start = batch * size
            # an unshuffled state from before the wrap-around: its batches started at multiples of batch_size
            last = n // size if self.wraps else self.batches_per_epoch
            ok = 0 <= batch < last
            where = f"batch_in_epoch={batch} (batches per epoch: {last})"
            if ok and self.wraps and n % size:
                log.warning(
                    "the prompt sampler state was written before data.shuffle=false wrapped around: the interrupted "
                    "run never drew the last %d of the %d records of a pass; the resumed run continues at the same "
                    "record (epoch %d, record %d) and from the end of this pass wraps around to the start of the next, "
                    "so every record is trained on (its batches after this pass differ from the old run's)",
                    n % size, n, epoch, start)
        if epoch < 0 or not ok:
            raise ValueError(f"sampler state position out of range: epoch={epoch}, {where}")
        self._epoch, self._start = epoch, start
