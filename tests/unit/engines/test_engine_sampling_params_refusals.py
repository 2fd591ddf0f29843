"""SamplingParams refuses values that would sample silently wrong: a non-finite temperature or top_p (NaN compared
false with every bound and passed), and a count (n, max_new_tokens, top_k) that is not an integer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engines.rollout import SamplingParams


@pytest.mark.parametrize("field,value,pattern", [
    ("temperature", math.nan, r"temperature must be a finite number >= 0.*nan"),
    ("temperature", math.inf, r"temperature must be a finite number >= 0.*inf"),
    ("temperature", "1.0", r"temperature must be a finite number >= 0.*'1.0'"),
    ("top_p", math.nan, r"top_p must be a finite number in \(0, 1\].*nan"),
    ("top_p", math.inf, r"top_p must be a finite number in \(0, 1\].*inf"),
    ("n", 2.5, r"n must be an integer >= 1.*2.5"),
    ("max_new_tokens", 8.0, r"max_new_tokens must be an integer >= 1.*8.0"),
    ("top_k", math.nan, r"top_k must be an integer >= 0.*nan"),
    ("top_k", True, r"top_k must be an integer >= 0.*True"),
    ("seed", 1.5, r"seed must be an integer or None.*1.5"),
])
def test_bad_values_are_refused(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**{field: value})


def test_good_values_pass():
    p = SamplingParams(n=np.int64(2), max_new_tokens=4, temperature=0, top_p=1, top_k=0, seed=np.int64(3))
    assert p.n == 2 and p.temperature == 0
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=None)
