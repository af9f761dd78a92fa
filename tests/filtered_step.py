"""A step whose loss filters its own mask after the forward (docs/composition.md, "Filters inside
the loss"), for the deferred plan's tests: the filter, the float64 gradient of the filtered
unsplit step, and one rank's share of the step (its micro-batches, CP-sharded).

The filter, applied to a micro-batch's per-token statistic ``x`` (here the detached per-token
loss, standing in for a log-ratio): a sample is dropped when the mean of ``x`` over its rollout
tokens (the whole sample, across the CP group) exceeds :data:`SAMPLE_THRESHOLD`; a token is
dropped when its own ``x`` exceeds :data:`TOKEN_THRESHOLD`.
"""

from __future__ import annotations

import os
import sys

import torch

import lossagg
from lossagg.testing import reference_loss

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import torch_engines  # noqa: E402  (the model, the step and the CP-sharded micro-batches of the engine recipe)
from batches import sessions_in  # noqa: E402

SAMPLE_THRESHOLD = 0.9
TOKEN_THRESHOLD = 2.5


def keep(per_token_loss: torch.Tensor, mask: torch.Tensor, cu_seqlens, cp_group=None) -> torch.Tensor:
    """The final mask of a micro-batch (or of the whole step): the rollout ``mask`` less the
    tokens and the samples the filter drops."""
    x = per_token_loss.detach()
    sample_mean = lossagg.sequence_mean(x, mask, cu_seqlens, cp_group=cp_group)
    kept_sample = lossagg.broadcast_to_tokens((sample_mean <= SAMPLE_THRESHOLD).to(x.dtype), mask, cu_seqlens) != 0
    return mask & (x <= TOKEN_THRESHOLD) & kept_sample


def reference(config, step):
    """(the float64 gradient of the filtered unsplit step, its J, the step's final mask)."""
    features, targets, mask, cu, groups = step
    model = torch_engines.make_model()
    loss = torch_engines.per_token_loss(model, features, targets)
    final = keep(loss, mask, cu)
    j = reference_loss(config, loss, final, cu, groups, session_index=sessions_in(groups))
    j.backward()
    return [p.grad for p in model.parameters()], float(j.detach()), final


def rank_share(step, dp, cp, num_micro_batches, rank):
    """(dp_rank, cp_rank, this rank's samples, its micro-batches) of a DP x CP world."""
    dp_rank, cp_rank = divmod(rank, cp)
    cu = step[3]
    own = torch.tensor_split(torch.arange(cu.numel() - 1), dp)[dp_rank]
    return dp_rank, cp_rank, own, torch_engines.local_micro_batches(step, own, num_micro_batches, cp, cp_rank)
