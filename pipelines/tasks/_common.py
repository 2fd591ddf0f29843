"""Helpers shared by the built-in tasks: jsonl io and the integer answer format."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["is_correct", "is_well_formed", "read_jsonl", "whole_number", "write_jsonl"]

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


def whole_number(params: dict | Any, key: str, default: int) -> int:
    """``params[key]`` as an int: an int, or a finite float with no fractional part (YAML's ``1.0e3``); anything
    else (a string, ``2.7``, ``.inf``, a bool) is a ValueError naming the key, not a silent conversion."""
    value = params.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise ValueError(f"{key} must be a whole number, got {value!r}")
    return int(value)
