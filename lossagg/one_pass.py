"""From a config and a batch to the loss: the user never writes a denominator formula. (The module is
``one_pass``, not ``aggregate``: a submodule of that name would shadow the function
``lossagg.aggregate`` on the package once imported.)

:func:`aggregate` and every route it takes, in one file:

* ``sample_denoms`` given (a micro-batch of a larger step): ``reduce`` with them;
* a ``rollout_mask`` other than ``mask``: a plan from the rollout mask, then ``reduce``;
* otherwise the batch is the whole step and the denominators come from ``mask`` itself: the
  **one-pass route**, which reads the loss and the mask once. For a mode whose ``d[i]`` is a
  :class:`lossagg.DenomProduct` with a native program, on the CPU, the native ``aggregate``
  op computes the sums, the counts, ``d`` and ``J`` in one call (:func:`reduce_by_program`);
  for one whose product reads prompt groups or sessions, the native ``aggregate_planned`` op
  does, ``d`` by the native plan's passes over the counts and labels (:func:`reduce_by_plan`);
  elsewhere (another mode, another device, ``torch.compile``, a step the native plan declines)
  the sums and counts come from one pass and ``d`` from a :class:`lossagg.StepPlan`
  (:func:`reduce_with_counts`). Every route gives
  the bits of plan-then-reduce (tests/test_one_pass.py, tests/golden_program.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lossagg.config import LossAggregationConfig
from lossagg.denom_program import DenomProduct
from lossagg.modes import mode_registry, mode_spec
from lossagg.ops import (
    _AGGREGATE,
    _BELOW_AUTOGRAD,
    _REDUCE,
    _SEGMENT_SUM_ARGS,
    DENOMS_NOT_POSITIVE,
    _not_differentiable,
    _readable,
    _reduce_grad,
    _token_layout,
    aggregate_by_program,
    aggregate_planned,
    check_division_denoms,
    check_readable,
    python_error,
    reduce,
    segment_sum_and_count,
)
from lossagg.step import StepPlan, plain_labels, plan_info, remember
from lossagg.validate import check_holds_data

#: The native program and divisor of the last configs whose mode's d is one (``id(config)``: the config, the mode
#: registry it was read under, the program as a list, the divisor, and as the op takes it); a config is immutable.
_PROGRAMS: dict[int, tuple] = {}
_PROGRAMS_SIZE = 16
_STRIDED = torch.strided


def _plain_cpu(t) -> bool:
    """A plain dense CPU tensor: what :func:`lossagg.validate.check_holds_data` passes without a word."""
    return type(t) is torch.Tensor and t.layout is _STRIDED and t.is_cpu


def aggregate(
    config: LossAggregationConfig,
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    rollout_mask: torch.Tensor | None = None,
    sample_denoms: torch.Tensor | None = None,
    session_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step scalar J of ``config.mode`` (docs/modes.md), differentiable in ``per_token_loss``.

    Without ``sample_denoms`` the batch is taken to be the whole optimizer step, and the
    denominators come from ``rollout_mask`` (default: ``mask``) through a
    :class:`lossagg.StepPlan`: masks changed after rollout change only numerators. For
    micro-batches of a larger step, pass the ``sample_denoms`` of the step's plan.
    ``group_index`` and ``session_index`` are each sample's prompt group and session, for the
    modes that read them.

    When the denominators come from ``mask`` itself (no ``rollout_mask``), the loss and the
    mask are read once (the one-pass route, above), with the bits of the plan-then-reduce route.
    """
    if (
        sample_denoms is None
        and rollout_mask is None
        and group_index is None
        and session_index is None
        and _plain_cpu(per_token_loss)
        and _plain_cpu(mask)
        and (cu_seqlens is None or _plain_cpu(cu_seqlens))
    ):  # the usual call of a mode whose d is a native program: the checks below pass, and the config's program is known
        hit = _PROGRAMS.get(id(config))
        if (
            hit is not None
            and hit[0] is config
            and hit[1] is mode_registry()
            and per_token_loss.dim() == (1 if cu_seqlens is not None else 2)
            and not torch.compiler.is_compiling()
        ):
            if not (torch.is_grad_enabled() and (per_token_loss.requires_grad or mask.requires_grad)) and (
                per_token_loss.is_contiguous() and mask.is_contiguous() and (cu_seqlens is None or cu_seqlens.is_contiguous())
            ):  # no gradient: the op alone (an error it raises is met again below, and named there)
                try:
                    with _BELOW_AUTOGRAD():
                        return _AGGREGATE(per_token_loss, mask, cu_seqlens, hit[2], hit[4])[0]
                except RuntimeError:
                    pass
            plan = lambda m: StepPlan(config, m).sample_denoms  # noqa: E731
            return _by_program(per_token_loss, mask, cu_seqlens, hit[2], hit[3], plan)
    # the arguments read below, named as this function names them (not as the helpers it calls do)
    for name, t in (
        ("per_token_loss", per_token_loss),
        ("mask", mask),
        ("cu_seqlens", cu_seqlens),
        ("group_index", group_index),
        ("session_index", session_index),
    ):
        check_holds_data(name, t)
    if rollout_mask is not None and rollout_mask is not mask:
        check_holds_data("rollout_mask", rollout_mask)
        if not isinstance(rollout_mask, torch.Tensor):
            raise TypeError(f"rollout_mask must be a torch.Tensor or None, got {type(rollout_mask).__name__}")
        if isinstance(mask, torch.Tensor) and tuple(rollout_mask.shape) != tuple(mask.shape):
            raise ValueError(f"rollout_mask must have the shape of mask {tuple(mask.shape)}, got {tuple(rollout_mask.shape)}")
    if sample_denoms is None:
        if rollout_mask is None or rollout_mask is mask:
            if not isinstance(config, LossAggregationConfig):
                config = LossAggregationConfig.coerce(config)
            config.check_single_term("lossagg.aggregate")
            denoms = mode_spec(config.mode).denoms
            program = denoms.program(config.empty_samples) if type(denoms) is DenomProduct else None
            plan = lambda m: StepPlan(config, m, group_index=group_index, session_index=session_index).sample_denoms  # noqa: E731
            if program is not None:
                remember(
                    _PROGRAMS, _PROGRAMS_SIZE, id(config), (config, mode_registry(), list(program), config.divisor, float(config.divisor or 0.0))
                )
                return reduce_by_program(per_token_loss, mask, cu_seqlens, program, config.divisor, plan)
            planned = reduce_by_plan(config, per_token_loss, mask, cu_seqlens, group_index, session_index)
            return reduce_with_counts(per_token_loss, mask, cu_seqlens, plan) if planned is None else planned
        LossAggregationConfig.coerce(config).check_single_term("lossagg.aggregate")
        sample_denoms = StepPlan.from_mask(config, rollout_mask, cu_seqlens, group_index=group_index, session_index=session_index).sample_denoms
    return reduce(per_token_loss, mask, cu_seqlens=cu_seqlens, sample_denoms=sample_denoms)


# ------------------------------------------------------------------------------ the one-pass route
def reduce_with_counts(
    values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None, denoms_of: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``reduce`` whose ``sample_denoms`` are a function of the segments' own kept-token counts.

    ``denoms_of(counts)`` gets the int64 ``[B]`` counts of non-zero mask entries of each
    segment and returns the ``[B]`` denominators ``d[i]``. Values and mask are read once
    (``segment_sum_and_count``: the masked sums and the counts from one pass); ``J`` then
    comes from the ``B`` sums and ``d`` in the order ``reduce`` adds them, so the result has
    the bits of ``reduce(values, mask, cu_seqlens=cu_seqlens, sample_denoms=denoms_of(counts))``,
    and so has the gradient (``reduce``'s backward).
    """
    grad_mode = torch.is_grad_enabled()
    needs_grad = grad_mode and isinstance(values, torch.Tensor) and values.requires_grad
    if (
        not isinstance(values, torch.Tensor)
        or not isinstance(mask, torch.Tensor)
        or values.dim() != (1 if cu_seqlens is not None else 2)
        or torch.compiler.is_compiling()
    ):
        check_readable("reduce", _SEGMENT_SUM_ARGS, (values, mask, cu_seqlens))  # names a non-tensor as reduce would
        _token_layout("reduce", values, mask, cu_seqlens, allow_metric_dim=False)  # and a wrong layout
        counts = torch.ops.lossagg.token_counts(mask, cu_seqlens)  # traced (torch.compile): the two ops
        return torch.ops.lossagg.reduce(values, mask, cu_seqlens, denoms_of(counts))
    check_readable("reduce", _SEGMENT_SUM_ARGS, (values, mask, cu_seqlens), (_token_layout, ("reduce", values, mask, cu_seqlens, False)), needs_grad)
    if grad_mode and mask.requires_grad:
        _not_differentiable("reduce", mask=mask)
    if needs_grad:
        return _ReduceWithCounts.apply(values, mask, cu_seqlens, denoms_of)
    return _reduce_with_counts(values, mask, cu_seqlens, denoms_of)[0]


def reduce_by_program(
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    denom_program: tuple[int, ...],
    divisor: float | None,
    denoms_of: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """:func:`reduce_with_counts` for denominators that are a native program (the codes of a
    :class:`lossagg.DenomProduct`, lossagg/denom_program.py): the sums, the counts, ``d`` and
    ``J`` all come from the one native call ``torch.ops.lossagg.aggregate``, with no Python
    between the pass and ``J``. ``denoms_of(counts)`` must compute the same ``d`` (the product's
    Python evaluation through a StepPlan); it serves the routes the native op does not take
    (torch.compile, devices without its kernel, input the checks refuse) and names the numbers
    when a ``d[i]`` overflows. Same bits as ``reduce_with_counts`` and as
    ``reduce(values, mask, cu_seqlens=cu_seqlens, sample_denoms=denoms_of(counts))``.
    """
    if (
        not isinstance(values, torch.Tensor)
        or not isinstance(mask, torch.Tensor)
        or not values.is_cpu
        or values.dim() != (1 if cu_seqlens is not None else 2)
        or torch.compiler.is_compiling()
    ):
        return reduce_with_counts(values, mask, cu_seqlens, denoms_of)
    return _by_program(values, mask, cu_seqlens, denom_program, divisor, denoms_of)


def _by_program(values, mask, cu_seqlens, denom_program, divisor, denoms_of) -> torch.Tensor:
    """:func:`reduce_by_program` of CPU tensors in the token layout, outside ``torch.compile``."""
    grad_mode = torch.is_grad_enabled()
    needs_grad = grad_mode and values.requires_grad
    tensors = (values, mask, cu_seqlens)
    if not _readable(tensors, needs_grad):  # the usual call passes this test alone
        check_readable("reduce", _SEGMENT_SUM_ARGS, tensors, (_token_layout, ("reduce", *tensors, False)), needs_grad)
    if grad_mode and mask.requires_grad:
        _not_differentiable("reduce", mask=mask)
    try:
        return aggregate_by_program(values, mask, cu_seqlens, denom_program, 0.0 if divisor is None else float(divisor), needs_grad)
    except ValueError as error:
        if str(error).startswith(DENOMS_NOT_POSITIVE):
            return reduce_with_counts(values, mask, cu_seqlens, denoms_of)  # the plan's error names the settings and totals
        raise


def reduce_by_plan(
    config: LossAggregationConfig,
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    group_index: torch.Tensor | None,
    session_index: torch.Tensor | None,
) -> torch.Tensor | None:
    """J of a one-process step whose ``d[i]`` reads prompt groups or sessions, from the one native call
    ``torch.ops.lossagg.aggregate_planned``: the sums and counts from one read of the loss and the mask, ``d`` by
    the native plan's own passes over the counts and the labels (:class:`lossagg.StepPlan`'s d, bit for bit), then
    ``J`` as ``reduce`` adds the quotients. None where that call does not serve the step: the caller then takes
    :func:`reduce_with_counts` through a :class:`lossagg.StepPlan`, which serves it or raises naming the problem
    (arguments other than CPU tensors in the token layout, labels other than plain int64 ``[B]`` tensors where the
    mode reads them, ``torch.compile``, a mode the native plan does not serve, a step it declines)."""
    if (
        not isinstance(values, torch.Tensor)
        or not isinstance(mask, torch.Tensor)
        or not values.is_cpu
        or values.dim() != (1 if cu_seqlens is not None else 2)
        or torch.compiler.is_compiling()
    ):
        return None
    info = plan_info(config)
    if not info.native:
        return None
    if cu_seqlens is None:
        b = values.shape[0]
    elif isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        b = cu_seqlens.shape[0] - 1
    else:
        return None
    labels = []
    for given, needed in ((group_index, info.groups), (session_index, info.sessions)):
        if needed and not plain_labels(given, b):
            return None
        labels.append(given if needed else None)
    grad_mode = torch.is_grad_enabled()
    needs_grad = grad_mode and values.requires_grad
    check_readable("reduce", _SEGMENT_SUM_ARGS, (values, mask, cu_seqlens), (_token_layout, ("reduce", values, mask, cu_seqlens, False)), needs_grad)
    if grad_mode and mask.requires_grad:
        _not_differentiable("reduce", mask=mask)
    per_prompt = config.n_samples_per_prompt
    return aggregate_planned(
        values,
        mask,
        cu_seqlens,
        *labels,
        -1 if per_prompt is None else per_prompt,
        info.check_groups,
        info.sessions_in_groups,
        info.program,
        info.divisors[0],
    )


def _reduce_with_counts(values, mask, cu_seqlens, denoms_of, grad_mode=None):
    """(J, d) of :func:`reduce_with_counts`, below autograd. ``grad_mode``: whether the caller
    runs with gradients on (inside an autograd Function's forward they are off)."""
    sums, counts = segment_sum_and_count(values, mask, cu_seqlens)
    grad_mode = torch.is_grad_enabled() if grad_mode is None else grad_mode
    with torch.set_grad_enabled(grad_mode):
        d = denoms_of(counts)
    if not isinstance(d, torch.Tensor):
        b, got = sums.shape[0], type(d).__name__
        raise TypeError(f"lossagg.reduce: sample_denoms (what denoms_of returned) must be a torch.Tensor of B = {b} denominators, got {got}")
    if grad_mode and isinstance(d, torch.Tensor) and d.requires_grad:
        _not_differentiable("reduce", sample_denoms=d)  # as plan-then-reduce refuses it: J's gradient flows to values only
    check_division_denoms(d, values.dtype)
    # reduce over B one-token rows: each row's sum is its sample's sum (a one-term sum is
    # that term), and the quotients are added as reduce adds them
    ones = torch.ones((sums.shape[0], 1), dtype=torch.bool, device=sums.device)
    try:
        with _BELOW_AUTOGRAD():
            return _REDUCE(sums.unsqueeze(1), ones, None, d), d
    except RuntimeError as exc:
        raise python_error(exc) from None


class _ReduceWithCounts(torch.autograd.Function):
    """reduce_with_counts with reduce's backward (the denominators it computed are saved)."""

    @staticmethod
    def forward(ctx, values, mask, cu_seqlens, denoms_of):
        out, d = _reduce_with_counts(values, mask, cu_seqlens, denoms_of, grad_mode=True)
        ctx.save_for_backward(mask, cu_seqlens, d)
        ctx.values_dtype = values.dtype
        return out

    backward = staticmethod(_reduce_grad)


__all__ = ["aggregate", "reduce_by_program", "reduce_with_counts"]
