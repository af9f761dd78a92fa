"""Helpers for the two token layouts (docs/ops.md): packed (THD, ``cu_seqlens``) and padded ``[B, T]``."""

from __future__ import annotations

import torch

from lossagg.ops import token_counts  # noqa: F401  (the op's wrapper, lossagg/ops.py; still importable from here)
from lossagg.validate import check_cu_seqlens  # noqa: F401  (lossagg/validate.py's, shared with the ops; still importable from here)


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
