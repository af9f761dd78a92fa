"""Sequence-level objectives, exact under any micro-batch x DP x CP split (docs/sequence.md).

GSPO, GMPO and LUSPO weigh a sample by one ratio, a function of the mean of its tokens' log
ratios; so each needs, per sample, a sum or a mean over the sample's loss tokens. A sample
lies whole in one micro-batch of one DP rank, but context parallel (CP) spreads its tokens
over the CP ranks. :func:`sequence_sum` and :func:`sequence_mean` take the per-sample sums of
a CP rank's own tokens (:func:`lossagg.segment_sum`, CPU and CUDA) and add them over the CP
group with an all-reduce whose backward all-reduces the gradient: every CP rank holds the
sample's whole sum, and each token's log-probability receives the gradient of every rank's use
of it. Everything after the sum is per sample, so each rank's per-token loss equals the unsplit
one on the tokens it holds, and :meth:`lossagg.StepPlan.loss` adds the contributions up to J.

The objectives (``SEQUENCE_OBJECTIVES``: GSPO, GMPO, LUSPO, CISPO) are each a per-token loss
function and the aggregation mode that makes J the objective's; :func:`sequence_loss` is one
micro-batch's contribution, for a plan of that mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist

from lossagg.config import LossAggregationConfig
from lossagg.ops import segment_sum
from lossagg.step import StepPlan
from lossagg.validate import as_number, check_cu_seqlens, check_holds_data, check_process_group

__all__ = [
    "SEQUENCE_OBJECTIVES",
    "SequenceObjective",
    "all_reduce_sum",
    "broadcast_to_tokens",
    "cispo_token_loss",
    "gmpo_token_loss",
    "gspo_token_loss",
    "luspo_token_loss",
    "objective_config",
    "sequence_loss",
    "sequence_mean",
    "sequence_sum",
]


# ----------------------------------------------------------------- the CP collective
class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; its backward is the same sum of the incoming gradients (the
    gradient of ``y = sum_r x_r`` held on every rank, with respect to each ``x_r``, is the sum
    of the gradients every rank sends back to ``y``). The backward calls this function again,
    so double backward is exact too."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllReduceSum.apply(grad.contiguous(), ctx.group), None


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` summed over the ranks of ``group`` (a new tensor), differentiable: the
    gradient is summed over the group the same way. ``group`` None: ``tensor`` itself (one rank).

    Every rank of the group must call it, and must backpropagate through it, in the same order.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    group = check_process_group(group, "group", "the group of ranks to sum over")
    return tensor if group is None else _AllReduceSum.apply(tensor, group)


# ------------------------------------------------------------- per-sample reductions
def _token_dims(cu_seqlens) -> int:
    return 1 if cu_seqlens is not None else 2


def sequence_sum(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, cp_group=None) -> torch.Tensor:
    """Per-sample masked sums over the whole sample, ``out[k, i] = sum_{t in i} m[t] * values[k, t]``,
    across the CP group.

    ``values``, ``mask`` and ``cu_seqlens`` are this CP rank's tokens in either layout of
    :func:`lossagg.segment_sum` (packed ``[T]`` / ``[K, T]`` with ``cu_seqlens``, padded ``[B, T]`` /
    ``[K, B, T]`` without); every CP rank of the group holds the same samples. Returns ``[B]``
    (or ``[K, B]``), float32 (float64 for float64 values), the same on every CP rank, and
    differentiable in ``values`` (the gradient of a rank's use of a sum reaches the tokens of
    every rank).
    """
    group = check_process_group(cp_group, "cp_group", "the CP group of this rank")
    sums = segment_sum(values, mask, cu_seqlens)
    return sums if group is None else _AllReduceSum.apply(sums, group)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, cp_group=None) -> torch.Tensor:
    """Per-sample masked means over the whole sample, across the CP group:
    ``sum_t m[t] * values[k, t] / max(sum_t m[t], 1)`` (0 for a sample without loss tokens).

    A fractional mask is a weight, as in TRL and verl (the divisor is the sum of the mask).
    The sums and the token count travel in one all-reduce. Layouts, dtype and gradient as
    :func:`sequence_sum`.
    """
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    dims = _token_dims(cu_seqlens)
    if values.dim() not in (dims, dims + 1):
        layout = "packed (cu_seqlens given): [T] or [K, T]" if cu_seqlens is not None else "padded (cu_seqlens None): [B, T] or [K, B, T]"
        raise ValueError(f"values has shape {list(values.shape)}, which does not fit the {layout} layout")
    has_k = values.dim() == dims + 1
    rows = values if has_k else values.unsqueeze(0)
    sums = sequence_sum(torch.cat([rows, torch.ones_like(rows[:1])]), mask, cu_seqlens, cp_group=cp_group)
    means = sums[:-1] / sums[-1].clamp(min=1.0)
    return means if has_k else means[0]


def _num_samples(mask, cu_seqlens) -> int:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    check_holds_data("mask", mask)
    check_holds_data("cu_seqlens", cu_seqlens)
    if cu_seqlens is None:
        if mask.dim() != 2:
            raise ValueError(f"mask must be [B, T] when cu_seqlens is None (padded layout), got shape {list(mask.shape)}")
        return mask.shape[0]
    if mask.dim() != 1:
        raise ValueError(f"mask must be [T] when cu_seqlens is given (packed layout), got shape {list(mask.shape)}")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor [B+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.device.type == "cpu":  # read on the host; on an accelerator the ops check it (no host sync here)
        check_cu_seqlens(cu_seqlens, mask.shape[0])
    return cu_seqlens.shape[0] - 1


def broadcast_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """A ``[B]`` per-sample tensor repeated over each sample's tokens, in ``mask``'s layout
    (packed ``[T]`` with ``cu_seqlens``, padded ``[B, T]`` without); differentiable (the
    gradient of a sample is the sum over its tokens). No host sync on an accelerator."""
    b = _num_samples(mask, cu_seqlens)
    if not isinstance(per_sample, torch.Tensor):
        raise TypeError(f"per_sample must be a torch.Tensor, got {type(per_sample).__name__}")
    check_holds_data("per_sample", per_sample)
    if tuple(per_sample.shape) != (b,):
        raise ValueError(f"per_sample must be [B] = [{b}] (one value per sample of the micro-batch), got shape {list(per_sample.shape)}")
    if cu_seqlens is None:
        return per_sample.unsqueeze(1).expand(tuple(mask.shape)).contiguous()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=per_sample.device, dtype=torch.long)
    return torch.repeat_interleave(per_sample, lengths, dim=0, output_size=mask.shape[0])


# ------------------------------------------------------------------- the objectives
def _log_ratio(log_prob, old_log_prob, mask, cu_seqlens) -> tuple[torch.Tensor, int]:
    b = _num_samples(mask, cu_seqlens)
    for name, t in (("log_prob", log_prob), ("old_log_prob", old_log_prob)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
        if tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name} must have the token shape of mask {list(mask.shape)}, got shape {list(t.shape)}")
    return log_prob - old_log_prob, b


def _compute_dtype(log_prob) -> torch.dtype:
    return torch.promote_types(log_prob.dtype, torch.float32)


def _sample_advantages(advantages, b: int, dtype, device) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if tuple(advantages.shape) != (b,):
        raise ValueError(
            f"advantages must be [B] = [{b}], one advantage per sample of the micro-batch (a sequence-level objective), "
            f"got shape {list(advantages.shape)}"
        )
    if not (advantages.dtype.is_floating_point or advantages.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise TypeError(f"advantages must be real numbers, got dtype {advantages.dtype}")
    return advantages.to(dtype=dtype, device=device)


def _eps(name: str, value) -> float:
    return as_number(name, value, positive=False)


def gspo_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    eps_low: float,
    eps_high: float,
    cp_group=None,
) -> torch.Tensor:
    """GSPO's per-token loss on this CP rank's tokens: sample i's clipped sequence loss on each of its tokens.

    ``s_i = exp(mean_t m·(log_prob - old_log_prob))`` over the sample's loss tokens (across
    ``cp_group``), ``loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``.
    ``advantages`` is ``[B]`` (one per sample). Returns the token layout of ``mask``, in
    ``log_prob``'s dtype promoted to float32 at least. Reduce it with ``sample_mean`` for GSPO,
    with ``constant`` and divisor 1 for LUSPO (docs/sequence.md).
    """
    low, high = _eps("eps_low", eps_low), _eps("eps_high", eps_high)
    log_ratio, b = _log_ratio(log_prob, old_log_prob, mask, cu_seqlens)
    dtype = _compute_dtype(log_prob)
    adv = _sample_advantages(advantages, b, dtype, log_prob.device)
    mean_log_ratio = sequence_mean(log_ratio, mask, cu_seqlens, cp_group=cp_group).to(dtype)
    # -min(s A, clip(s) A) takes the clipped ratio, a constant, exactly where A > 0 and s > 1 + eps_high or
    # A < 0 and s < 1 - eps_low. There the unclipped s is not evaluated at all: exp of a large mean log
    # ratio overflows, and its inf times the 0 gradient of the branch not taken would be NaN.
    with torch.no_grad():
        s_seen = torch.exp(mean_log_ratio)
        takes_clip = ((adv > 0) & (s_seen > 1.0 + high)) | ((adv < 0) & (s_seen < 1.0 - low))
    ratio = torch.exp(torch.where(takes_clip, torch.zeros_like(mean_log_ratio), mean_log_ratio))
    bound = torch.where(adv > 0, adv.new_tensor(1.0 + high), adv.new_tensor(1.0 - low))
    loss = torch.where(takes_clip, -bound * adv, -ratio * adv)
    return broadcast_to_tokens(loss, mask, cu_seqlens)


#: LUSPO's per-token loss is GSPO's (:func:`gspo_token_loss`): LUSPO differs from GSPO in the reduction only, each
#: sample's loss counting once per loss token (mode ``constant``, divisor 1: ``J = (1/N) sum_i |y_i| loss_i``)
#: instead of once per sample (``sample_mean``).
luspo_token_loss = gspo_token_loss


def gmpo_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    eps_low: float,
    eps_high: float,
    cp_group=None,
) -> torch.Tensor:
    """GMPO's per-token loss on this CP rank's tokens: sample i's loss on each of its tokens.

    Each token's log ratio ``log r = log_prob - old_log_prob`` is clipped on the side its
    sample's advantage pushes it: at most ``eps_high`` when ``A_i > 0``, at least ``-eps_low``
    when ``A_i < 0`` (bounds in log space). The sample's ratio is the geometric mean of its
    clipped token ratios, ``g_i = exp(mean_t m·clipped log r)`` (across ``cp_group``), and
    ``loss_i = -A_i g_i``. ``advantages`` is ``[B]``. Reduce it with ``sample_mean``
    (``J = (1/N) sum_i loss_i`` over the samples with loss tokens). Dtype as :func:`gspo_token_loss`.
    """
    low, high = _eps("eps_low", eps_low), _eps("eps_high", eps_high)
    log_ratio, b = _log_ratio(log_prob, old_log_prob, mask, cu_seqlens)
    dtype = _compute_dtype(log_prob)
    adv = _sample_advantages(advantages, b, dtype, log_prob.device)
    token_adv = broadcast_to_tokens(adv, mask, cu_seqlens)
    log_ratio = log_ratio.to(dtype)
    clipped = torch.where(token_adv > 0, log_ratio.clamp(max=high), log_ratio)
    clipped = torch.where(token_adv < 0, log_ratio.clamp(min=-low), clipped)
    mean_clipped = sequence_mean(clipped, mask, cu_seqlens, cp_group=cp_group).to(dtype)
    # a sample with A = 0 has loss 0 and gradient 0, whatever its ratio (exp of a large mean would
    # overflow, and 0 * inf is NaN)
    ratio = torch.exp(torch.where(adv == 0, torch.zeros_like(mean_clipped), mean_clipped))
    return broadcast_to_tokens(-adv * ratio, mask, cu_seqlens)


def cispo_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    eps_low: float | None,
    eps_high: float,
    cp_group=None,
) -> torch.Tensor:
    """CISPO's per-token loss: ``-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log_prob_t`` with
    the token ratio ``r_t = exp(log_prob_t - old_log_prob_t)`` and no gradient through the
    clipped ratio (``eps_low`` None: no lower bound). A token-level objective: no per-sample
    reduction, so ``cp_group`` is accepted for a uniform call and not used. ``advantages`` is
    ``[B]`` (one per sample, as for the other objectives). Reduce it with
    ``token_mean`` (``J = sum_t m·loss_t / T``). Dtype as :func:`gspo_token_loss`.
    """
    low = None if eps_low is None else _eps("eps_low", eps_low)
    high = _eps("eps_high", eps_high)
    check_process_group(cp_group, "cp_group", "the CP group of this rank")
    log_ratio, b = _log_ratio(log_prob, old_log_prob, mask, cu_seqlens)
    dtype = _compute_dtype(log_prob)
    token_adv = broadcast_to_tokens(_sample_advantages(advantages, b, dtype, log_prob.device), mask, cu_seqlens)
    # the mask selects before the ratio is formed: a NaN or inf log-prob at a masked-out token gives it
    # weight 1 (finite), so its gradient there is 0 rather than NaN (reduce drops the token's value)
    kept = mask != 0
    log_ratio = torch.where(kept, log_ratio.detach(), torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))
    weight = torch.exp(log_ratio.to(dtype)).clamp(min=None if low is None else 1.0 - low, max=1.0 + high)
    return -weight * token_adv * log_prob.to(dtype)


# ------------------------------------------------------------- objectives and modes
@dataclass(frozen=True)
class SequenceObjective:
    """An objective: its per-token loss function and the mode (and divisor) whose J is the objective's."""

    name: str
    token_loss: Callable[..., torch.Tensor]
    mode: str
    divisor: float | None
    formula: str

    def config(self) -> LossAggregationConfig:
        return LossAggregationConfig(mode=self.mode, divisor=self.divisor)


SEQUENCE_OBJECTIVES = MappingProxyType(
    {
        "gspo": SequenceObjective("gspo", gspo_token_loss, "sample_mean", None, "(1/N) Σ_{i: M_i>0} -min(s_i A_i, clip(s_i, 1-εl, 1+εh) A_i)"),
        "gmpo": SequenceObjective("gmpo", gmpo_token_loss, "sample_mean", None, "(1/N) Σ_{i: M_i>0} -A_i exp(mean_t clip_A(log r))"),
        "luspo": SequenceObjective("luspo", luspo_token_loss, "constant", 1.0, "(1/N) Σ_i |y_i| · -min(s_i A_i, clip(s_i, 1-εl, 1+εh) A_i)"),
        "cispo": SequenceObjective("cispo", cispo_token_loss, "token_mean", None, "(1/T) Σ_i Σ_t -sg(clip(r_t, 1-εl, 1+εh)) A log π_t"),
    }
)


def _objective(objective) -> SequenceObjective:
    if not isinstance(objective, str) or objective not in SEQUENCE_OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(repr(n) for n in SEQUENCE_OBJECTIVES)}, got {objective!r}")
    return SEQUENCE_OBJECTIVES[objective]


def objective_config(objective: str) -> LossAggregationConfig:
    """The aggregation config whose J is ``objective``'s (build the step's :class:`lossagg.StepPlan` from it)."""
    return _objective(objective).config()


def sequence_loss(
    objective: str,
    plan: StepPlan,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    samples,
    cu_seqlens: torch.Tensor | None = None,
    *,
    eps_low: float | None,
    eps_high: float,
    cp_group=None,
) -> torch.Tensor:
    """One micro-batch's contribution to ``objective``'s J on this CP rank (a 0-dim tensor).

    ``plan`` is the step's :class:`lossagg.StepPlan`, of the objective's mode
    (:func:`objective_config`); ``samples`` the micro-batch's positions among the rank's samples
    (as in :meth:`lossagg.StepPlan.loss`); ``log_prob``, ``old_log_prob`` and ``mask`` this CP
    rank's tokens of the micro-batch; ``advantages`` its ``[B]`` per-sample advantages;
    ``cp_group`` the CP group (None without CP). The contributions of every micro-batch, DP rank
    and CP rank add up to J; multiply each by :func:`lossagg.gradient_scale` as usual.
    """
    spec = _objective(objective)
    if not isinstance(plan, StepPlan):
        raise TypeError(f"plan must be a lossagg.StepPlan, got {type(plan).__name__}")
    if plan.config.mode != spec.mode or (spec.divisor is not None and plan.config.divisor != spec.divisor):
        wanted = f"mode={spec.mode}" + (f", divisor={spec.divisor:g}" if spec.divisor is not None else "")
        got = f"mode={plan.config.mode}" + (f", divisor={plan.config.divisor:g}" if plan.config.divisor is not None else "")
        raise ValueError(
            f"plan must reduce by {wanted} for objective={spec.name!r} (J = {spec.formula}), got a plan of {got}: "
            f"build it from lossagg.objective_config({spec.name!r})"
        )
    per_token = spec.token_loss(log_prob, old_log_prob, advantages, mask, cu_seqlens, eps_low=eps_low, eps_high=eps_high, cp_group=cp_group)
    return plan.loss(per_token, mask, samples, cu_seqlens)
