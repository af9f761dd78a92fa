"""The dtypes the native ops read: the one list of the Python side.

csrc/dtypes.h is the C++ side's one list; tests/test_supported_dtypes.py checks that the two
agree. The fake kernels (:mod:`lossagg.ops`) and the adapters check their arguments against
these tuples, and every message about a values dtype is worded by :func:`values_dtype_error`.
A leaf: it imports torch and nothing of lossagg.
"""

from __future__ import annotations

import torch

#: Values (and the incoming gradients of the backward ops): the four floating dtypes the kernels are built for.
VALUE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Masks: bool, uint8 and the signed integer dtypes, and the floating ones (a weight).
MASK_DTYPES: tuple[torch.dtype, ...] = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, *VALUE_DTYPES)


def _names(dtypes) -> list[str]:
    return [str(d).removeprefix("torch.") for d in dtypes]


#: "float32, bfloat16, float16 or float64": the values dtypes as the messages list them (and as csrc/dtypes.h words them).
VALUE_DTYPES_TEXT = ", ".join(_names(VALUE_DTYPES)[:-1]) + " or " + _names(VALUE_DTYPES)[-1]


def values_dtype_error(name: str, dtype: torch.dtype, what: str | None = None) -> str:
    """The message for a ``name`` tensor of ``dtype`` that is not one of :data:`VALUE_DTYPES`.

    ``what`` says what the tensor must be, for an argument named as the caller names it
    (verl's ``loss_mat``: "a floating tensor"); without it, as the ops word it.
    """
    if what is None:
        return f"{name} must have dtype {VALUE_DTYPES_TEXT}, got {dtype}"
    return f"{name} must be {what} ({VALUE_DTYPES_TEXT}), got dtype {dtype}"
