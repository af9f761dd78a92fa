"""Python surface of the native ops: wrappers and fake kernels.

Layouts (see docs/ops.md):

* packed (THD): ``values`` is ``[T]`` (or ``[K, T]`` for :func:`segment_sum`), ``mask``
  is ``[T]``, ``cu_seqlens`` is ``[B+1]`` int32/int64 and segment ``i`` is
  ``cu_seqlens[i]:cu_seqlens[i+1]``;
* padded: ``cu_seqlens`` is None, ``values`` is ``[B, T]`` (or ``[K, B, T]``), each row a
  segment.

A token whose mask is 0 contributes exactly 0 (selected away, so a NaN loss there does
not leak). Accumulation is float32 (float64 for float64 values).
"""

from __future__ import annotations

import warnings

import torch

from lossagg import _native  # noqa: F401  (registers torch.ops.lossagg)

__all__ = ["segment_sum", "reduce"]


def segment_sum(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-segment masked sums: ``out[k, i] = sum_{t in segment i} m[t] * values[k, t]``.

    Returns ``[B]`` (or ``[K, B]`` for ``[K, T]`` / ``[K, B, T]`` values), float32
    (float64 for float64 values). Differentiable in ``values``.
    """
    return torch.ops.lossagg.segment_sum(values, mask, cu_seqlens)


def reduce(
    values: torch.Tensor,
    mask: torch.Tensor,
    *legacy: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    sample_denoms: torch.Tensor | None = None,
) -> torch.Tensor:
    """The aggregated loss ``J = sum_i (sum_{t in i} m[t] * values[t]) / sample_denoms[i]``.

    ``sample_denoms`` is ``[B]``, floating, finite and > 0 (the global per-sample
    denominators ``d[i]`` of the chosen mode). Returns a 0-dim float32 tensor (float64 for
    float64 values), differentiable in ``values``; the gradient is
    ``grad * m[t] / sample_denoms[i(t)]`` in ``values.dtype``.

    ``cu_seqlens`` and ``sample_denoms`` are keyword arguments (the op's schema order is
    ``values, mask, cu_seqlens, sample_denoms``). The old positional form
    ``reduce(values, mask, sample_denoms, cu_seqlens)`` still works, with a DeprecationWarning.
    """
    if legacy:
        if len(legacy) > 2 or sample_denoms is not None or (len(legacy) == 2 and cu_seqlens is not None):
            raise TypeError("lossagg.reduce(values, mask, *, cu_seqlens=None, sample_denoms): pass cu_seqlens and sample_denoms by keyword")
        warnings.warn(
            "lossagg.reduce(values, mask, sample_denoms, cu_seqlens) is deprecated: pass sample_denoms= and cu_seqlens= by keyword",
            DeprecationWarning,
            stacklevel=2,
        )
        sample_denoms = legacy[0]
        cu_seqlens = legacy[1] if len(legacy) == 2 else cu_seqlens
    if sample_denoms is None:
        raise TypeError("lossagg.reduce: missing the keyword argument sample_denoms (the [B] per-sample denominators d[i])")
    return torch.ops.lossagg.reduce(values, mask, cu_seqlens, sample_denoms)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _num_segments(values_token_shape, cu_seqlens):
    if cu_seqlens is not None:
        torch._check(cu_seqlens.dim() == 1, lambda: "cu_seqlens must be a 1-D [B+1] tensor")
        return cu_seqlens.shape[0] - 1
    return values_token_shape[0]


@torch.library.register_fake("lossagg::segment_sum")
def _segment_sum_fake(values, mask, cu_seqlens):
    token_dims = 1 if cu_seqlens is not None else 2
    torch._check(
        values.dim() in (token_dims, token_dims + 1),
        lambda: f"lossagg.segment_sum: values has an unexpected shape {tuple(values.shape)}",
    )
    has_k = values.dim() == token_dims + 1
    b = _num_segments(values.shape[1:] if has_k else values.shape, cu_seqlens)
    shape = (values.shape[0], b) if has_k else (b,)
    return values.new_empty(shape, dtype=_acc_dtype(values.dtype))


@torch.library.register_fake("lossagg::segment_sum_backward")
def _segment_sum_backward_fake(grad, mask, cu_seqlens, values_dtype):
    shape = (grad.shape[0], *mask.shape) if grad.dim() == 2 else tuple(mask.shape)
    return mask.new_empty(shape, dtype=values_dtype)


@torch.library.register_fake("lossagg::reduce")
def _reduce_fake(values, mask, cu_seqlens, sample_denoms):
    return values.new_empty((), dtype=_acc_dtype(values.dtype))


@torch.library.register_fake("lossagg::reduce_backward")
def _reduce_backward_fake(grad, mask, cu_seqlens, sample_denoms, values_dtype):
    return mask.new_empty(mask.shape, dtype=values_dtype)


# Autograd of reduce and segment_sum is registered in C++ (csrc/autograd.cpp) under the
# Autograd key, so libtorch users get it too and a step pays no Python round trip; the
# backward ops it calls have the fake kernels above.
