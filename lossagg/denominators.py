"""Per-sample global denominators ``d[i]`` (``sample_denoms``) of SPEC §3.

``d[i]`` is made of step totals (``N``, ``P``, ``T``, ``Sg``) and the sample's own token
count; which ones, for each mode, is the mode's entry in :mod:`lossagg.modes`.
:class:`lossagg.StepPlan` is the one planner that gathers those totals (locally, or with
one all-reduce over the DP group) and calls :func:`denoms_from_totals`; the helpers
here validate its inputs and compute group sums. Everything is vectorised and float64.
"""

from __future__ import annotations

import math

import torch

from lossagg.modes import DenomInputs, StepTotals, mode_spec


def _as_tensor(name: str, value, what: str, device=None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value if device is None else value.to(device)
    try:
        return torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}") from None


def check_token_counts(token_counts) -> torch.Tensor:
    """``M[i]`` as a float64 ``[N]`` tensor; real, finite and >= 0."""
    counts = _as_tensor("token_counts", token_counts, "a 1-D tensor of per-sample token counts")
    if counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(f"token_counts must hold real numbers (token counts), got dtype {counts.dtype}")
    if counts.dim() != 1:
        raise ValueError(f"token_counts must be a 1-D [N] tensor of per-sample token counts, got shape {tuple(counts.shape)}")
    if counts.is_floating_point() and not torch.isfinite(counts).all():
        raise ValueError("token_counts must be finite")
    if counts.numel() and counts.min() < 0:
        raise ValueError("token_counts must be >= 0")
    return counts.to(torch.float64)


def check_group_index(group_index, num_samples: int, device=None) -> torch.Tensor:
    """``group_index`` validated: present (required under prompt_mean), one integer per sample."""
    if group_index is None:
        raise ValueError(
            "group_index is required under mode=prompt_mean: every sample needs the index of its prompt group "
            "(samples without one are never grouped silently)"
        )
    group_index = _as_tensor(
        "group_index", group_index, "a 1-D tensor of integer prompt-group indices (map prompt ids such as strings to integers first)", device
    )
    if group_index.dim() != 1 or group_index.shape[0] != num_samples:
        raise ValueError(f"group_index must be a 1-D tensor with one entry per sample (N = {num_samples}), got shape {tuple(group_index.shape)}")
    if group_index.is_floating_point() or group_index.is_complex() or group_index.dtype == torch.bool:
        raise TypeError(f"group_index must hold integers, got dtype {group_index.dtype}")
    return group_index


def check_group_sizes(labels: torch.Tensor, sizes: torch.Tensor, n_samples_per_prompt: int | None) -> None:
    """Every group present in the step holds exactly ``n_samples_per_prompt`` samples."""
    if n_samples_per_prompt is None:
        return
    wrong = (sizes > 0) & (sizes != n_samples_per_prompt)
    if wrong.any():
        first = int(torch.nonzero(wrong)[0, 0])
        raise ValueError(
            f"prompt_mean needs whole prompt groups of n_samples_per_prompt = {n_samples_per_prompt} samples in "
            f"the step; group {int(labels[first])} has {int(sizes[first])} sample(s) "
            f"({int(wrong.sum())} group(s) of the wrong size)"
        )


def group_totals(token_counts: torch.Tensor, dense_group: torch.Tensor, num_labels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(samples, rollout tokens) of each group label ``0..num_labels-1`` (float64 ``[num_labels]`` each)."""
    sizes = torch.zeros(num_labels, dtype=torch.float64, device=token_counts.device)
    sizes.index_add_(0, dense_group, torch.ones_like(token_counts))
    sums = torch.zeros(num_labels, dtype=torch.float64, device=token_counts.device).index_add_(0, dense_group, token_counts)
    return sizes, sums


def check_divisor(mode, divisor) -> None:
    if mode_spec(mode).needs_divisor and (divisor is None or not (math.isfinite(float(divisor)) and float(divisor) > 0)):
        raise ValueError(f"divisor must be a finite number > 0 under mode={getattr(mode, 'value', mode)}, got {divisor!r}")


def denoms_from_totals(
    mode,
    token_counts: torch.Tensor,
    totals: StepTotals,
    *,
    group_token_sums: torch.Tensor | None = None,
    divisor: float | None = None,
) -> torch.Tensor:
    """``d[i]`` (float64) for local samples with counts ``M[i]``, given the step totals.

    ``group_token_sums`` is ``Sg[g(i)]`` for each local sample (modes with prompt groups).
    """
    spec = mode_spec(mode)
    check_divisor(mode, divisor)
    if spec.needs_groups and group_token_sums is None:
        raise ValueError(f"mode={spec.name} needs group_token_sums (Sg[g(i)] of each sample)")
    counts = token_counts.to(torch.float64)
    sums = None if group_token_sums is None else group_token_sums.to(torch.float64)
    return spec.denoms(DenomInputs(counts, totals, sums, None if divisor is None else float(divisor)))


def prompt_mask_sums(token_counts, group_index, n_samples_per_prompt: int | None = None) -> torch.Tensor:
    """``Sg[g(i)]`` for every sample: the rollout token count of its prompt group (float64 ``[N]``)."""
    counts = check_token_counts(token_counts)
    group_index = check_group_index(group_index, counts.shape[0], counts.device)
    labels, dense, sizes = torch.unique(group_index, return_inverse=True, return_counts=True)
    check_group_sizes(labels, sizes, n_samples_per_prompt)
    return group_totals(counts, dense, labels.numel())[1][dense]
