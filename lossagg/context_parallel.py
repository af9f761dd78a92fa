"""Context parallel (CP) in the load-balanced "zigzag" layout (docs/composition.md).

Each sequence is padded to a multiple of ``2 cp`` tokens and cut into ``2 cp`` equal
chunks; CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``. Denominators stay global
(from the full rollout masks): a CP rank calls the op on its local tokens with the same
``sample_denoms`` as its peers, and the contributions of all CP ranks sum to the
micro-batch's contribution.
"""

from __future__ import annotations

import torch

from lossagg.validate import check_cu_seqlens


def _check_int(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def zigzag_chunk_sizes(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Chunk size of each sequence: ceil(len / (2 cp)) (sequences padded to a multiple of 2 cp)."""
    _check_int("cp_size", cp_size, 1)
    check_cu_seqlens(cu_seqlens)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return (lengths + 2 * cp_size - 1) // (2 * cp_size)


def zigzag_local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``cu_seqlens`` of a CP rank's local tokens (every rank holds 2 chunks of each sequence)."""
    chunks = zigzag_chunk_sizes(cu_seqlens, cp_size)
    out = torch.zeros(chunks.numel() + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    out[1:] = torch.cumsum(2 * chunks, 0)
    return out


def zigzag_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token position of each local token of ``cp_rank`` (-1 for padding).

    Sequence i is padded to ``2 cp c_i`` tokens and cut into ``2 cp`` chunks of ``c_i``;
    rank r holds chunks r and ``2 cp - 1 - r``.
    """
    _check_int("cp_size", cp_size, 1)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an integer in [0, {cp_size}), got {cp_rank!r}")
    chunks = zigzag_chunk_sizes(cu_seqlens, cp_size)
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    local_lengths = 2 * chunks
    total = int(local_lengths.sum())
    seq = torch.repeat_interleave(torch.arange(chunks.numel(), device=cu_seqlens.device), local_lengths, output_size=total)
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths
    j = torch.arange(total, device=cu_seqlens.device) - local_starts[seq]
    c = chunks[seq]
    within = torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
    return torch.where(within < lengths[seq], starts[seq] + within, torch.full_like(within, -1))


def zigzag_shard(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, pad_value=0) -> torch.Tensor:
    """This CP rank's tokens of a packed tensor (tokens on the last dim), padding filled with ``pad_value``."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"x must be a tensor with tokens on its last dimension, got {type(x).__name__}")
    check_cu_seqlens(cu_seqlens, x.shape[-1])
    pos = zigzag_positions(cu_seqlens, cp_size, cp_rank).to(x.device)
    gathered = x.index_select(-1, pos.clamp(min=0))
    pad = torch.full((), pad_value, dtype=x.dtype, device=x.device)
    return torch.where(pos >= 0, gathered, pad)
