"""A split-invariance harness that frameworks can call in their own CI.

``check_split_invariance`` takes one step's batch, a config and a split (micro-batches
per DP rank, DP size, CP size), composes the loss the way a distributed trainer would
(each DP rank's samples cut into micro-batches, each micro-batch's tokens sharded over
CP ranks in the zigzag layout, global denominators from one :class:`StepPlan` per DP
rank) in one process, and checks that the composed loss and its gradient equal the
unsplit float64 reference ``J``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lossagg.config import LossAggregationConfig
from lossagg.context_parallel import zigzag_local_cu_seqlens, zigzag_shard
from lossagg.layout import cu_seqlens_from_lengths
from lossagg.modes import ReferenceInputs, mode_spec
from lossagg.step import StepPlan
from lossagg.totals import TOTALS


@dataclass
class InvarianceReport:
    reference: float
    composed: float
    max_grad_error: float
    ok: bool

    def __str__(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        return f"{verdict}: J reference {self.reference:.10g}, composed {self.composed:.10g}, max |grad error| {self.max_grad_error:.3g}"


def reference_loss(
    config: LossAggregationConfig,
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group_index: torch.Tensor | None = None,
    rollout_mask: torch.Tensor | None = None,
    session_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """J of the mode (docs/modes.md) in float64, from the mode's own formula (a loop over samples, for clarity).

    Under ``config.empty_samples == "skip"`` it is the mode's formula over the step without its
    empty samples (no rollout token; docs/modes.md, "Empty samples"), 0 when none is left. A
    sample with loss tokens but no rollout token has no such reading and is refused, naming it.

    Raises ValueError for a mode without an entry in :data:`lossagg.modes.MODES`, and for a config
    with ``terms`` or a ``weighting`` (this is the PG term's reference; tests/test_terms.py composes
    a whole loss from one reference per term).
    """
    spec = mode_spec(config.mode)
    if hasattr(config, "check_single_term"):  # a LossAggregationConfig (a plain namespace of settings has neither)
        config.check_single_term("lossagg.testing.reference_loss")
    rollout_mask = mask if rollout_mask is None else rollout_mask
    cu = cu_seqlens.tolist()
    n = len(cu) - 1
    if n == 0:
        return torch.zeros((), dtype=torch.float64)
    v = values.to(torch.float64)
    w = mask.to(torch.float64)
    contrib = torch.where(w != 0, v * w, torch.zeros((), dtype=torch.float64))
    numerators = [contrib[cu[i] : cu[i + 1]].sum() for i in range(n)]
    counts = [float((rollout_mask[cu[i] : cu[i + 1]] != 0).sum()) for i in range(n)]
    if spec.needs_groups and group_index is None:
        raise ValueError(f"reference_loss: mode={spec.name} needs group_index")
    if spec.needs_sessions and session_index is None:
        raise ValueError(f"reference_loss: mode={spec.name} needs session_index")
    groups = None if group_index is None else [int(g) for g in torch.as_tensor(group_index).tolist()]
    sessions = None if session_index is None else [int(s) for s in torch.as_tensor(session_index).tolist()]
    if config.empty_samples == "skip":
        kept = [i for i in range(n) if counts[i] > 0]
        for i in range(n):
            if counts[i] == 0 and bool((w[cu[i] : cu[i + 1]] != 0).any()):
                raise ValueError(f"reference_loss with empty_samples=skip: sample {i} has loss tokens (mask) but no rollout token (rollout_mask)")
        if not kept:
            return sum(numerators) * 0.0  # every sample is left out: J = 0 (differentiable, zero gradients)
        numerators, counts = [numerators[i] for i in kept], [counts[i] for i in kept]
        groups = None if groups is None else [groups[i] for i in kept]
        sessions = None if sessions is None else [sessions[i] for i in kept]
    return torch.as_tensor(spec.reference(ReferenceInputs(numerators, counts, groups, config.divisor, sessions)), dtype=torch.float64)


def rank_totals(
    config: LossAggregationConfig,
    token_counts: torch.Tensor,
    samples,
    group_index: torch.Tensor | None = None,
    session_index: torch.Tensor | None = None,
) -> dict[str, object]:
    """The ``StepPlan.from_totals`` keywords of a rank holding ``samples`` of a step.

    ``token_counts`` (and ``group_index``) are those of every sample of the step: what a
    trainer that knows the whole step (verl's ``global_batch_size`` and ``batch_num_tokens``,
    a rollout side that counted every response) hands each rank. Holds every total the plan of
    ``config``'s mode has, so it serves any registered mode.
    """
    plan = StepPlan(config, token_counts, group_index=group_index, session_index=session_index)
    own = torch.as_tensor(samples)
    return {name: (value[own] if TOTALS[name].per_sample else value) for name, value in plan.totals.items()}


def check_split_invariance(
    config: LossAggregationConfig,
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    group_index: torch.Tensor | None = None,
    session_index: torch.Tensor | None = None,
    rollout_mask: torch.Tensor | None = None,
    micro_batches: int = 2,
    dp_size: int = 2,
    cp_size: int = 1,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> InvarianceReport:
    """Compose J over a (micro-batch, DP, CP) split and compare loss and gradient to the reference.

    ``values`` is the packed ``[T]`` per-token loss (a leaf or not; the gradient is taken
    with respect to it). Samples go to DP ranks in contiguous blocks, then to
    micro-batches in contiguous blocks, as trainers usually cut them.
    """
    if hasattr(config, "check_single_term"):
        config.check_single_term("lossagg.testing.check_split_invariance")
    rollout_mask = mask if rollout_mask is None else rollout_mask
    leaf = values.detach().clone().requires_grad_(True)
    n = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = torch.stack([(rollout_mask[cu_seqlens[i] : cu_seqlens[i + 1]] != 0).sum() for i in range(n)]) if n else torch.zeros(0)

    ref_leaf = values.detach().clone().to(torch.float64).requires_grad_(True)
    ref = reference_loss(config, ref_leaf, mask, cu_seqlens, group_index, rollout_mask, session_index)
    if ref.requires_grad:
        ref.backward()
    ref_grad = ref_leaf.grad if ref_leaf.grad is not None else torch.zeros_like(ref_leaf)

    composed = torch.zeros((), dtype=torch.float64)
    # Each DP rank's StepPlan learns the step totals through one all-reduce; in one
    # process the plan of the whole step gives every rank the same numbers.
    plan = StepPlan(config, counts, group_index=group_index, session_index=session_index)
    for own in torch.tensor_split(torch.arange(n), dp_size):
        for mb in torch.tensor_split(own, micro_batches):
            if mb.numel() == 0:
                continue
            idx = torch.cat([torch.arange(int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in mb.tolist()])
            mb_cu = cu_seqlens_from_lengths(lengths[mb], dtype=cu_seqlens.dtype)
            mb_values = leaf[idx]
            mb_mask = mask[idx]
            for cp_rank in range(cp_size):
                if cp_size > 1:
                    local_values = zigzag_shard(mb_values, mb_cu, cp_size, cp_rank)
                    local_mask = zigzag_shard(mb_mask, mb_cu, cp_size, cp_rank)
                    local_cu = zigzag_local_cu_seqlens(mb_cu, cp_size)
                else:
                    local_values, local_mask, local_cu = mb_values, mb_mask, mb_cu
                composed = composed + plan.loss(local_values, local_mask, mb, local_cu).to(torch.float64)
    if composed.requires_grad:
        composed.backward()
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    max_err = float((grad.to(torch.float64) - ref_grad).abs().max()) if grad.numel() else 0.0
    ok = bool(
        torch.allclose(composed.detach(), ref.detach(), rtol=rtol, atol=atol)
        and torch.allclose(grad.to(torch.float64), ref_grad, rtol=rtol, atol=atol)
    )
    return InvarianceReport(float(ref.detach()), float(composed.detach()), max_err, ok)
