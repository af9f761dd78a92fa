"""From a config and a batch to the loss: the user never writes a denominator formula."""

from __future__ import annotations

import torch

from lossagg.config import LossAggregationConfig
from lossagg.denominators import sample_denoms as whole_step_denoms
from lossagg.ops import reduce, segment_sum


def token_counts(mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``M[i]``: tokens of each sample whose mask is non-zero (one native segment_sum)."""
    ones = torch.ones((), dtype=torch.float32, device=mask.device).expand(mask.shape)
    return segment_sum(ones, mask != 0, cu_seqlens)


def step_denoms(
    config: LossAggregationConfig,
    rollout_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``d[i]`` for a batch that is the whole step (single process, one micro-batch)."""
    counts = token_counts(rollout_mask, cu_seqlens)
    return whole_step_denoms(
        config.mode.value,
        counts,
        group_index=group_index,
        n_samples_per_prompt=config.n_samples_per_prompt,
        divisor=config.divisor,
    ).to(rollout_mask.device)


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
    """The step scalar J of ``config.mode`` (SPEC §3), differentiable in ``per_token_loss``.

    Without ``sample_denoms`` the batch is taken to be the whole optimizer step, and the
    denominators come from ``rollout_mask`` (default: ``mask``): masks changed after
    rollout change only numerators. For micro-batches of a larger step, pass the
    denominators of a :class:`lossagg.StepPlan`.
    """
    if sample_denoms is None:
        sample_denoms = step_denoms(config, mask if rollout_mask is None else rollout_mask, cu_seqlens, group_index)
    return reduce(per_token_loss, mask, sample_denoms, cu_seqlens)
