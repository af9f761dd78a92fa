"""Float64 pure-PyTorch reference for the native ops, written for clarity (the semantics of docs/ops.md).

It shares no code with the kernels it checks.
"""

from __future__ import annotations

import torch


def segments(cu_seqlens: torch.Tensor | None, token_shape) -> list[tuple[int, int]]:
    """(begin, end) of each segment in the flattened token index space."""
    if cu_seqlens is None:
        b, t = token_shape
        return [(i * t, (i + 1) * t) for i in range(b)]
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def masked_contributions(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """m[t] * l[t] in float64, exactly 0 where the mask is 0 (whatever the loss there)."""
    w = mask.to(torch.float64)
    return torch.where(w != 0, values.to(torch.float64) * w, torch.zeros((), dtype=torch.float64))


def ref_segment_sum(values, mask, cu_seqlens=None) -> torch.Tensor:
    token_dims = 1 if cu_seqlens is not None else 2
    has_k = values.dim() == token_dims + 1
    vals = values if has_k else values.unsqueeze(0)
    out = []
    for k in range(vals.shape[0]):
        contrib = masked_contributions(vals[k], mask).reshape(-1)
        out.append(
            torch.stack([contrib[a:b].sum() for a, b in segments(cu_seqlens, mask.shape)])
            if len(segments(cu_seqlens, mask.shape))
            else torch.zeros(0, dtype=torch.float64)
        )
    result = torch.stack(out)
    return result if has_k else result[0]


def ref_reduce(values, mask, sample_denoms, cu_seqlens=None) -> torch.Tensor:
    sums = ref_segment_sum(values, mask, cu_seqlens)
    return (sums / sample_denoms.to(torch.float64)).sum()


def ref_reduce_grad(mask, sample_denoms, cu_seqlens=None) -> torch.Tensor:
    """d J / d values[t] = m[t] / d[i(t)] (float64, shape of mask)."""
    w = mask.to(torch.float64).reshape(-1)
    grad = torch.zeros_like(w)
    for i, (a, b) in enumerate(segments(cu_seqlens, mask.shape)):
        grad[a:b] = w[a:b] / float(sample_denoms[i])
    return grad.reshape(mask.shape)
