"""The supported dtypes are listed once per language (csrc/dtypes.h, lossagg/dtypes.py), and
the two lists agree; the ops accept exactly what they list."""

from __future__ import annotations

import ctypes

import pytest
import torch

import lossagg
from lossagg import _native
from lossagg.dtypes import MASK_DTYPES, VALUE_DTYPES

ALL_DTYPES = [
    getattr(torch, name) for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "complex64")
]


def _native_list(entry: str) -> tuple[torch.dtype, ...]:
    fn = getattr(ctypes.CDLL(_native.LIBRARY_PATH), entry)
    fn.restype = ctypes.c_char_p
    return tuple(getattr(torch, name) for name in fn().decode().split(","))


@pytest.mark.parametrize(("entry", "python_list"), [("lossagg_value_dtypes", VALUE_DTYPES), ("lossagg_mask_dtypes", MASK_DTYPES)])
def test_the_cpp_and_python_lists_agree(entry, python_list):
    assert set(_native_list(entry)) == set(python_list), (entry, _native_list(entry), python_list)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_values_are_accepted_exactly_when_listed(dtype):
    values = torch.ones(4).to(dtype)
    mask, cu, d = torch.ones(4, dtype=torch.bool), torch.tensor([0, 4]), torch.tensor([2.0])
    if dtype in VALUE_DTYPES:
        assert lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d).item() == 2.0
    else:
        with pytest.raises(TypeError, match="values must have dtype float32, bfloat16, float16 or float64"):
            lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_masks_are_accepted_exactly_when_listed(dtype):
    mask = torch.ones(4).to(dtype)
    values, cu, d = torch.ones(4), torch.tensor([0, 4]), torch.tensor([2.0])
    if dtype in MASK_DTYPES:
        assert lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d).item() == 2.0
    else:
        with pytest.raises(TypeError, match="mask must have dtype bool, an integer dtype"):
            lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d)
