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

lossagg's own modes (every registered one, ``lossagg.MODES``) are accepted too:
``group_index`` for a mode with prompt groups, ``loss_scale_factor`` as the divisor of a
mode that takes one (the padded width when not given). With no global-batch argument and
``dp_size=1`` the micro-batch is the whole step; otherwise ``global_batch_size`` is the
step's ``N`` and ``batch_num_tokens`` its ``T``, and a mode that needs a total verl does not
pass (``L_max``, prompt groups) is refused, naming it, rather than computed from the
micro-batch alone.
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


# verl's global-batch arguments and the step totals they are
_VERL_TOTALS = {"num_samples": "global_batch_size", "total_tokens": "batch_num_tokens"}


def _lossagg_denoms(loss_mask, mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor, group_index) -> torch.Tensor:
    """d[i] of a lossagg mode: the micro-batch alone when it is the whole step, else from verl's global-batch arguments."""
    spec = MODES[mode]
    divisor = loss_mask.shape[-1] if loss_scale_factor is None else as_number("loss_scale_factor", loss_scale_factor)
    config = LossAggregationConfig(mode=mode, **({"divisor": float(divisor)} if spec.needs_divisor else {}))
    counts = token_counts(loss_mask)
    if dp_size == 1 and batch_num_tokens is None and global_batch_size is None:
        return StepPlan(config, counts, group_index=group_index).sample_denoms
    given = {"global_batch_size": global_batch_size, "batch_num_tokens": batch_num_tokens}
    totals = {}
    for total in spec.totals:
        argument = _VERL_TOTALS.get(total)
        if argument is None:
            raise ValueError(
                f"loss_agg_mode={mode} needs the step total {total}, which verl's agg_loss arguments do not carry: "
                "use it where the micro-batch is its rank's whole step (dp_size=1, no global-batch arguments), "
                "or build a lossagg.StepPlan over the step"
            )
        if given[argument] is None:
            raise ValueError(f"loss_agg_mode={mode} with dp_size={dp_size} or other global-batch arguments needs {argument} (the step's {total})")
    if global_batch_size is not None:
        n = as_int("global_batch_size", global_batch_size, minimum=0)
        if n < counts.shape[0]:
            raise ValueError(f"global_batch_size (the step's samples) must be >= this micro-batch's {counts.shape[0]}, got {global_batch_size!r}")
        totals["num_samples"] = n
    if batch_num_tokens is not None:
        t = as_number("batch_num_tokens", batch_num_tokens, positive=False)
        if t < float(counts.sum()):
            raise ValueError(
                f"batch_num_tokens (the step's valid tokens) must be >= this micro-batch's {float(counts.sum()):g}, got {batch_num_tokens!r}"
            )
        totals["total_tokens"] = t
    return StepPlan.from_totals(config, counts, **totals).sample_denoms


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
    if not loss_mat.is_floating_point():
        raise TypeError(f"loss_mat must be a floating tensor (float32, bfloat16, float16 or float64), got dtype {loss_mat.dtype}")
    if loss_mask.device != loss_mat.device:
        raise ValueError(f"loss_mask must be on the device of loss_mat ({loss_mat.device}), got {loss_mask.device}")
    dp_size = as_int("dp_size", dp_size, minimum=1)
    if loss_agg_mode in VERL_MODES:
        d = _verl_denoms(loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    elif loss_agg_mode in MODES:
        d = _lossagg_denoms(loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor, group_index) / dp_size
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode!r}; expected one of {', '.join(VERL_MODES + tuple(MODES))}")
    return reduce(loss_mat, loss_mask, sample_denoms=d.to(loss_mat.device))
