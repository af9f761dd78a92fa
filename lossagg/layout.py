"""Helpers for the two token layouts (docs/ops.md): packed (THD, ``cu_seqlens``) and padded ``[B, T]``."""

from __future__ import annotations

import torch


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


def check_cu_seqlens(cu_seqlens, num_tokens: int | None = None, *, name: str = "cu_seqlens") -> torch.Tensor:
    """``cu_seqlens`` validated for the Python helpers: a 1-D integer tensor starting at 0,
    non-decreasing, ending at ``num_tokens`` when given. Reads the data (a host sync on CUDA)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor [B+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D [B+1] tensor with at least one element, got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu_seqlens[0])}")
    steps = cu_seqlens[1:] - cu_seqlens[:-1]
    if steps.numel() and int(steps.min()) < 0:
        i = int(torch.nonzero(steps < 0)[0, 0]) + 1
        raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {int(cu_seqlens[i])} < {name}[{i - 1}] = {int(cu_seqlens[i - 1])}")
    if num_tokens is not None and int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(f"{name}[-1] must equal the number of tokens T = {num_tokens}, got {int(cu_seqlens[-1])}")
    return cu_seqlens


def token_counts(mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``M[i]``: tokens of each sample whose mask is non-zero, counted exactly (int64 ``[B]``).

    One native pass over the mask (``torch.ops.lossagg.token_counts``); ``cu_seqlens`` is
    checked as the ops check it.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a tensor, got {type(mask).__name__}")
    if cu_seqlens is None and mask.dim() != 2:
        raise ValueError(f"mask must be [B, T] when cu_seqlens is None (padded layout), got shape {tuple(mask.shape)}")
    if cu_seqlens is not None:
        if mask.dim() != 1:
            raise ValueError(f"mask must be [T] when cu_seqlens is given (packed layout), got shape {tuple(mask.shape)}")
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor [B+1], got {type(cu_seqlens).__name__}")
        cu_seqlens = cu_seqlens.to(mask.device)  # host offsets for a device mask are accepted
    from lossagg import ops  # the fake and the non-CPU kernels

    ops.check_readable("token_counts", ("mask", "cu_seqlens"), (mask, cu_seqlens), (ops._mask_layout, ("token_counts", mask, cu_seqlens)))
    try:
        return torch.ops.lossagg.token_counts(mask, cu_seqlens)
    except RuntimeError as exc:
        raise ops.python_error(exc) from None
