"""Argument checks shared by the adapters: numbers given as Python, NumPy or 0-dim tensor
values, each error naming the argument the user typed, what was expected and what came."""

from __future__ import annotations

import math
import numbers

import torch


def _plain(value):
    """A Python number from an int/float, a NumPy scalar or a 0-dim tensor; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex() or value.device.type == "meta":
            return None
        return value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


#: The largest count accepted: counts and sizes are used in float64, exact up to 2**53.
MAX_INT = 2**53


def as_int(name: str, value, *, minimum: int) -> int:
    """``value`` as an int in ``[minimum, 2**53]`` (Python/NumPy integers and 0-dim integer
    tensors; floats are refused, integral or not: a count is an integer)."""
    plain = _plain(value)
    if not isinstance(plain, int) or plain < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if plain > MAX_INT:
        raise ValueError(f"{name} must be an integer <= 2**53 (counts are used in float64), got {value!r}")
    return plain


def as_number(name: str, value, *, positive: bool = True) -> float:
    """``value`` as a finite float, > 0 when ``positive`` else >= 0."""
    plain = _plain(value)
    try:
        plain = None if plain is None else float(plain)
    except OverflowError:  # an int beyond float64
        plain = None
    ok = plain is not None and math.isfinite(plain) and (plain > 0 if positive else plain >= 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(plain)


def as_tensor(name: str, value, *, dims: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type == "meta":
        raise ValueError(f"{name} must hold data (a CPU or CUDA tensor), got a meta tensor")
    if dims is not None and value.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D tensor, got shape {tuple(value.shape)}")
    return value
