"""A drop-in for verl's ``verl.trainer.ppo.core_algos.agg_loss`` (verl 0.9.1), computed by
lossagg's ``reduce`` op.

Switch with one line::

    # from verl.trainer.ppo.core_algos import agg_loss
    from lossagg.integrations.verl import agg_loss

Every verl mode keeps verl's signature, defaults and semantics, including the global-batch
arguments verl hands each micro-batch (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, ``loss_scale_factor``): with them, the micro-batch losses of a
step add up (after DDP/FSDP's average over ``dp_size``) to the step's loss, on any split.

Under verl's modes ``loss_mask`` is a weight, as in verl: bool, integer or floating, any
finite value >= 0 (0.5 halves a token's loss; a token total is the mask's sum; a
sequence counts when its mask sums to more than 0). The loss is verl 0.9.1's number for
every such mask. A negative or non-finite entry is refused, naming its position.
Where verl's arithmetic has a hole, this one does not:

* a NaN or inf loss under a zero mask stays out (verl's ``seq-mean-*`` modes multiply
  ``loss_mat * loss_mask`` and leak it);
* an all-masked step gives 0 and zero gradients (verl divides 0 by 0 when it counts the
  tokens or sequences itself).

lossagg's own modes (every registered one, ``lossagg.MODES``) are accepted too:
``group_index`` for a mode with prompt groups, ``session_index`` for one with sessions (a
multi-turn trajectory's rows, docs/modes.md "Sessions"), ``loss_scale_factor`` as the divisor of a
mode that takes one (the padded width when not given). Their ``d[i]`` is made of token
counts, so their ``loss_mask`` must be 0/1 (a fractional entry is refused, naming it).
With no global-batch argument and ``dp_size=1`` the micro-batch is the whole step;
otherwise ``global_batch_size`` is the step's ``N`` and ``batch_num_tokens`` its ``T``,
and a mode that needs a total verl does not pass (``L_max``, prompt groups) is refused,
naming it, rather than computed from the micro-batch alone.

``empty_samples`` (keyword only) is the config's setting for lossagg's modes (docs/modes.md,
"Empty samples"): ``"skip"`` leaves samples without a loss token out of ``N`` and ``P``, as
verl's own ``seq-mean-*`` modes do when no ``global_batch_size`` is given. verl's trainer
passes ``global_batch_size`` as every sample of the mini-batch (empty ones included), so under
``skip`` a mode that reads ``N`` or ``P`` is refused with global-batch arguments (verl carries
no count of non-empty samples). verl's own mode names keep verl's convention and refuse it.
"""

from __future__ import annotations

import math

import torch

from lossagg.config import LossAggregationConfig
from lossagg.dtypes import MASK_DTYPES, VALUE_DTYPES, VALUE_DTYPES_TEXT, values_dtype_error
from lossagg.integrations.verl_trainer import check_carried, plan_of_batch
from lossagg.layout import token_counts
from lossagg.messages import short_repr
from lossagg.modes import MODES, divisor_for, mode_spellings
from lossagg.step import StepPlan, gradient_scale
from lossagg.totals import DEFAULT_EMPTY_SAMPLES, EMPTY_SAMPLES
from lossagg.validate import as_int, as_number, as_tensor, weight_violation, zero_one_violation

VERL_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def _at(index: tuple[int, ...]) -> str:
    return "loss_mask[" + ", ".join(map(str, index)) + "]"


def _check_weights(loss_mask: torch.Tensor) -> None:
    """A verl mode reads the mask as weights (verl's masked_sum multiplies by it): any finite
    value >= 0 is a weight. A negative one is refused rather than followed: with it verl's
    token total can be 0 or below (and verl divides by it), and its seq-mean modes drop a
    row whose sum is <= 0 although some of its tokens weigh more than 0."""
    found = weight_violation(loss_mask)
    if found is not None:
        raise ValueError(
            f"loss_mask must hold finite weights >= 0 (verl's modes multiply each token's loss by its mask entry), "
            f"got {found[0]!r} at {_at(found[1])}"
        )


def _check_zero_one(loss_mask: torch.Tensor, mode: str) -> None:
    """lossagg's modes build d[i] from token counts (mask entries that are non-zero), while
    the numerator multiplies by the mask: only a 0/1 mask makes the two agree."""
    found = zero_one_violation(loss_mask)
    if found is not None:
        raise ValueError(
            f"loss_agg_mode={mode} needs a 0/1 loss_mask, got {found[0]!r} at {_at(found[1])}: lossagg's modes count tokens "
            "(d[i] is built from how many entries are non-zero), while verl's mode names (token-mean, seq-mean-token-mean, ...) "
            "treat a fractional mask as a weight"
        )


def _verl_sum(loss_mask: torch.Tensor, what: str, **kwargs) -> torch.Tensor:
    """``loss_mask.sum(...)`` as verl divides by it: in the mask's own dtype (an int64 sum for
    bool and integer masks), so that every divisor is verl's. A half-precision sum that
    overflows would make verl divide by inf; refused instead."""
    total = loss_mask.sum(**kwargs)
    if total.is_floating_point() and not bool(torch.isfinite(total).all()):
        raise ValueError(f"loss_mask's {what} overflows its dtype {loss_mask.dtype} (verl sums the mask in its own dtype): pass a float32 loss_mask")
    return total


def _tolerance(loss_mask: torch.Tensor) -> float:
    """How far a trainer's step total may fall below this micro-batch's own sum and still be
    taken for it: 0 for bool and integer masks (exact), the rounding of a floating sum else."""
    return max(torch.finfo(loss_mask.dtype).eps, 1e-6) if loss_mask.is_floating_point() else 0.0


def _verl_denoms(loss_mask, mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) -> tuple[torch.Tensor, float | None]:
    """``(d, after)``: d[i] (float64 [bs]) such that ``dp_size · sum_i (sum_t m*l) / d[i]``, divided by
    ``after`` when it is not None, is verl's loss for this mode (verl 0.9.1,
    ``verl/trainer/ppo/core_algos.py: agg_loss``, numerators by ``verl/utils/torch_functional.py:
    masked_sum``). The mask is a weight; every total verl takes from it is its sum (not a count)."""
    bs = loss_mask.shape[0]
    device = loss_mask.device
    ones = torch.ones(bs, dtype=torch.float64, device=device)
    if mode == "token-sum":
        return ones, None
    if mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            total = float(_verl_sum(loss_mask, "sum"))
        else:
            # the step's mask sum: at least this micro-batch's own (up to the rounding of a floating sum)
            total = as_number("batch_num_tokens", batch_num_tokens, positive=False)
            local = float(loss_mask.sum(dtype=torch.float64))
            if total < local * (1.0 - _tolerance(loss_mask)):
                raise ValueError(
                    f"batch_num_tokens (the step's loss_mask sum, its valid tokens for a 0/1 mask) must be >= this micro-batch's {local:g}, "
                    f"got {batch_num_tokens!r}"
                )
        # A total of 0 means every weight is 0 (none is negative): the loss is 0, not verl's 0/0.
        # A fractional total below 1 is kept: verl divides by it.
        return ones * (total if total > 0 else 1.0), None
    # verl counts a sequence when its mask sums to more than 0 (an overflowed sum, inf, counts too)
    local_sequences = int((loss_mask.sum(-1) > 0).sum())
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        batch = float(local_sequences)
    else:
        batch = float(as_int("global_batch_size", global_batch_size, minimum=0))
        if batch < local_sequences:
            raise ValueError(
                f"global_batch_size (the step's sequences) must be >= this micro-batch's {local_sequences} sequences whose loss_mask "
                f"sums to more than 0, got {global_batch_size!r}"
            )
    batch = max(batch, 1.0)
    if mode == "seq-mean-token-sum":
        return ones * batch, None
    if mode == "seq-mean-token-sum-norm":
        scale = _padded_width(loss_mask) if loss_scale_factor is None else as_number("loss_scale_factor", loss_scale_factor)
        d = batch * float(scale)
        if math.isfinite(d) and d > 0:
            return ones * d, None
        # verl divides in two steps (by the batch, then by loss_scale_factor), so its loss stays
        # finite where one divisor would leave float64; only then are the two steps taken here,
        # so every other case keeps its bits
        return ones * batch, float(scale)
    # seq-mean-token-mean: each sequence's weighted token mean, verl's "+ 1e-8" in the mask's sum dtype
    row_sums = _verl_sum(loss_mask, "sum over a row", dim=-1)
    per_sequence = (row_sums + 1e-8).to(torch.float64)
    # a row of zero weights adds 0 whatever its divisor; 1e-8 can vanish in a half-precision sum
    per_sequence = torch.where(per_sequence > 0, per_sequence, torch.ones_like(per_sequence))
    return per_sequence * batch, None


def _padded_width(loss_mask: torch.Tensor) -> int:
    """verl's default divisor (``loss_scale_factor``): the padded width; an empty width has no
    tokens, so any divisor gives 0."""
    return max(loss_mask.shape[-1], 1)


def _lossagg_plan(loss_mask, mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor, group_index, empty_samples, session_index=None):
    """The plan of a lossagg mode: the micro-batch alone when it is the whole step, else from verl's global-batch arguments."""
    spec = MODES[mode]
    convention = DEFAULT_EMPTY_SAMPLES if empty_samples is None else empty_samples
    if not isinstance(convention, str) or convention not in tuple(EMPTY_SAMPLES):  # named before any total is asked for
        raise ValueError(f"empty_samples must be one of {', '.join(map(repr, EMPTY_SAMPLES))}, got {short_repr(empty_samples)}")
    given = None if loss_scale_factor is None else as_number("loss_scale_factor", loss_scale_factor)
    divisor = divisor_for(spec, given, _padded_width(loss_mask))
    config = LossAggregationConfig(mode=mode, empty_samples=convention, **({} if divisor is None else {"divisor": divisor}))
    if dp_size > 1 or batch_num_tokens is not None or global_batch_size is not None:
        check_carried(config, dp_size, global_batch_size, batch_num_tokens)  # named before the mask is read
    _check_zero_one(loss_mask, mode)
    counts = token_counts(loss_mask)
    return plan_of_batch(
        config,
        counts,
        dp_size=dp_size,
        global_batch_size=global_batch_size,
        batch_num_tokens=batch_num_tokens,
        group_index=group_index,
        session_index=session_index,
    )


def _mode_name(loss_agg_mode: object) -> object:
    """The mode ``loss_agg_mode`` names, spelled as the adapter looks it up: ``-`` and ``_`` count
    as the same, case and surrounding spaces are ignored (lossagg.modes.mode_spellings, as the
    config reads names); a lossagg mode's own name is looked up first (``token_mean`` is lossagg's,
    ``token-mean`` verl's), then verl's names, then lossagg's with ``_`` for ``-``. Anything else
    is returned as given (and refused)."""
    if loss_agg_mode in VERL_MODES or not isinstance(loss_agg_mode, str):
        return loss_agg_mode
    spellings = mode_spellings(loss_agg_mode)
    if spellings[0] in MODES:
        return spellings[0]
    for spelling in spellings:
        if spelling in VERL_MODES:
            return spelling
    return next((spelling for spelling in spellings if spelling in MODES), loss_agg_mode)


def _readable(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as lossagg's op reads it. An expanded view (verl's callers broadcast advantages or
    masks) is materialised: verl's own ``loss_mat * loss_mask`` is a full-size tensor too."""
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}: pass {name}.to_dense()")
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
        return t.contiguous()
    return t


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
    empty_samples: str | None = None,
    session_index: torch.Tensor | None = None,
):
    """verl's ``agg_loss``: ``loss_mat`` and ``loss_mask`` are ``(bs, response_length)``.

    Returns a 0-dim tensor, differentiable in ``loss_mat``. ``loss_agg_mode`` is one of
    verl's modes (:data:`VERL_MODES`), where ``loss_mask`` is a weight (bool, integer or
    floating, finite and >= 0), or one of lossagg's (``group_index`` for ``prompt_mean``,
    ``session_index`` for a mode with sessions,
    ``empty_samples`` for how samples without a loss token count, the config's setting),
    where it must be 0/1. ``-`` and ``_`` count as the same in either's names
    (``seq_mean_token_mean`` is verl's ``seq-mean-token-mean``); ``token_mean`` is lossagg's.
    """
    as_tensor("loss_mat", loss_mat)
    as_tensor("loss_mask", loss_mask)
    if loss_mat.dim() != 2 or tuple(loss_mask.shape) != tuple(loss_mat.shape):
        raise ValueError(f"loss_mat and loss_mask must both be (bs, response_length), got {tuple(loss_mat.shape)} and {tuple(loss_mask.shape)}")
    # what lossagg's reduce op reads (lossagg/dtypes.py): anything else would be refused by the op
    # under its own argument names (values, mask), so it is refused here under the user's
    if loss_mat.dtype not in VALUE_DTYPES:
        raise TypeError(values_dtype_error("loss_mat", loss_mat.dtype, "a floating tensor"))
    if loss_mask.dtype not in MASK_DTYPES:
        raise TypeError(
            f"loss_mask must be a bool, integer (uint8, int8/16/32/64) or floating ({VALUE_DTYPES_TEXT}) tensor, got dtype {loss_mask.dtype}"
        )
    if loss_mask.device != loss_mat.device:
        raise ValueError(f"loss_mask must be on the device of loss_mat ({loss_mat.device}), got {loss_mask.device}")
    loss_mat = _readable("loss_mat", loss_mat)
    loss_mask = _readable("loss_mask", loss_mask)
    dp_size = as_int("dp_size", dp_size, minimum=1)
    after = None
    loss_agg_mode = _mode_name(loss_agg_mode)
    if loss_agg_mode in VERL_MODES:
        if empty_samples is not None:
            raise ValueError(
                f"empty_samples applies to lossagg's modes, got empty_samples={empty_samples!r} with verl's loss_agg_mode={loss_agg_mode!r}, "
                "which keeps verl's own convention (its seq-mean modes count the sequences whose loss_mask sums to more than 0 when no "
                "global_batch_size is given, and take global_batch_size as given otherwise): drop it, or use a lossagg mode"
            )
        _check_weights(loss_mask)
        d, after = _verl_denoms(loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
        plan = StepPlan.from_denoms(d.to(loss_mat.device))
    elif loss_agg_mode in MODES:
        plan = _lossagg_plan(
            loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor, group_index, empty_samples, session_index
        )
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode!r}; expected one of {', '.join(VERL_MODES + tuple(MODES))}")
    # the step's J on this micro-batch, times dp_size: DDP and FSDP average the gradients over the DP ranks
    loss = plan.loss(loss_mat, plan.micro_batch(slice(None), loss_mask)) * gradient_scale("mean", dp_size=dp_size)
    return loss if after is None else loss / after


# verl's trainer, whole: its losses with every term on a lossagg mode, and install() (docs/trainers/verl.md)
from lossagg.integrations.verl_trainer import (  # noqa: E402
    actor_loss,
    critic_loss,
    distillation_ppo_loss,
    install,
    lossagg_trainer,
    plan_batch,
    ppo_loss,
    value_loss,
)

__all__ = [
    "VERL_MODES",
    "agg_loss",
    "actor_loss",
    "critic_loss",
    "distillation_ppo_loss",
    "install",
    "lossagg_trainer",
    "plan_batch",
    "ppo_loss",
    "value_loss",
]
