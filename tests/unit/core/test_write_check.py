"""The check that refuses a Batch written between a call and its send (``_WriteCheck``), on object columns: what
counts as a change. An object column is compared by its elements' identity, and by a pickle of the elements that can
change in place, instead of a pickle of the whole column at the call and again at the send."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestra import Batch
from orchestra._invocation import _changed, _mark


def batch() -> Batch:
    return Batch.from_dict({"x": torch.arange(4), "s": ["a", "b", "c", "d"], "d": [{"i": i} for i in range(4)],
                            "m": ["a", 1, 0.0, {"k": [1]}]})


def write(b: Batch, how: str) -> None:
    if how == "string replaced":
        b["s"][2] = "z"
    elif how == "dict written in place":
        b["d"][1]["i"] = 100
    elif how == "nested list appended":
        b["m"][3]["k"].append(2)
    elif how == "zero made negative":
        b["m"][2] = -0.0
    elif how == "int made bool":
        b["m"][1] = True
    elif how == "string made dict":
        b["s"][0] = {"a": 1}
    elif how == "reshaped in place":
        b.non_tensors["s"].shape = (2, 2)
    elif how == "dict replaced by a different one":
        b["d"][0] = {"i": -1}


@pytest.mark.parametrize("how", ["string replaced", "dict written in place", "nested list appended",
                                 "zero made negative", "int made bool", "string made dict", "reshaped in place",
                                 "dict replaced by a different one"])
def test_a_write_into_an_object_column_is_a_change(how):
    b = batch()
    mark = _mark(b)
    write(b, how)
    assert _changed(b, mark) is not None and "changed" in _changed(b, mark)


def test_equal_values_put_back_are_not_a_change():
    b = batch()
    mark = _mark(b)
    b["s"][0] = "".join(["a"])  # an equal string, another object
    b["d"][2] = {"i": 2}  # an equal dict, another object
    b["m"][1] = int("1")
    assert _changed(b, mark) is None


def test_an_unpicklable_element_is_compared_by_identity():
    import threading

    lock = threading.Lock()
    b = Batch.from_dict({"x": torch.arange(2), "o": np.array([lock, "a"], dtype=object)})
    mark = _mark(b)
    assert _changed(b, mark) is None
    b["o"][0] = threading.Lock()
    assert _changed(b, mark) == "column 'o' changed"
