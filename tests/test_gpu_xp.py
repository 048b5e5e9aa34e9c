"""gpu_engine.xp helpers whose numpy fast path (a short array read from its host list) must
agree with the general path (array operations) and with a plain-Python statement of the rule."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_engine import xp

BACKENDS = [lambda v: np.asarray(v, dtype=np.int64), lambda v: torch.as_tensor(np.asarray(v, dtype=np.int64))]


@pytest.mark.parametrize("arr", BACKENDS)
@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.integers(-3, 5), max_size=2 * xp.SCAN + 5))  # both sides of the SCAN cut
def test_nonzero_items_are_the_nonzero_entries_in_index_order(arr, values):
    idx, vals = xp.nonzero_items(arr(values))
    assert idx == [i for i, v in enumerate(values) if v != 0]
    assert vals == [v for v in values if v != 0]
    assert all(type(i) is int for i in idx + vals)  # (logged as JSON: Python ints, not numpy scalars)
