"""Python surface of the native ops: op glue only, one section per op (its wrapper, fake kernel,
composite for devices without a native kernel, and autograd, together).

Layouts (see docs/ops.md):

* packed (THD): ``values`` is ``[T]`` (or ``[K, T]`` for :func:`segment_sum`), ``mask``
  is ``[T]``, ``cu_seqlens`` is ``[B+1]`` int32/int64 and segment ``i`` is
  ``cu_seqlens[i]:cu_seqlens[i+1]``;
* padded: ``cu_seqlens`` is None, ``values`` is ``[B, T]`` (or ``[K, B, T]``), each row a
  segment.

A token whose mask is 0 contributes exactly 0 (selected away, so a NaN loss there does
not leak). Accumulation is float32 (float64 for float64 values).

The fakes (meta tensors, torch.compile) check what the native kernels check without reading
data: dtypes, shapes, devices, with the same messages; so a mistake is named at trace time
instead of surfacing as a backend failure or an uninitialised result. The dtypes they accept
are lossagg/dtypes.py's (the one list of the Python side).

Autograd is registered here over the backward ops (the native library holds kernels only: the
LibTorch stable ABI has no C++ autograd). Each forward op's backward is a registered op with
its own kernels and fake, and each backward op is linear in its incoming gradient, so its own
backward is the forward op again: reduce <-> reduce_backward and segment_sum <->
segment_sum_backward make double backward exact. The ops are differentiable in values (and the
backward ops in grad) only; a gradient asked of the mask or the denominators is refused, never
silently left at None. The wrappers call the kernels below the autograd key through their own
``autograd.Function`` (the registered autograd, for direct callers of ``torch.ops.lossagg.*``
and for double backward, would add a second Python layer to every call).

Adding an op: docs/adding_an_op.md.
"""

from __future__ import annotations

import torch

from lossagg import _native  # noqa: F401  (registers torch.ops.lossagg)
from lossagg.denom_program import evaluate as evaluate_program
from lossagg.dtypes import MASK_DTYPES, VALUE_DTYPES, values_dtype_error
from lossagg.validate import check_cu_seqlens, check_holds_data, plain_number

__all__ = ["segment_sum", "reduce", "reduce_terms", "token_counts"]

_REDUCE = torch.ops.lossagg.reduce.default
_REDUCE_BACKWARD = torch.ops.lossagg.reduce_backward.default
_REDUCE_TERMS = torch.ops.lossagg.reduce_terms.default
_REDUCE_TERMS_BACKWARD = torch.ops.lossagg.reduce_terms_backward.default
_SEGMENT_SUM = torch.ops.lossagg.segment_sum.default
_SEGMENT_SUM_BACKWARD = torch.ops.lossagg.segment_sum_backward.default
_SEGMENT_SUM_AND_COUNT = torch.ops.lossagg.segment_sum_and_count.default
_AGGREGATE = torch.ops.lossagg.aggregate.default
_AGGREGATE_PLANNED = torch.ops.lossagg.aggregate_planned.default
_TOKEN_COUNTS = torch.ops.lossagg.token_counts.default
#: The native aggregate op's error for a d[i] that is not finite and > 0 starts with this (csrc/denom_program.h).
DENOMS_NOT_POSITIVE = "lossagg.aggregate: a denominator is not finite and > 0"
#: The native aggregate_planned op's error for a step the plan declines starts with this (csrc/cpu/plan_totals.h).
PLAN_DECLINES = "lossagg.aggregate_planned: the plan declines the step"
# the dispatcher below the autograd key: the kernels themselves, for calls whose autograd
# the wrappers handle (or that need none)
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd

# ------------------------------------------------- errors and the checks every op shares
_KINDS = {"TypeError: ": TypeError, "ValueError: ": ValueError}


def python_error(exc: RuntimeError) -> Exception:
    """The Python exception for an error of the native ops.

    The stable ABI hands every C++ exception to Python as RuntimeError; the native checks
    start their messages with the Python exception they mean (csrc/torch_api.h), so the
    wrappers raise that exception with the message itself, as before the port. Any other
    RuntimeError is returned unchanged.
    """
    text = str(exc)
    for prefix, kind in _KINDS.items():
        if text.startswith(prefix):
            return kind(text[len(prefix) :])
    return exc


def check_readable(op: str, names: tuple[str, ...], tensors: tuple, validate=None, saved_for_backward: bool = False) -> None:
    """Each tensor argument is one the native kernels read where it lies: dense (strided), and
    not an expanded view. An expanded view (a stride of 0 over more than one element) would
    be copied in full before the kernels run: ``torch.ops.lossagg.reduce`` of
    ``torch.ones(()).expand(2**31)`` is 4 bytes of data and an 8 GiB copy. Refused by name,
    so the user decides (``.contiguous()`` makes the copy explicit); ``validate``
    (``(function, args)``: the op's own shape and dtype checks) runs first so that their
    messages win. None is skipped (the optional ``cu_seqlens``). With
    ``saved_for_backward`` (values require grad), a tensor made under
    ``torch.inference_mode()`` is refused by name: autograd cannot save it for the backward.
    Costs a few attribute reads per tensor on the usual (contiguous) path, which every call
    pays. Skipped while torch.compile traces (the fake kernels check what a trace can see).
    """
    if torch.compiler.is_compiling() or _readable(tensors, saved_for_backward):
        return
    for name, t in zip(names, tensors, strict=True):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            _fail(TypeError, op, f"{name} must be a dense (strided) tensor, got layout {t.layout}: pass {name}.to_dense()")
        if saved_for_backward and t.is_inference():
            _fail(
                ValueError,
                op,
                f"{name} was made under torch.inference_mode(), so autograd cannot save it for the backward of values (which require grad): "
                f"make it under torch.no_grad() instead, or pass {name}.clone()",
            )
        if t.is_contiguous() or t.device.type == "meta":  # a meta tensor has no data to copy
            continue
        for dim, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
            if stride == 0 and size > 1:
                if validate is not None:
                    validate[0](*validate[1])
                size_bytes = t.numel() * t.element_size()
                copy = (
                    f"{size_bytes / 2**30:.1f} GiB"
                    if size_bytes >= 2**30
                    else f"{size_bytes / 2**20:.1f} MiB"
                    if size_bytes >= 2**20
                    else f"{size_bytes} bytes"
                )
                _fail(
                    ValueError,
                    op,
                    f"{name} is an expanded view (stride 0 along dim {dim} of size {size}): the kernels read every element from memory, "
                    f"so it would first be copied in full ({t.numel()} elements, {copy}); pass {name}.contiguous() if that copy is meant",
                )


def _readable(tensors: tuple, saved_for_backward: bool) -> bool:
    """The fast path of :func:`check_readable`: every tensor (None skipped) dense, contiguous and,
    when saved for the backward, not made under inference mode."""
    for t in tensors:
        if t is not None and not (
            isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.is_contiguous() and not (saved_for_backward and t.is_inference())
        ):
            return False
    return True


_STRIDED = torch.strided
_REDUCE_ARGS = ("values", "mask", "cu_seqlens", "sample_denoms")
_SEGMENT_SUM_ARGS = ("values", "mask", "cu_seqlens")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fail(kind, op: str, message: str):
    raise kind(f"lossagg.{op}: {message}")


def _check_device(op, name, t, like, like_name):
    if t.device != like.device:
        _fail(ValueError, op, f"{name} must be on the same device as {like_name} ({like.device}), got {t.device}")


def _check_cu_seqlens(op, cu_seqlens, like):
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        _fail(TypeError, op, f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        _fail(ValueError, op, f"cu_seqlens must be a 1-D [B+1] tensor with at least one element, got shape {tuple(cu_seqlens.shape)}")
    _check_device(op, "cu_seqlens", cu_seqlens, like, "the token tensors")


def _check_mask_dtype(op, mask):
    if mask.dtype not in MASK_DTYPES:
        _fail(TypeError, op, f"mask must have dtype bool, an integer dtype (uint8, int8/16/32/64) or a floating dtype, got {mask.dtype}")


def _token_layout(op, values, mask, cu_seqlens, allow_metric_dim):
    """(B, has_metric_dim) of a forward call, checked."""
    if values.dtype not in VALUE_DTYPES:
        _fail(TypeError, op, values_dtype_error("values", values.dtype))
    _check_mask_dtype(op, mask)
    _check_device(op, "mask", mask, values, "values")
    token_dims = 1 if cu_seqlens is not None else 2
    if values.dim() != token_dims and not (allow_metric_dim and values.dim() == token_dims + 1):
        layout = "packed (cu_seqlens given): [T] or [K, T]" if cu_seqlens is not None else "padded (cu_seqlens None): [B, T] or [K, B, T]"
        _fail(ValueError, op, f"values has shape {list(values.shape)}, which does not fit the {layout} layout")
    has_k = values.dim() == token_dims + 1
    token_shape = tuple(values.shape[1:] if has_k else values.shape)
    if tuple(mask.shape) != token_shape:
        _fail(ValueError, op, f"mask must have the token shape of values {list(token_shape)}, got shape {list(mask.shape)}")
    if cu_seqlens is not None:
        _check_cu_seqlens(op, cu_seqlens, values)
        return cu_seqlens.shape[0] - 1, has_k
    return token_shape[0], has_k


def _mask_layout(op, mask, cu_seqlens):
    """B of a backward call, checked."""
    _check_mask_dtype(op, mask)
    if cu_seqlens is not None:
        if mask.dim() != 1:
            _fail(ValueError, op, f"mask must be [T] when cu_seqlens is given (packed layout), got shape {list(mask.shape)}")
        _check_cu_seqlens(op, cu_seqlens, mask)
        return cu_seqlens.shape[0] - 1
    if mask.dim() != 2:
        _fail(ValueError, op, f"mask must be [B, T] when cu_seqlens is None (padded layout), got shape {list(mask.shape)}")
    return mask.shape[0]


def _check_sample_denoms(op, sample_denoms, num_segments, like):
    if not sample_denoms.dtype.is_floating_point:
        _fail(TypeError, op, f"sample_denoms must have a floating dtype, got {sample_denoms.dtype}")
    if sample_denoms.dim() != 1 or sample_denoms.shape[0] != num_segments:
        _fail(
            ValueError,
            op,
            f"sample_denoms must be a 1-D tensor of length B = {num_segments} (one denominator per sample), got shape {list(sample_denoms.shape)}",
        )
    _check_device(op, "sample_denoms", sample_denoms, like, "the token tensors")


def _check_values_dtype_argument(op, values_dtype):
    """The dtype a backward op writes its gradient in: a value dtype, named as the op's argument."""
    if values_dtype not in VALUE_DTYPES:
        _fail(TypeError, op, values_dtype_error("values_dtype (the gradient's dtype, that of the values)", values_dtype))


def _not_differentiable(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            _fail(ValueError, op, f"not differentiable in {name}, which requires grad; pass {name}.detach() (the gradient flows to values only)")


# --------------------------------------------------------------------------- segment_sum
def segment_sum(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-segment masked sums: ``out[k, i] = sum_{t in segment i} m[t] * values[k, t]``.

    Returns ``[B]`` (or ``[K, B]`` for ``[K, T]`` / ``[K, B, T]`` values), float32
    (float64 for float64 values). Differentiable in ``values``.
    """
    grad_mode = torch.is_grad_enabled()
    needs_grad = grad_mode and isinstance(values, torch.Tensor) and values.requires_grad
    check_readable(
        "segment_sum", _SEGMENT_SUM_ARGS, (values, mask, cu_seqlens), (_token_layout, ("segment_sum", values, mask, cu_seqlens, True)), needs_grad
    )
    try:
        if torch.compiler.is_compiling():
            return torch.ops.lossagg.segment_sum(values, mask, cu_seqlens)
        if grad_mode and getattr(mask, "requires_grad", False):
            _not_differentiable("segment_sum", mask=mask)
        if needs_grad:
            return _SegmentSum.apply(values, mask, cu_seqlens)
        with _BELOW_AUTOGRAD():
            return _SEGMENT_SUM(values, mask, cu_seqlens)
    except RuntimeError as exc:
        raise python_error(exc) from None


@torch.library.register_fake("lossagg::segment_sum")
def _segment_sum_fake(values, mask, cu_seqlens):
    b, has_k = _token_layout("segment_sum", values, mask, cu_seqlens, allow_metric_dim=True)
    shape = (values.shape[0], b) if has_k else (b,)
    return values.new_empty(shape, dtype=_acc_dtype(values.dtype))


def _setup_segment_sum(ctx, inputs, output):
    values, mask, cu_seqlens = inputs
    _not_differentiable("segment_sum", mask=mask)
    ctx.save_for_backward(mask, cu_seqlens)
    ctx.values_dtype = values.dtype


def _segment_sum_grad(ctx, grad):
    mask, cu_seqlens = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None
    if grad.requires_grad:
        return torch.ops.lossagg.segment_sum_backward(grad.contiguous(), mask, cu_seqlens, ctx.values_dtype), None, None
    with _BELOW_AUTOGRAD():
        return _SEGMENT_SUM_BACKWARD(grad.contiguous(), mask, cu_seqlens, ctx.values_dtype), None, None


class _SegmentSum(torch.autograd.Function):
    """segment_sum with its backward, as the wrapper :func:`segment_sum` calls it (see _Reduce)."""

    @staticmethod
    def forward(ctx, values, mask, cu_seqlens):
        with _BELOW_AUTOGRAD():
            out = _SEGMENT_SUM(values, mask, cu_seqlens)
        ctx.save_for_backward(mask, cu_seqlens)
        ctx.values_dtype = values.dtype
        return out

    backward = staticmethod(_segment_sum_grad)


torch.library.register_autograd("lossagg::segment_sum", _segment_sum_grad, setup_context=_setup_segment_sum)


# ------------------------------------------------------------------ segment_sum_backward
@torch.library.register_fake("lossagg::segment_sum_backward")
def _segment_sum_backward_fake(grad, mask, cu_seqlens, values_dtype):
    op = "segment_sum_backward"
    _check_values_dtype_argument(op, values_dtype)
    if grad.dim() not in (1, 2):
        _fail(ValueError, op, f"grad must be [B] or [K, B], got shape {list(grad.shape)}")
    b = _mask_layout(op, mask, cu_seqlens)
    if grad.shape[-1] != b:
        _fail(ValueError, op, f"grad must have B = {b} entries in its last dimension, got shape {list(grad.shape)}")
    _check_device(op, "grad", grad, mask, "mask")
    shape = (grad.shape[0], *mask.shape) if grad.dim() == 2 else tuple(mask.shape)
    return mask.new_empty(shape, dtype=values_dtype)


def _setup_segment_sum_backward(ctx, inputs, output):
    grad, mask, cu_seqlens, _ = inputs
    _not_differentiable("segment_sum_backward", mask=mask)
    ctx.save_for_backward(mask, cu_seqlens)
    ctx.grad_dtype = grad.dtype


def _segment_sum_backward_grad(ctx, upstream):
    # segment_sum_backward broadcasts grad [K, B] to the tokens: its derivative is segment_sum(upstream)
    mask, cu_seqlens = ctx.saved_tensors
    g = torch.ops.lossagg.segment_sum(upstream.contiguous(), mask, cu_seqlens).to(ctx.grad_dtype) if ctx.needs_input_grad[0] else None
    return g, None, None, None


torch.library.register_autograd("lossagg::segment_sum_backward", _segment_sum_backward_grad, setup_context=_setup_segment_sum_backward)


# -------------------------------------------------------------------------------- reduce
def reduce(
    values: torch.Tensor,
    mask: torch.Tensor,
    *positional,
    cu_seqlens: torch.Tensor | None = None,
    sample_denoms: torch.Tensor | None = None,
) -> torch.Tensor:
    """The aggregated loss ``J = sum_i (sum_{t in i} m[t] * values[t]) / sample_denoms[i]``.

    ``sample_denoms`` is ``[B]``, floating, finite and > 0 (the global per-sample
    denominators ``d[i]`` of the chosen mode). Returns a 0-dim float32 tensor (float64 for
    float64 values), differentiable in ``values``; the gradient is
    ``grad * m[t] / sample_denoms[i(t)]`` in ``values.dtype``.

    ``cu_seqlens`` and ``sample_denoms`` are keyword-only (the op itself,
    ``torch.ops.lossagg.reduce``, takes ``values, mask, cu_seqlens, sample_denoms``).
    """
    if positional:
        raise TypeError(
            f"lossagg.reduce(values, mask, *, cu_seqlens=None, sample_denoms) takes 2 positional arguments, got {2 + len(positional)}: "
            "pass cu_seqlens= and sample_denoms= by keyword"
        )
    if sample_denoms is None:
        raise TypeError("lossagg.reduce: missing the keyword argument sample_denoms (the [B] per-sample denominators d[i])")
    grad_mode = torch.is_grad_enabled()
    needs_grad = grad_mode and isinstance(values, torch.Tensor) and values.requires_grad
    check_readable(
        "reduce", _REDUCE_ARGS, (values, mask, cu_seqlens, sample_denoms), (_reduce_fake, (values, mask, cu_seqlens, sample_denoms)), needs_grad
    )
    try:
        if torch.compiler.is_compiling():
            return torch.ops.lossagg.reduce(values, mask, cu_seqlens, sample_denoms)
        if grad_mode and (getattr(mask, "requires_grad", False) or getattr(sample_denoms, "requires_grad", False)):
            _not_differentiable("reduce", mask=mask, sample_denoms=sample_denoms)
        if needs_grad:
            return _Reduce.apply(values, mask, cu_seqlens, sample_denoms)
        with _BELOW_AUTOGRAD():
            return _REDUCE(values, mask, cu_seqlens, sample_denoms)
    except RuntimeError as exc:
        raise python_error(exc) from None


def check_division_denoms(d: torch.Tensor, values_dtype: torch.dtype) -> None:
    """``d`` as the kernels divide by it: in the accumulation dtype of ``values_dtype``, finite and > 0.
    The one check of every route (plan-then-reduce, the one-pass routes, the CUDA composite): a
    ``d[i]`` that is not is refused by reduce's own check, with its message (B values). On an
    accelerator it runs when reduce's data checks do (``lossagg.set_device_checks``): it needs a host sync."""
    if d.device.type != "cpu" and not _native.device_checks_enabled():
        return
    acc = _acc_dtype(values_dtype)
    dc = d.to(acc)
    if d.numel() and not bool((torch.isfinite(dc) & (dc > 0)).all()):
        ones = torch.ones((d.shape[0], 1), dtype=torch.bool, device=d.device)
        try:
            with _BELOW_AUTOGRAD():
                _REDUCE(torch.zeros((d.shape[0], 1), dtype=values_dtype, device=d.device), ones, None, d.detach())
        except RuntimeError as exc:
            raise python_error(exc) from None


@torch.library.register_fake("lossagg::reduce")
def _reduce_fake(values, mask, cu_seqlens, sample_denoms):
    b, _ = _token_layout("reduce", values, mask, cu_seqlens, allow_metric_dim=False)
    _check_sample_denoms("reduce", sample_denoms, b, values)
    return values.new_empty((), dtype=_acc_dtype(values.dtype))


def _setup_reduce(ctx, inputs, output):
    values, mask, cu_seqlens, sample_denoms = inputs
    _not_differentiable("reduce", mask=mask, sample_denoms=sample_denoms)
    ctx.save_for_backward(mask, cu_seqlens, sample_denoms)
    ctx.values_dtype = values.dtype


def _reduce_grad(ctx, grad):
    mask, cu_seqlens, sample_denoms = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None
    if grad.requires_grad:  # create_graph: the backward op's own autograd records it
        return torch.ops.lossagg.reduce_backward(grad, mask, cu_seqlens, sample_denoms, ctx.values_dtype), None, None, None
    with _BELOW_AUTOGRAD():
        return _REDUCE_BACKWARD(grad, mask, cu_seqlens, sample_denoms, ctx.values_dtype), None, None, None


class _Reduce(torch.autograd.Function):
    """reduce with its backward, as the wrapper :func:`reduce` calls it: the op runs below
    the autograd key (its registered autograd, for direct callers of torch.ops.lossagg.reduce
    and for double backward, would add a second Python layer to every call)."""

    @staticmethod
    def forward(ctx, values, mask, cu_seqlens, sample_denoms):
        with _BELOW_AUTOGRAD():
            out = _REDUCE(values, mask, cu_seqlens, sample_denoms)
        ctx.save_for_backward(mask, cu_seqlens, sample_denoms)
        ctx.values_dtype = values.dtype
        return out

    backward = staticmethod(_reduce_grad)


torch.library.register_autograd("lossagg::reduce", _reduce_grad, setup_context=_setup_reduce)


# ----------------------------------------------------------------------- reduce_backward
@torch.library.register_fake("lossagg::reduce_backward")
def _reduce_backward_fake(grad, mask, cu_seqlens, sample_denoms, values_dtype):
    op = "reduce_backward"
    _check_values_dtype_argument(op, values_dtype)
    if grad.dim() != 0:
        _fail(ValueError, op, f"grad must be a 0-dim tensor, got shape {list(grad.shape)}")
    b = _mask_layout(op, mask, cu_seqlens)
    _check_sample_denoms(op, sample_denoms, b, mask)
    _check_device(op, "grad", grad, mask, "mask")
    return mask.new_empty(mask.shape, dtype=values_dtype)


def _setup_reduce_backward(ctx, inputs, output):
    grad, mask, cu_seqlens, sample_denoms, _ = inputs
    _not_differentiable("reduce_backward", mask=mask, sample_denoms=sample_denoms)
    ctx.save_for_backward(mask, cu_seqlens, sample_denoms)
    ctx.grad_dtype = grad.dtype


def _reduce_backward_grad(ctx, upstream):
    # reduce_backward(g) = g * m[t] / d[s(t)]: its derivative in g is reduce(upstream, m, d)
    mask, cu_seqlens, sample_denoms = ctx.saved_tensors
    g = torch.ops.lossagg.reduce(upstream, mask, cu_seqlens, sample_denoms).to(ctx.grad_dtype) if ctx.needs_input_grad[0] else None
    return g, None, None, None, None


torch.library.register_autograd("lossagg::reduce_backward", _reduce_backward_grad, setup_context=_setup_reduce_backward)


# --------------------------------------------------------------------------- reduce_terms
def reduce_terms(
    values,
    mask: torch.Tensor,
    *positional,
    cu_seqlens: torch.Tensor | None = None,
    sample_denoms: torch.Tensor | None = None,
    sample_weights: torch.Tensor | None = None,
    coefficients=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole loss of K terms from one pass over their values and the mask (docs/terms.md)::

        J = Σ_k c_k J_k,    J_k = Σ_i w[k, i] · (Σ_{t in i} m[t] · values[k][t]) / d[k, i]

    ``values`` is a list of K tensors of one floating dtype, each with the token shape of
    ``mask`` (``[T]`` packed with ``cu_seqlens``, ``[B, T]`` padded), read where they lie (no
    ``[K, T]`` copy); ``sample_denoms`` ``d`` is ``[K, B]``, floating, finite and > 0;
    ``sample_weights`` ``w`` is ``[K, B]`` and finite (None: 1); ``coefficients`` ``c`` is K
    finite numbers (None: 1). Returns ``(J, parts)``: ``J`` 0-dim, differentiable in every
    ``values[k]`` (gradient ``grad · c_k · w[k, i] · m[t] / d[k, i]``), and ``parts`` ``[K]``,
    each term's ``J_k`` before its coefficient, detached. Float32 (float64 for float64 values).
    Each ``J_k`` adds its quotients as :func:`reduce` does and the terms are added in order,
    so one term with coefficient 1 and no weights gives the bits of :func:`reduce`.
    """
    if positional:
        raise TypeError(
            f"lossagg.reduce_terms(values, mask, *, cu_seqlens=None, sample_denoms, sample_weights=None, coefficients=None) takes 2 positional "
            f"arguments, got {2 + len(positional)}: pass the others by keyword"
        )
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
        got = f"a tensor of shape {list(values.shape)}" if isinstance(values, torch.Tensor) else type(values).__name__
        _fail(TypeError, "reduce_terms", f"values must be a list of the K terms' per-token tensors, got {got}")
    values = list(values)
    if not values:
        _fail(ValueError, "reduce_terms", "values must hold at least one term's tensor, got an empty list")
    for k, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            _fail(TypeError, "reduce_terms", f"values[{k}] must be a torch.Tensor (a term's per-token values), got {type(v).__name__}")
    if sample_denoms is None:
        raise TypeError("lossagg.reduce_terms: missing the keyword argument sample_denoms (the [K, B] per-term, per-sample denominators)")
    return reduce_terms_of(values, mask, cu_seqlens, sample_denoms, sample_weights, _term_coefficients(coefficients, len(values)))


def reduce_terms_of(
    values: list,
    mask,
    cu_seqlens,
    sample_denoms,
    sample_weights,
    coefficients: list[float],
    names: tuple[str, ...] | None = None,
    layout_read: bool = False,
    values_read: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reduce_terms` for a caller that passes ``values`` as a list and ``coefficients`` as
    a list of floats (lossagg/micro_batch.py): every check of the tensors, none of the parsing;
    ``names``, the values as the caller's user named them (``values['kl']``), for the messages.
    ``layout_read``: the caller knows the tensors besides ``values`` to pass :func:`_readable`'s
    test (a micro-batch's, tested once), so that only the values are tested here; with ``values_read`` too, the
    caller tested the values as well (lossagg/micro_batch.py's ``_usual``), so nothing is."""
    if torch.compiler.is_compiling():  # the fake kernel checks what a trace can see
        return torch.ops.lossagg.reduce_terms(values, mask, cu_seqlens, sample_denoms, sample_weights, coefficients)
    grad_mode = torch.is_grad_enabled()
    needs_grad = grad_mode and any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)
    tensors = (*values, mask, cu_seqlens, sample_denoms, sample_weights)
    if not (layout_read and values_read) and not _readable(values if layout_read else tensors, needs_grad):
        names = (*(names or (f"values[{k}]" for k in range(len(values)))), "mask", "cu_seqlens", "sample_denoms", "sample_weights")
        check_readable(
            "reduce_terms", names, tensors, (_reduce_terms_fake, (values, mask, cu_seqlens, sample_denoms, sample_weights, coefficients)), needs_grad
        )
    try:
        if grad_mode:
            _not_differentiable("reduce_terms", mask=mask, sample_denoms=sample_denoms, sample_weights=sample_weights)
        if needs_grad:  # J alone is the Function's output; the parts (never differentiable) come back beside it
            parts = []
            out = _ReduceTerms.apply((mask, cu_seqlens, sample_denoms, sample_weights, coefficients, parts), *values)
            return out, parts[0]
        with _BELOW_AUTOGRAD():
            return _REDUCE_TERMS(values, mask, cu_seqlens, sample_denoms, sample_weights, coefficients)
    except RuntimeError as exc:
        raise python_error(exc) from None


def _term_coefficients(coefficients, k: int) -> list[float]:
    if coefficients is None:
        return [1.0] * k
    if isinstance(coefficients, torch.Tensor) or not isinstance(coefficients, (list, tuple)):
        _fail(TypeError, "reduce_terms", f"coefficients must be a list of K = {k} numbers, got {type(coefficients).__name__}")
    if all(type(c) is float for c in coefficients):  # the usual call
        return list(coefficients)
    out = []
    for i, c in enumerate(coefficients):
        number = plain_number(c)  # a Python or NumPy number, or a 0-dim tensor
        if number is None:
            _fail(TypeError, "reduce_terms", f"coefficients[{i}] must be a number, got {type(c).__name__}")
        try:
            out.append(float(number))
        except OverflowError:  # an integer beyond float64
            bits = int(number).bit_length()
            _fail(ValueError, "reduce_terms", f"coefficients must be finite, got coefficients[{i}] = an integer of {bits} bits, beyond float64")
    return out


def _check_term_table(op, name, t, k, b, like):
    if not t.dtype.is_floating_point:
        _fail(TypeError, op, f"{name} must have a floating dtype, got {t.dtype}")
    if t.dim() != 2 or t.shape[0] != k or t.shape[1] != b:
        _fail(ValueError, op, f"{name} must be [K, B] = [{k}, {b}] (one entry per term and sample), got shape {list(t.shape)}")
    _check_device(op, name, t, like, "the token tensors")


def _check_coefficients(op, coefficients, k):
    if len(coefficients) != k:
        _fail(ValueError, op, f"coefficients must hold one number per term (K = {k}), got {len(coefficients)}")
    for i, c in enumerate(coefficients):
        if c != c or c in (float("inf"), float("-inf")):
            _fail(ValueError, op, f"coefficients must be finite, got coefficients[{i}] = {c}")


@torch.library.register_fake("lossagg::reduce_terms")
def _reduce_terms_fake(values, mask, cu_seqlens, sample_denoms, sample_weights, coefficients):
    op = "reduce_terms"
    if not values:
        _fail(ValueError, op, "values must hold at least one term's tensor, got an empty list")
    first = values[0]
    for k, v in enumerate(values):
        if v.dtype not in VALUE_DTYPES:
            _fail(TypeError, op, values_dtype_error(f"values[{k}]", v.dtype))
        if k and v.dtype != first.dtype:
            _fail(TypeError, op, f"every term's values must have one dtype, values[0]'s {first.dtype}, got values[{k}] of dtype {v.dtype}")
        if k and v.device != first.device:
            _fail(ValueError, op, f"values[{k}] must be on the device of values[0] ({first.device}), got {v.device}")
        if k and tuple(v.shape) != tuple(mask.shape):
            _fail(ValueError, op, f"values[{k}] must have the token shape of mask {list(mask.shape)}, got shape {list(v.shape)}")
    b, _ = _token_layout(op, first, mask, cu_seqlens, allow_metric_dim=False)
    _check_term_table(op, "sample_denoms", sample_denoms, len(values), b, first)
    if sample_weights is not None:
        _check_term_table(op, "sample_weights", sample_weights, len(values), b, first)
    _check_coefficients(op, coefficients, len(values))
    acc = _acc_dtype(first.dtype)
    return first.new_empty((), dtype=acc), first.new_empty((len(values),), dtype=acc)


def _reduce_terms_grads(ctx, grad):
    """The K gradients of reduce_terms' J from one reduce_terms_backward call (each its own tensor)."""
    mask, cu_seqlens, sample_denoms, sample_weights = ctx.saved_tensors
    args = (grad, mask, cu_seqlens, sample_denoms, sample_weights, ctx.coefficients, ctx.values_dtype)
    if grad.requires_grad:  # create_graph: the backward op's own autograd records it
        return torch.ops.lossagg.reduce_terms_backward(*args)
    with _BELOW_AUTOGRAD():
        return _REDUCE_TERMS_BACKWARD(*args)


def _save_reduce_terms(ctx, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, values_dtype):
    ctx.save_for_backward(mask, cu_seqlens, sample_denoms, sample_weights)
    ctx.coefficients = list(coefficients)
    ctx.values_dtype = values_dtype


class _ReduceTerms(torch.autograd.Function):
    """reduce_terms with its backward, as the wrapper :func:`reduce_terms` calls it (see _Reduce);
    the values come last, one argument each, so that autograd gives each its gradient. J is its one
    output: the op's parts ``[K]`` are appended to the list the call passes (a second output, marked
    not differentiable, cost every forward and backward some 8 µs at 16k tokens: its wrapping and the
    zeros autograd makes for its gradient)."""

    @staticmethod
    def forward(ctx, how, *values):
        mask, cu_seqlens, sample_denoms, sample_weights, coefficients, parts = how
        with _BELOW_AUTOGRAD():
            out, split = _REDUCE_TERMS(list(values), mask, cu_seqlens, sample_denoms, sample_weights, coefficients)
        parts.append(split)
        _save_reduce_terms(ctx, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, values[0].dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        wanted = ctx.needs_input_grad[1:]
        if not any(wanted):
            return (None,) * (1 + len(wanted))
        grads = _reduce_terms_grads(ctx, grad)
        return (None, *(g if need else None for g, need in zip(grads, wanted, strict=True)))


def _setup_reduce_terms(ctx, inputs, output):
    values, mask, cu_seqlens, sample_denoms, sample_weights, coefficients = inputs
    _not_differentiable("reduce_terms", mask=mask, sample_denoms=sample_denoms, sample_weights=sample_weights)
    ctx.mark_non_differentiable(output[1])  # each term's J_k, for a tracker
    _save_reduce_terms(ctx, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, values[0].dtype)


def _reduce_terms_grad(ctx, grad, grad_parts):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    return list(_reduce_terms_grads(ctx, grad)), None, None, None, None, None


torch.library.register_autograd("lossagg::reduce_terms", _reduce_terms_grad, setup_context=_setup_reduce_terms)


# ----------------------------------------------------------------- reduce_terms_backward
@torch.library.register_fake("lossagg::reduce_terms_backward")
def _reduce_terms_backward_fake(grad, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, values_dtype):
    op = "reduce_terms_backward"
    _check_values_dtype_argument(op, values_dtype)
    if grad.dim() != 0:
        _fail(ValueError, op, f"grad must be a 0-dim tensor, got shape {list(grad.shape)}")
    if sample_denoms.dim() != 2 or sample_denoms.shape[0] < 1:
        _fail(ValueError, op, f"sample_denoms must be [K, B] with K >= 1, got shape {list(sample_denoms.shape)}")
    k = sample_denoms.shape[0]
    b = _mask_layout(op, mask, cu_seqlens)
    _check_term_table(op, "sample_denoms", sample_denoms, k, b, mask)
    if sample_weights is not None:
        _check_term_table(op, "sample_weights", sample_weights, k, b, mask)
    _check_coefficients(op, coefficients, k)
    _check_device(op, "grad", grad, mask, "mask")
    return [mask.new_empty(mask.shape, dtype=values_dtype) for _ in range(k)]


def _setup_reduce_terms_backward(ctx, inputs, output):
    grad, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, _ = inputs
    _not_differentiable("reduce_terms_backward", mask=mask, sample_denoms=sample_denoms, sample_weights=sample_weights)
    ctx.save_for_backward(mask, cu_seqlens, sample_denoms, sample_weights)
    ctx.coefficients = list(coefficients)
    ctx.grad_dtype = grad.dtype
    ctx.values_dtype = output[0].dtype


def _reduce_terms_backward_grad(ctx, upstream):
    # reduce_terms_backward(g)[k][t] = g * c_k * w[k, s] * m[t] / d[k, s]: its derivative in g is
    # reduce_terms of the upstream gradients (a row no gradient reached is zeros)
    mask, cu_seqlens, sample_denoms, sample_weights = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None, None
    rows = [torch.zeros(mask.shape, dtype=ctx.values_dtype, device=mask.device) if u is None else u.contiguous() for u in upstream]
    g = torch.ops.lossagg.reduce_terms(rows, mask, cu_seqlens, sample_denoms, sample_weights, ctx.coefficients)[0].to(ctx.grad_dtype)
    return g, None, None, None, None, None, None


torch.library.register_autograd("lossagg::reduce_terms_backward", _reduce_terms_backward_grad, setup_context=_setup_reduce_terms_backward)


# ----------------------------------------------------------------- segment_sum_and_count
def segment_sum_and_count(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-segment masked sums ``[B]`` and kept-token counts (int64 ``[B]``) from one read of
    ``values`` (``[T]`` packed or ``[B, T]`` padded, as for :func:`reduce`) and ``mask``; not
    differentiable (the one-pass route of :func:`lossagg.aggregate` gives the gradient of J)."""
    check_readable(
        "reduce", _SEGMENT_SUM_ARGS, (values, mask, cu_seqlens), (_token_layout, ("reduce", values, mask, cu_seqlens, False))
    )  # named as reduce, whose argument it is
    try:
        with _BELOW_AUTOGRAD():
            return _SEGMENT_SUM_AND_COUNT(values, mask, cu_seqlens)
    except RuntimeError as exc:
        raise python_error(exc) from None


@torch.library.register_fake("lossagg::segment_sum_and_count")
def _segment_sum_and_count_fake(values, mask, cu_seqlens):
    b, _ = _token_layout("segment_sum_and_count", values, mask, cu_seqlens, allow_metric_dim=False)
    return values.new_empty((b,), dtype=_acc_dtype(values.dtype)), values.new_empty((b,), dtype=torch.int64)


def _setup_segment_sum_and_count(ctx, inputs, output):
    pass


def _segment_sum_and_count_grad(ctx, grad_sums, grad_counts):
    raise RuntimeError(
        "lossagg.segment_sum_and_count is not differentiable: lossagg.aggregate (its one-pass route, lossagg/one_pass.py) gives the gradient of J, "
        "lossagg.segment_sum that of the per-segment sums"
    )


torch.library.register_autograd("lossagg::segment_sum_and_count", _segment_sum_and_count_grad, setup_context=_setup_segment_sum_and_count)


# -------------------------------------------------------------------------- token_counts
def token_counts(mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``M[i]``: tokens of each sample whose mask is non-zero, counted exactly (int64 ``[B]``).

    One native pass over the mask (``torch.ops.lossagg.token_counts``); ``cu_seqlens`` is
    checked as the ops check it (offsets on the host for a mask on a device are accepted).
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
    check_readable("token_counts", ("mask", "cu_seqlens"), (mask, cu_seqlens), (_mask_layout, ("token_counts", mask, cu_seqlens)))
    try:
        return torch.ops.lossagg.token_counts(mask, cu_seqlens)
    except RuntimeError as exc:
        raise python_error(exc) from None


@torch.library.register_fake("lossagg::token_counts")
def _token_counts_fake(mask, cu_seqlens):
    b = _mask_layout("token_counts", mask, cu_seqlens)
    return mask.new_empty((b,), dtype=torch.int64)


def _token_counts_composite(mask, cu_seqlens):
    """token_counts on devices without a native kernel (CUDA): a prefix count of the kept
    tokens, read at the segment bounds (int32 while the tokens fit, else int64)."""
    b = _mask_layout("token_counts", mask, cu_seqlens)
    kept = mask != 0
    if cu_seqlens is None:
        return kept.sum(1, dtype=torch.int64)
    if b == 0:
        return torch.zeros(0, dtype=torch.int64, device=mask.device)
    dtype = torch.int32 if mask.shape[0] < 2**31 - 1 else torch.int64
    prefix = torch.zeros(mask.shape[0] + 1, dtype=dtype, device=mask.device)
    torch.cumsum(kept, 0, dtype=dtype, out=prefix[1:])
    cu = check_cu_seqlens(cu_seqlens, mask.shape[0]).long()  # read on the host, as the native checks do
    return (prefix[cu[1:]] - prefix[cu[:-1]]).long()


torch.library.impl("lossagg::token_counts", "CUDA")(_token_counts_composite)


# ----------------------------------------------------------------------------- aggregate
def aggregate_by_program(
    values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None, program, divisor: float, needs_grad: bool | None = None
) -> torch.Tensor:
    """J of the native ``aggregate`` op: the sums, the counts, ``d`` from the denominator
    ``program`` (the factor codes of lossagg/denom_program.py) and ``J`` from one call,
    differentiable in ``values`` (reduce's backward over the ``d`` it returned). The caller has
    checked the arguments (:func:`lossagg.aggregate`'s one-pass route), and may say whether the
    gradient is needed (``needs_grad``: gradients on and ``values`` requires grad)."""
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and values.requires_grad
    program = program if type(program) is list else list(program)
    try:
        if needs_grad:
            return _Aggregate.apply(values, mask, cu_seqlens, _AGGREGATE, program, divisor)
        with _BELOW_AUTOGRAD():
            return _AGGREGATE(values, mask, cu_seqlens, program, divisor)[0]
    except RuntimeError as exc:
        raise python_error(exc) from None


@torch.library.register_fake("lossagg::aggregate")
def _aggregate_fake(values, mask, cu_seqlens, denom_program, divisor):
    b, _ = _token_layout("aggregate", values, mask, cu_seqlens, allow_metric_dim=False)
    return values.new_empty((), dtype=_acc_dtype(values.dtype)), values.new_empty((b,), dtype=torch.float64)


def _aggregate_composite(values, mask, cu_seqlens, denom_program, divisor):
    """aggregate on devices without a native kernel (CUDA): segment_sum_and_count, d from the
    program in tensor ops (lossagg/denom_program.py: the native fold's bits), then J as reduce
    adds the B quotients (same bits as the CPU kernel)."""
    sums, counts = torch.ops.lossagg.segment_sum_and_count(values, mask, cu_seqlens)
    d = evaluate_program(denom_program, divisor, counts)
    if d.numel() and not bool(torch.isfinite(d).all() & (d > 0).all()):
        i = int(torch.nonzero(~torch.isfinite(d) | (d <= 0))[0, 0])
        where = f"(program {list(denom_program)}, divisor {divisor})"
        _fail(ValueError, "aggregate", f"a denominator is not finite and > 0: d[{i}] = {float(d[i])} {where}")
    check_division_denoms(d, values.dtype)
    ones = torch.ones((sums.shape[0], 1), dtype=torch.bool, device=sums.device)
    return torch.ops.lossagg.reduce(sums.unsqueeze(1), ones, None, d), d


torch.library.impl("lossagg::aggregate", "CUDA")(_aggregate_composite)


class _Aggregate(torch.autograd.Function):
    """A native aggregate op (``op``: aggregate or aggregate_planned, called with ``values, mask, cu_seqlens,
    *args``) with reduce's backward over the d it returns."""

    @staticmethod
    def forward(ctx, values, mask, cu_seqlens, op, *args):
        with _BELOW_AUTOGRAD():
            out, d = op(values, mask, cu_seqlens, *args)
        ctx.save_for_backward(mask, cu_seqlens, d)
        ctx.values_dtype = values.dtype
        ctx.more = len(args)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*_reduce_grad(ctx, grad), *(None,) * ctx.more)  # reduce's fourth, its d, is here the op


def _setup_aggregate(ctx, inputs, output):
    values, mask, cu_seqlens, _, _ = inputs
    _not_differentiable("aggregate", mask=mask)
    ctx.mark_non_differentiable(output[1])  # d is made of the mask's counts
    ctx.save_for_backward(mask, cu_seqlens, output[1])
    ctx.values_dtype = values.dtype


def _aggregate_grad(ctx, grad, grad_d):
    # J's gradient is reduce's with the d the op returned; d itself depends on the mask only
    return (*_reduce_grad(ctx, grad), None)


torch.library.register_autograd("lossagg::aggregate", _aggregate_grad, setup_context=_setup_aggregate)


# -------------------------------------------------------------------------- aggregate_planned
def aggregate_planned(
    values, mask, cu_seqlens, group_index, session_index, per_prompt: int, check_groups: bool, sessions_in_groups: bool, program, divisor
):
    """J of the native ``aggregate_planned`` op (csrc/cpu/ops_cpu.cpp): the sums, the counts, ``d`` by the plan's
    own passes over the counts and labels (one term's plan program, lossagg/step.py) and ``J`` from one call,
    differentiable in ``values`` (reduce's backward over the ``d`` it returned); None where the plan declines the
    step (the caller then takes the Python route, which names the problem). CPU tensors only: the caller has
    checked the arguments (:func:`lossagg.aggregate`'s one-pass route)."""
    args = (group_index, session_index, per_prompt, check_groups, sessions_in_groups, program, divisor)
    try:
        if torch.is_grad_enabled() and values.requires_grad:
            return _Aggregate.apply(values, mask, cu_seqlens, _AGGREGATE_PLANNED, *args)
        with _BELOW_AUTOGRAD():
            return _AGGREGATE_PLANNED(values, mask, cu_seqlens, *args)[0]
    except RuntimeError as exc:
        error = python_error(exc)
        if str(error).startswith(PLAN_DECLINES):
            return None
        raise error from None


@torch.library.register_fake("lossagg::aggregate_planned")
def _aggregate_planned_fake(values, mask, cu_seqlens, group_index, session_index, per_prompt, check_groups, sessions_in_groups, program, divisor):
    b, _ = _token_layout("aggregate_planned", values, mask, cu_seqlens, allow_metric_dim=False)
    return values.new_empty((), dtype=_acc_dtype(values.dtype)), values.new_empty((b,), dtype=torch.float64)


def _setup_aggregate_planned(ctx, inputs, output):
    _setup_aggregate(ctx, inputs[:3] + (None, None), output)


def _aggregate_planned_grad(ctx, grad, grad_d):
    return (*_reduce_grad(ctx, grad), None, None, None, None, None, None)


torch.library.register_autograd("lossagg::aggregate_planned", _aggregate_planned_grad, setup_context=_setup_aggregate_planned)


# -------------------------------------------------------------------------- plan_totals
_PLAN_TOTALS = torch.ops.lossagg.plan_totals.default


def plan_totals(
    counts,
    group_index,
    session_index,
    per_prompt: int,
    check_groups: bool,
    sessions_in_groups: bool,
    blocks,
    with_counts: bool,
    program,
    divisors,
    layout=None,
) -> list[torch.Tensor]:
    """The step totals and every term's d[i] of a one-process plan in one native call (csrc/cpu/plan_totals.cpp):
    ``[scalars, *blocks, counts (with_counts), d, d32]``, the scalars float64 ``[9]`` with a status first (0 or 7:
    served; else the Python route takes the step), each block and the counts float64 ``[N]``, ``d`` float64 and
    ``d32`` float32 ``[K, N]``. ``layout``: :func:`plan_layout`'s of these labels, read in place of their pass. CPU
    tensors only: lossagg.StepPlan calls it with the arguments it checked (lossagg/step.py)."""
    try:
        return _PLAN_TOTALS(
            counts, group_index, session_index, per_prompt, check_groups, sessions_in_groups, blocks, with_counts, program, divisors, layout
        )
    except RuntimeError as exc:
        raise python_error(exc) from None


@torch.library.register_fake("lossagg::plan_totals")
def _plan_totals_fake(
    counts, group_index, session_index, per_prompt, check_groups, sessions_in_groups, blocks, with_counts, program, divisors, layout=None
):
    n, k = counts.shape[0], len(divisors)
    per_sample = [counts.new_empty((n,), dtype=torch.float64) for _ in range(len(blocks) + int(with_counts))]
    d = [counts.new_empty((k, n), dtype=torch.float64), counts.new_empty((k, n), dtype=torch.float32)]
    return [counts.new_empty((9,), dtype=torch.float64), *per_sample, *d]


# -------------------------------------------------------------------------- plan_layout
_PLAN_LAYOUT = torch.ops.lossagg.plan_layout.default


def plan_layout(group_index, session_index, per_prompt: int, check_groups: bool, sessions_in_groups: bool, nonempty_read: bool) -> torch.Tensor:
    """The labels' half of :func:`plan_totals` (their runs, the checks on them) as its ``layout`` argument, from a step's
    labels (CPU int64 ``[N]`` each, at least one given) and its arguments on them (``nonempty_read``: whether the call
    reads P' or S'), done where the labels are known before the counts (lossagg/step.py's LabelLayout)."""
    if group_index is None and session_index is None:  # no tensor to dispatch on: the kernel's own message
        raise ValueError("lossagg.plan_layout: group_index or session_index must be given, got neither")
    try:
        return _PLAN_LAYOUT(group_index, session_index, per_prompt, check_groups, sessions_in_groups, nonempty_read)
    except RuntimeError as exc:
        raise python_error(exc) from None


@torch.library.register_fake("lossagg::plan_layout")
def _plan_layout_fake(group_index, session_index, per_prompt, check_groups, sessions_in_groups, nonempty_read):
    like = group_index if group_index is not None else session_index
    size = torch.library.get_ctx().new_dynamic_size()
    return like.new_empty((size,), dtype=torch.int64)
