"""From a config and a batch to the loss: the user never writes a denominator formula."""

from __future__ import annotations

import torch

from lossagg.config import LossAggregationConfig
from lossagg.modes import DenomProduct, mode_spec
from lossagg.ops import reduce, reduce_by_program, reduce_with_counts
from lossagg.step import StepPlan, _as_config
from lossagg.validate import check_holds_data


def aggregate(
    config: LossAggregationConfig,
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    rollout_mask: torch.Tensor | None = None,
    sample_denoms: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step scalar J of ``config.mode`` (docs/modes.md), differentiable in ``per_token_loss``.

    Without ``sample_denoms`` the batch is taken to be the whole optimizer step, and the
    denominators come from ``rollout_mask`` (default: ``mask``) through a
    :class:`lossagg.StepPlan`: masks changed after rollout change only numerators. For
    micro-batches of a larger step, pass the ``sample_denoms`` of the step's plan.

    When the denominators come from ``mask`` itself (no ``rollout_mask``), the loss and the
    mask are read once: the token counts come from the same pass as the sums
    (:func:`lossagg.ops.reduce_with_counts`), with the bits of the plan-then-reduce route.
    """
    # the arguments read below, named as this function names them (not as the helpers it calls do)
    for name, t in (("per_token_loss", per_token_loss), ("mask", mask), ("cu_seqlens", cu_seqlens), ("group_index", group_index)):
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
                config = _as_config(config)
            denoms = mode_spec(config.mode).denoms
            program = denoms.program(config.empty_samples) if type(denoms) is DenomProduct else None
            plan = lambda m: StepPlan(config, m, group_index=group_index).sample_denoms  # noqa: E731
            if program is not None:
                return reduce_by_program(per_token_loss, mask, cu_seqlens, program, config.divisor, plan)
            return reduce_with_counts(per_token_loss, mask, cu_seqlens, plan)
        sample_denoms = StepPlan.from_mask(config, rollout_mask, cu_seqlens, group_index=group_index).sample_denoms
    return reduce(per_token_loss, mask, cu_seqlens=cu_seqlens, sample_denoms=sample_denoms)
