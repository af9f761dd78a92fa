"""A drop-in for verl's ``verl.trainer.ppo.core_algos.agg_loss`` (verl 0.9.1), computed by
lossagg's ``reduce`` op.

Switch with one line::

    # from verl.trainer.ppo.core_algos import agg_loss
    from lossagg.integrations.verl import agg_loss

Every verl mode keeps verl's signature, defaults and semantics, including the global-batch
arguments verl hands each micro-batch (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, ``loss_scale_factor``): with them, the micro-batch losses of a
step add up (after DDP/FSDP's average over ``dp_size``) to the step's loss, on any split.
Where verl's arithmetic has a hole, this one does not:

* a NaN or inf loss under a zero mask stays out (verl's ``seq-mean-*`` modes multiply
  ``loss_mat * loss_mask`` and leak it);
* an all-masked step gives 0 and zero gradients (verl divides 0 by 0 when it counts the
  tokens or sequences itself).

lossagg's own modes are accepted too (``sample_mean``, ``prompt_mean`` with
``group_index``, ``token_mean``, ``constant`` with ``loss_scale_factor`` as the divisor),
for a micro-batch that is the whole step on its rank.
"""

from __future__ import annotations

import torch

from lossagg.config import LossAggregationConfig
from lossagg.layout import token_counts
from lossagg.modes import MODES
from lossagg.ops import reduce
from lossagg.step import StepPlan
from lossagg.validate import as_int, as_number, as_tensor

VERL_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def _sequence_count(loss_mask: torch.Tensor) -> torch.Tensor:
    """Sequences with at least one valid token (verl's default global batch size)."""
    return (loss_mask.sum(-1) > 0).sum()


def _verl_denoms(loss_mask, mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) -> torch.Tensor:
    """d[i] (float64 [bs]) such that sum_i (sum_t m*l) / d[i] is verl's loss for this mode."""
    bs = loss_mask.shape[0]
    device = loss_mask.device
    ones = torch.ones(bs, dtype=torch.float64, device=device)
    if mode == "token-sum":
        return ones / dp_size
    if mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            total = float(loss_mask.ne(0).sum())
        else:
            # the step's tokens: at least this micro-batch's own (0 only when it has none)
            total = as_number("batch_num_tokens", batch_num_tokens, positive=False)
            local = float(loss_mask.ne(0).sum())
            if total < local:
                raise ValueError(f"batch_num_tokens (the step's valid tokens) must be >= this micro-batch's {local:g}, got {batch_num_tokens!r}")
        return ones * max(total, 1.0) / dp_size  # 0 valid tokens: loss 0, not 0/0
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        batch = float(_sequence_count(loss_mask))
    else:
        batch = float(as_int("global_batch_size", global_batch_size, minimum=0))
        local = float(_sequence_count(loss_mask))
        if batch < local:
            raise ValueError(
                f"global_batch_size (the step's sequences) must be >= this micro-batch's {local:g} non-empty sequences, got {global_batch_size!r}"
            )
    batch = max(batch, 1.0)
    if mode == "seq-mean-token-sum":
        return ones * batch / dp_size
    if mode == "seq-mean-token-sum-norm":
        scale = loss_mask.shape[-1] if loss_scale_factor is None else as_number("loss_scale_factor", loss_scale_factor)
        return ones * batch * float(scale) / dp_size
    # seq-mean-token-mean: each sequence's token mean, verl's "+ 1e-8" included
    per_sequence = loss_mask.to(torch.float64).sum(-1) + 1e-8
    return per_sequence * batch / dp_size


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
    *,
    group_index: torch.Tensor | None = None,
):
    """verl's ``agg_loss``: ``loss_mat`` and ``loss_mask`` are ``(bs, response_length)``.

    Returns a 0-dim tensor, differentiable in ``loss_mat``. ``loss_agg_mode`` is one of
    verl's modes (:data:`VERL_MODES`) or one of lossagg's (``group_index`` for
    ``prompt_mean``).
    """
    as_tensor("loss_mat", loss_mat)
    as_tensor("loss_mask", loss_mask)
    if loss_mat.dim() != 2 or tuple(loss_mask.shape) != tuple(loss_mat.shape):
        raise ValueError(f"loss_mat and loss_mask must both be (bs, response_length), got {tuple(loss_mat.shape)} and {tuple(loss_mask.shape)}")
    if loss_mask.device != loss_mat.device:
        raise ValueError(f"loss_mask must be on the device of loss_mat ({loss_mat.device}), got {loss_mask.device}")
    dp_size = as_int("dp_size", dp_size, minimum=1)
    if loss_agg_mode in VERL_MODES:
        d = _verl_denoms(loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    elif loss_agg_mode in MODES:
        divisor = loss_mask.shape[-1] if loss_scale_factor is None else as_number("loss_scale_factor", loss_scale_factor)
        settings = {"divisor": float(divisor)} if MODES[loss_agg_mode].needs_divisor else {}
        config = LossAggregationConfig(mode=loss_agg_mode, **settings)
        d = StepPlan(config, token_counts(loss_mask), group_index=group_index).sample_denoms / dp_size
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode!r}; expected one of {', '.join(VERL_MODES + tuple(MODES))}")
    return reduce(loss_mat, loss_mask, sample_denoms=d.to(loss_mat.device))
