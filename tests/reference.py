"""Float64 pure-PyTorch reference for the native ops, written for clarity (the semantics of docs/ops.md).

It shares no code with the kernels it checks.
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops accumulate and return in for values of ``dtype`` (docs/ops.md, "Dtypes")."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fwd_tol(dtype: torch.dtype) -> dict:
    """The forward's tolerance against this reference: the ops accumulate in float32 from inputs the reference
    reads exactly, so its error is float32 accumulation error whatever the input dtype (float64: exact sums)."""
    return dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)


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


def ref_reduce_terms(values, mask, sample_denoms, sample_weights=None, coefficients=None, cu_seqlens=None):
    """(J, parts) of reduce_terms: J_k = Σ_i w[k, i] S_k[i] / d[k, i], J = Σ_k c_k J_k (float64)."""
    parts = []
    for k, v in enumerate(values):
        sums = ref_segment_sum(v, mask, cu_seqlens)
        w = torch.ones_like(sums) if sample_weights is None else sample_weights[k].to(torch.float64)
        parts.append((w * sums / sample_denoms[k].to(torch.float64)).sum())
    c = [1.0] * len(values) if coefficients is None else coefficients
    total = sum(ck * part for ck, part in zip(c, parts, strict=True))
    return total, torch.stack(parts)


def ref_reduce_terms_grads(mask, sample_denoms, sample_weights=None, coefficients=None, cu_seqlens=None) -> list[torch.Tensor]:
    """d J / d values[k][t] = c_k w[k, i(t)] m[t] / d[k, i(t)] (float64, each of the mask's shape)."""
    m = mask.to(torch.float64).reshape(-1)
    grads = []
    for k in range(sample_denoms.shape[0]):
        c = 1.0 if coefficients is None else coefficients[k]
        g = torch.zeros_like(m)
        for i, (a, b) in enumerate(segments(cu_seqlens, mask.shape)):
            w = 1.0 if sample_weights is None else float(sample_weights[k, i])
            g[a:b] = m[a:b] * c * w / float(sample_denoms[k, i])
        grads.append(g.reshape(mask.shape))
    return grads
