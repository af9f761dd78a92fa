"""Helpers for the two token layouts (docs/ops.md): packed (THD, ``cu_seqlens``) and padded ``[B, T]``."""

from __future__ import annotations

import torch

from lossagg import ops
from lossagg.validate import (
    check_cu_seqlens,  # noqa: F401  (lossagg/validate.py's, shared with the ops; still importable from here)
    check_holds_data,
)


def cu_seqlens_from_lengths(lengths, *, dtype: torch.dtype = torch.int32, device=None) -> torch.Tensor:
    """``cu_seqlens`` ``[B+1]`` of packed segments with these lengths: ``[0, l0, l0+l1, ...]``."""
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths, device=device)
        lengths = lengths.long() if lengths.numel() == 0 else lengths  # [] reads as float32
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be a 1-D [B] tensor, got shape {tuple(lengths.shape)}")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {int(lengths.min())}")
    cu = torch.zeros(lengths.numel() + 1, dtype=dtype, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def token_counts(mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``M[i]``: tokens of each sample whose mask is non-zero, counted exactly (int64 ``[B]``).

    One native pass over the mask (``torch.ops.lossagg.token_counts``); ``cu_seqlens`` is
    checked as the ops check it.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a tensor, got {type(mask).__name__}")
    try:
        check_holds_data("mask", mask)
        check_holds_data("cu_seqlens", cu_seqlens)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"lossagg.token_counts: {exc}") from None
    if cu_seqlens is None and mask.dim() != 2:
        raise ValueError(f"mask must be [B, T] when cu_seqlens is None (padded layout), got shape {tuple(mask.shape)}")
    if cu_seqlens is not None:
        if mask.dim() != 1:
            raise ValueError(f"mask must be [T] when cu_seqlens is given (packed layout), got shape {tuple(mask.shape)}")
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor [B+1], got {type(cu_seqlens).__name__}")
        cu_seqlens = cu_seqlens.to(mask.device)  # host offsets for a device mask are accepted
    ops.check_readable("token_counts", ("mask", "cu_seqlens"), (mask, cu_seqlens), (ops._mask_layout, ("token_counts", mask, cu_seqlens)))
    try:
        return torch.ops.lossagg.token_counts(mask, cu_seqlens)
    except RuntimeError as exc:
        raise ops.python_error(exc) from None
