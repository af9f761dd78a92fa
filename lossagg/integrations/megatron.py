"""The loss function a Megatron-style ``forward_step`` returns, built on a :class:`lossagg.StepPlan`.

Megatron's schedule calls ``loss_func(output_tensor)`` once per micro-batch and then:

* ``calculate_per_token_loss`` off: multiplies the returned loss by the CP size and divides
  it by the number of micro-batches, and the data-parallel gradient reduction averages over
  DP×CP (so CP cancels: the factor is ``num_micro_batches × dp_size``);
* ``calculate_per_token_loss`` on: keeps the loss as returned, sums gradients over DP×CP
  and divides them by the sum of the ``num_tokens`` every micro-batch returned.

:func:`make_loss_func` returns a ``loss_func`` whose result, after either treatment, makes
the final gradient the gradient of the step scalar J of the plan's mode, on any split::

    loss_func = make_loss_func(plan, samples, cu_seqlens, loss_mask,
                               num_micro_batches=num_microbatches, dp_size=dp, cp_size=cp,
                               calculate_per_token_loss=args.calculate_per_token_loss)
    return output_tensor, functools.partial(loss_func)   # in forward_step

With a filter inside the loss (denominators known only after the forward: docs/composition.md,
"Filters inside the loss"), ``plan`` is a :class:`lossagg.DeferredPlan` and ``keep(output_tensor,
loss_mask)`` returns the micro-batch's final mask; after the schedule, ``plan.close().apply_(model)``
rescales Megatron's gradient buffers (``calculate_per_token_loss`` off).

Everything about the mode, ``empty_samples`` included, comes from the plan's config
(``plan.config``; a NeMo-RL-style ``global_valid_seqs`` goes to
``StepPlan.from_totals(..., num_nonempty_samples=...)`` with ``empty_samples: skip``).

``output_tensor`` is the per-token loss of this micro-batch on this rank (packed ``[T]``
with ``cu_seqlens``, or padded ``[B, T]``). With a plan whose config has ``terms``
(docs/terms.md) it is a mapping of every term's per-token values by name (``"pg"`` and the
config's terms), and the returned loss is the whole ``J = Σ_k c_k J_k``, every term on its own
reducer. The reports are this micro-batch's contributions (sum them over micro-batches and
ranks for the step's value): ``pg_loss``, ``<term>_loss`` for each other term (its ``J_k``,
before its coefficient), and the default-reducer value of each metric in ``metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from lossagg.deferred import DeferredPlan
from lossagg.step import StepPlan, gradient_scale
from lossagg.validate import as_int, as_tensor, zero_one_violation


def _check_zero_one(name: str, mask) -> None:
    """A 0/1 mask (bool, integer or floating). The plan's ``d[i]`` and ``T`` and the reported
    ``num_tokens`` are token counts, while Megatron's own per-token loss divides by
    ``loss_mask.sum()``, a weight sum: with a fractional mask the two would silently differ.
    Reads the mask (one host sync for a non-bool mask on an accelerator)."""
    as_tensor(name, mask)
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool, integer or floating tensor of 0s and 1s, got dtype {mask.dtype}")
    found = zero_one_violation(mask)
    if found is not None:
        value, index = found
        where = ", ".join(map(str, index))
        raise ValueError(
            f"{name} must hold 0s and 1s, got {value!r} at {name}[{where}]: the plan's d[i] and the num_tokens reported to "
            "Megatron are token counts, while a fractional mask would weigh the token's loss (Megatron's own per-token loss divides "
            "by loss_mask.sum(), a weight sum)"
        )


def make_loss_func(
    plan: StepPlan | DeferredPlan,
    samples,
    cu_seqlens: torch.Tensor | None,
    loss_mask: torch.Tensor,
    *,
    num_micro_batches: int,
    dp_size: int = 1,
    cp_size: int = 1,
    calculate_per_token_loss: bool = False,
    rollout_mask: torch.Tensor | None = None,
    metrics: dict[str, torch.Tensor] | None = None,
    keep: Callable[[object, torch.Tensor], torch.Tensor] | None = None,
) -> Callable[[torch.Tensor], tuple]:
    """``loss_func(output_tensor)`` in Megatron's convention (see the module docstring).

    With ``calculate_per_token_loss`` the returned ``num_tokens`` is this shard's count of
    rollout-mask tokens (``rollout_mask``, default ``loss_mask``), so that Megatron's sum of
    them over the step is the plan's ``T``.

    ``loss_mask`` and ``rollout_mask`` must be 0/1 (bool, integer or floating): the plan
    counts tokens, so a fractional weight is refused, naming the mask and the entry.

    ``keep(output_tensor, loss_mask)``, a filter inside the loss, returns the final mask of the
    micro-batch (a 0/1 tensor of ``loss_mask``'s shape); it needs a :class:`lossagg.DeferredPlan`,
    which takes its counts from that final mask.
    """
    num_micro_batches = as_int("num_micro_batches", num_micro_batches, minimum=1)
    dp_size = as_int("dp_size", dp_size, minimum=1)
    cp_size = as_int("cp_size", cp_size, minimum=1)
    deferred = isinstance(plan, DeferredPlan)
    if not isinstance(plan, (StepPlan, DeferredPlan)):
        raise TypeError(f"plan must be a lossagg.StepPlan or lossagg.DeferredPlan, got {type(plan).__name__}")
    if keep is not None and not callable(keep):
        raise TypeError(
            f"keep must be a function keep(output_tensor, loss_mask) returning the micro-batch's final mask, got {type(keep).__name__} {keep!r}"
        )
    if keep is not None and not deferred:
        raise TypeError(
            "keep= filters the mask inside the loss, after the forward: the counts are then known only as the step runs, which "
            f"needs a lossagg.DeferredPlan, got a {type(plan).__name__} (whose denominators come from the rollout masks)"
        )
    if deferred and calculate_per_token_loss:
        raise ValueError(
            "calculate_per_token_loss=True divides the gradients by the step's tokens as the micro-batches report them, before the "
            "final counts are known: with a DeferredPlan turn it off (the plan's rescale after the step gives every mode's J)"
        )
    _check_zero_one("loss_mask", loss_mask)
    if rollout_mask is not None:
        _check_zero_one("rollout_mask", rollout_mask)
        if tuple(rollout_mask.shape) != tuple(loss_mask.shape):
            raise ValueError(f"rollout_mask must have the shape of loss_mask {tuple(loss_mask.shape)}, got {tuple(rollout_mask.shape)}")
    if calculate_per_token_loss:
        local_tokens = ((loss_mask if rollout_mask is None else rollout_mask) != 0).sum()  # no host sync
        if "total_tokens" not in plan.totals:  # (a DeferredPlan was refused above)
            raise ValueError(
                "calculate_per_token_loss=True scales by the step's rollout tokens T: pass total_tokens= to StepPlan.from_totals "
                f"(this plan of mode={plan.config.mode} holds {', '.join(plan.totals)})"
            )
        scale = plan.totals.total_tokens
    else:
        scale = gradient_scale("megatron", dp_size=dp_size, cp_size=cp_size, num_micro_batches=num_micro_batches)

    def loss_func(output_tensor):
        final_mask = loss_mask
        if keep is not None:
            final_mask = keep(output_tensor, loss_mask)
            _check_zero_one("the mask keep() returned", final_mask)
            if tuple(final_mask.shape) != tuple(loss_mask.shape):
                raise ValueError(f"keep() must return a mask of loss_mask's shape {tuple(loss_mask.shape)}, got {tuple(final_mask.shape)}")
        if plan.config.terms and not isinstance(output_tensor, Mapping):
            raise TypeError(
                f"the plan's config has the terms {', '.join(plan.config.terms)}: output_tensor must be a mapping of every term's "
                f"per-token values by name ('pg' and those), got {type(output_tensor).__name__}"
            )
        mb = plan.micro_batch(samples, final_mask, cu_seqlens)
        # each term's J_k (a DeferredPlan's before the step's rescale: DeferredStep.terms holds the final ones)
        contribution, parts = plan.loss(output_tensor, mb, parts=True)
        report = {f"{name}_loss": value for name, value in parts.items()}
        if metrics:
            report.update(plan.metrics(metrics, mb))
        if calculate_per_token_loss:
            return contribution * scale, local_tokens.to(torch.int64), report
        return contribution * scale, report

    return loss_func
