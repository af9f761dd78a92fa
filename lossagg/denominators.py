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
All functions here are vectorised (no Python loop over samples) and return float64.
"""

from __future__ import annotations

import torch

MODES = ("sample_mean", "prompt_mean", "token_mean", "constant")


def _as_counts(token_counts: torch.Tensor, name: str = "token_counts") -> torch.Tensor:
    if not isinstance(token_counts, torch.Tensor):
        token_counts = torch.as_tensor(token_counts)
    if token_counts.dim() != 1:
        raise ValueError(f"{name} must be a 1-D [N] tensor of per-sample token counts, got shape {tuple(token_counts.shape)}")
    if token_counts.is_floating_point() or token_counts.is_complex():
        if not torch.isfinite(token_counts).all() or (token_counts < 0).any():
            raise ValueError(f"{name} must be finite and >= 0")
    elif (token_counts < 0).any():
        raise ValueError(f"{name} must be >= 0")
    return token_counts.to(torch.float64)


def _clamp1(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, min=1.0)


def group_ids(group_index: torch.Tensor | None, num_samples: int, n_samples_per_prompt: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense group ids ``[N]`` and each group's size ``[P]``, validating whole groups.

    ``group_index`` is the prompt-group label of each sample (any integers). Every group
    must hold exactly ``n_samples_per_prompt`` samples (when given).
    """
    if group_index is None:
        raise ValueError(
            "group_index is required under mode=prompt_mean: every sample needs the index of its prompt group "
            "(samples without one are never grouped silently)"
        )
    group_index = torch.as_tensor(group_index)
    if group_index.dim() != 1 or group_index.shape[0] != num_samples:
        raise ValueError(
            f"group_index must be a 1-D tensor with one entry per sample (N = {num_samples}), "
            f"got shape {tuple(group_index.shape)}"
        )
    if group_index.is_floating_point() or group_index.dtype == torch.bool:
        raise TypeError(f"group_index must hold integers, got dtype {group_index.dtype}")
    labels, dense, sizes = torch.unique(group_index, return_inverse=True, return_counts=True)
    if n_samples_per_prompt is not None and num_samples > 0:
        bad = sizes != n_samples_per_prompt
        if bad.any():
            first = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"prompt_mean needs whole prompt groups of n_samples_per_prompt = {n_samples_per_prompt} samples; "
                f"group {int(labels[first])} has {int(sizes[first])} sample(s) in this step "
                f"({int(bad.sum())} group(s) of the wrong size)"
            )
    return dense, sizes


def prompt_mask_sums(token_counts: torch.Tensor, group_index: torch.Tensor, n_samples_per_prompt: int | None = None) -> torch.Tensor:
    """``Sg[g(i)]`` for every sample: the rollout token count of its prompt group (float64 ``[N]``)."""
    counts = _as_counts(token_counts)
    dense, sizes = group_ids(group_index, counts.shape[0], n_samples_per_prompt)
    group_sums = torch.zeros(sizes.shape[0], dtype=torch.float64, device=counts.device)
    group_sums.index_add_(0, dense.to(counts.device), counts)
    return group_sums[dense.to(counts.device)]


def sample_denoms(
    mode: str,
    token_counts: torch.Tensor,
    *,
    group_index: torch.Tensor | None = None,
    n_samples_per_prompt: int | None = None,
    divisor: float | None = None,
    num_samples: int | None = None,
    num_groups: int | None = None,
    total_tokens: float | None = None,
    group_token_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """The global per-sample denominators ``d[i]`` (float64 ``[N_local]``).

    With only ``token_counts`` (and ``group_index``) the call is taken to hold the whole
    step. For a shard of a step, pass the step-global numbers: ``num_samples`` (N),
    ``num_groups`` (P), ``total_tokens`` (T) and, for prompt_mean, ``group_token_sums``
    (``Sg[g(i)]`` of each local sample). ``lossagg.StepPlan`` computes those.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    counts = _as_counts(token_counts)
    n_local = counts.shape[0]
    n = float(n_local if num_samples is None else num_samples)
    if mode == "sample_mean":
        return n * _clamp1(counts)
    if mode == "token_mean":
        t = counts.sum() if total_tokens is None else torch.tensor(float(total_tokens), dtype=torch.float64)
        return _clamp1(t).to(counts.device).expand(n_local).clone()
    if mode == "constant":
        if divisor is None or not (float(divisor) > 0 and torch.isfinite(torch.tensor(float(divisor)))):
            raise ValueError(f"divisor must be a finite number > 0 under mode=constant, got {divisor!r}")
        return torch.full((n_local,), n * float(divisor), dtype=torch.float64, device=counts.device)
    # prompt_mean
    if group_token_sums is None:
        sg = prompt_mask_sums(counts, group_index, n_samples_per_prompt)
        p = float(torch.unique(torch.as_tensor(group_index)).numel()) if num_groups is None else float(num_groups)
    else:
        sg = torch.as_tensor(group_token_sums, dtype=torch.float64, device=counts.device)
        if sg.shape != counts.shape:
            raise ValueError(
                f"group_token_sums must have one entry per sample ({n_local}), got shape {tuple(sg.shape)}"
            )
        if num_groups is None:
            raise ValueError("num_groups (P) is required with group_token_sums")
        p = float(num_groups)
    return p * _clamp1(sg)
