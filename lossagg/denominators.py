"""Per-sample global denominators ``d[i]`` of SPEC §3, from rollout-side metadata.

Every mode is ``J = sum_i (sum_t m*l) / d[i]`` with

=============  ==========================
mode           d[i]
=============  ==========================
sample_mean    N * c(M[i])
prompt_mean    P * c(Sg[g(i)])
token_mean     c(T)
constant       N * L
=============  ==========================

where ``M[i]`` is sample i's rollout token count, ``Sg[g]`` the token count of its prompt
group, ``N`` the samples of the step, ``P`` its groups, ``T = sum M`` and ``c(x) = max(x, 1)``.
:func:`denoms_from_totals` is the one implementation of this table; :func:`sample_denoms`
(a batch that is the whole step) and :class:`lossagg.StepPlan` (a rank's share of a
distributed step) feed it. Everything is vectorised (no Python loop over samples) and
float64.
"""

from __future__ import annotations

import torch

MODES = ("sample_mean", "prompt_mean", "token_mean", "constant")


def check_token_counts(token_counts) -> torch.Tensor:
    """``M[i]`` as a float64 ``[N]`` tensor; finite and >= 0."""
    counts = torch.as_tensor(token_counts)
    if counts.dim() != 1:
        raise ValueError(f"token_counts must be a 1-D [N] tensor of per-sample token counts, got shape {tuple(counts.shape)}")
    if counts.is_floating_point() and not torch.isfinite(counts).all():
        raise ValueError("token_counts must be finite")
    if (counts < 0).any():
        raise ValueError("token_counts must be >= 0")
    return counts.to(torch.float64)


def check_group_index(group_index, num_samples: int, device=None) -> torch.Tensor:
    """``group_index`` validated: present (required under prompt_mean), one integer per sample."""
    if group_index is None:
        raise ValueError(
            "group_index is required under mode=prompt_mean: every sample needs the index of its prompt group "
            "(samples without one are never grouped silently)"
        )
    group_index = torch.as_tensor(group_index, device=device)
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


def denoms_from_totals(
    mode: str,
    token_counts: torch.Tensor,
    *,
    num_samples: int,
    total_tokens: float,
    num_groups: int | None = None,
    group_token_sums: torch.Tensor | None = None,
    divisor: float | None = None,
) -> torch.Tensor:
    """``d[i]`` for local samples with counts ``M[i]``, given the step totals (float64).

    ``group_token_sums`` is ``Sg[g(i)]`` for each local sample (prompt_mean).
    """
    counts = token_counts.to(torch.float64)
    n = float(num_samples)
    if mode == "sample_mean":
        return n * counts.clamp(min=1.0)
    if mode == "token_mean":
        return torch.full_like(counts, max(float(total_tokens), 1.0))
    if mode == "constant":
        if divisor is None or not (float(divisor) > 0 and float(divisor) != float("inf")):
            raise ValueError(f"divisor must be a finite number > 0 under mode=constant, got {divisor!r}")
        return torch.full_like(counts, n * float(divisor))
    if mode == "prompt_mean":
        if group_token_sums is None or num_groups is None:
            raise ValueError("prompt_mean needs num_groups and group_token_sums")
        return float(num_groups) * group_token_sums.to(torch.float64).clamp(min=1.0)
    raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def prompt_mask_sums(token_counts, group_index, n_samples_per_prompt: int | None = None) -> torch.Tensor:
    """``Sg[g(i)]`` for every sample: the rollout token count of its prompt group (float64 ``[N]``)."""
    counts = check_token_counts(token_counts)
    group_index = check_group_index(group_index, counts.shape[0], counts.device)
    labels, dense, sizes = torch.unique(group_index, return_inverse=True, return_counts=True)
    check_group_sizes(labels, sizes, n_samples_per_prompt)
    group_sums = torch.zeros(labels.numel(), dtype=torch.float64, device=counts.device).index_add_(0, dense, counts)
    return group_sums[dense]


def sample_denoms(
    mode: str,
    token_counts,
    *,
    group_index=None,
    n_samples_per_prompt: int | None = None,
    divisor: float | None = None,
) -> torch.Tensor:
    """``d[i]`` (float64 ``[N]``) for a batch that holds the whole optimizer step.

    For a shard of a larger step (micro-batches, DP ranks) use :class:`lossagg.StepPlan`.
    """
    counts = check_token_counts(token_counts)
    group_sums, num_groups = None, None
    if mode == "prompt_mean":
        group_sums = prompt_mask_sums(counts, group_index, n_samples_per_prompt)
        num_groups = int(torch.unique(torch.as_tensor(group_index)).numel())
    return denoms_from_totals(
        mode,
        counts,
        num_samples=counts.shape[0],
        total_tokens=float(counts.sum()),
        num_groups=num_groups,
        group_token_sums=group_sums,
        divisor=divisor,
    )
