"""Helpers shared by the built-in tasks: jsonl io and the integer answer format."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["is_correct", "is_well_formed", "one_of", "read_jsonl", "real_number", "whole_number", "write_jsonl"]

_INT_RE = re.compile(r"-?(0|[1-9][0-9]*)")


def write_jsonl(records: Sequence[dict], path: str | Path) -> Path:
    """Write records one JSON object per line; creates parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a file written by :func:`write_jsonl` (blank lines skipped)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def is_correct(response_text: str, answer: str) -> bool:
    """Exact match of the (whitespace-stripped) response with the answer."""
    return response_text.strip() == str(answer).strip()


def is_well_formed(response_text: str) -> bool:
    """True if the response is exactly a canonical integer: optional '-', no
    leading zeros, no spaces (so padding the output with junk earns nothing)."""
    return _INT_RE.fullmatch(response_text) is not None


def _bounds(key: str, value: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> None:
    """ValueError naming ``key`` when ``value`` is outside the bounds (``lo``/``hi`` inclusive unless open)."""
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if below or above:
        raise ValueError(f"{key} must be {' and '.join(parts)}, got {value!r}")


def whole_number(params: dict | Any, key: str, default: int, *, lo: int | None = None,
                 hi: int | None = None) -> int:
    """``params[key]`` as an int: an int, or a finite float with no fractional part (YAML's ``1.0e3``); anything
    else (a string, ``2.7``, ``.inf``, a bool) is a ValueError naming the key, not a silent conversion. ``lo``/``hi``:
    inclusive bounds, checked too."""
    value = params.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise ValueError(f"{key} must be a whole number, got {value!r}")
    _bounds(key, int(value), lo, hi, False, False)
    return int(value)


def real_number(params: dict | Any, key: str, default: float | None, *, lo: float | None = None,
                hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> float | None:
    """``params[key]`` as a float: an int or a finite float (``None`` only where ``default`` is None and the key
    is missing or null); a bool, a string or ``.nan``/``.inf`` is a ValueError naming the key, not a conversion
    (``yes`` is not 1.0). ``lo``/``hi``: bounds, exclusive with ``lo_open``/``hi_open``."""
    value = params.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    _bounds(key, value, lo, hi, lo_open, hi_open)
    return float(value)


def one_of(params: dict | Any, key: str, default: str, choices: Sequence[str]) -> str:
    """``params[key]``, which must be one of the strings ``choices`` (a ValueError naming the key otherwise)."""
    value = params.get(key, default)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value
