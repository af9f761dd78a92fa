"""Numbers of every kind a caller might hand over as a count, a size or a total (Python, NumPy,
0-dim tensors, bools, strings, NaN/inf, huge), and the oracle of what each one stands for.

The property tests of the planner's and the adapters' numeric arguments draw from ``numbers``
and check the verdict against an oracle written in the test: accepted with the float64
formula's value, or refused naming the argument (``refused_naming``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

numbers = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-5, 40),
    st.integers(-3, 40).map(np.int64),
    st.integers(-3, 40).map(np.int32),
    st.floats(-5, 40).map(np.float64),
    st.integers(-3, 40).map(torch.tensor),
    st.floats(-5, 40).map(lambda x: torch.tensor(x, dtype=torch.float64)),
    st.just(torch.tensor([2, 3])),
    st.just(torch.tensor(True)),
    st.text(max_size=4),
    st.just([2]),
)


def int_like(v):
    """The integer a count argument stands for, or None (floats, bools, strings, beyond 2**53... are not counts)."""
    if isinstance(v, bool) or isinstance(v, np.bool_):
        return None
    if isinstance(v, (int, np.integer)):
        n = int(v)
    elif isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point() and v.dtype != torch.bool:
        n = int(v.item())
    else:
        return None
    return n if n <= 2**53 else None


def number_like(v):
    """The finite float a number argument stands for, or None."""
    n = int_like(v)
    if n is not None:
        return float(n)
    if isinstance(v, (float, np.floating)) and not isinstance(v, bool):
        return float(v) if np.isfinite(v) else None
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
        return float(v.item()) if torch.isfinite(v) else None
    return None


def refused_naming(call, *names):
    with pytest.raises((ValueError, TypeError)) as err:
        call()
    assert any(n in str(err.value) for n in names), f"{err.value!r} names none of {names}"
