"""Float64 pure-PyTorch references of the sequence-level objectives of docs/sequence.md,
written for clarity: one loop over the samples of the whole, unsplit step. They share no code
with lossagg.sequence (nor with its kernels) and are differentiable, so the gradient of J is
autograd's through these loops.
"""

from __future__ import annotations

import torch


def sample_rows(tensor: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[torch.Tensor]:
    """Each sample's tokens: a row of a padded [B, T] tensor, or a slice of a packed [T] one."""
    if cu_seqlens is None:
        return [tensor[i] for i in range(tensor.shape[0])]
    cu = cu_seqlens.tolist()
    return [tensor[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def masked_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """sum of m * x over a sample's tokens, exactly 0 where the mask is 0."""
    return torch.where(m != 0, x * m, torch.zeros((), dtype=torch.float64)).sum()


def masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """mean over the sample's loss tokens: sum m * x / max(sum m, 1)."""
    return masked_sum(x, m) / torch.clamp(m.sum(), min=1.0)


def reference_objective(
    objective: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    eps_low: float | None,
    eps_high: float,
) -> torch.Tensor:
    """J of ``objective`` over the whole step (docs/sequence.md), the loss mask being the rollout mask.

    * gspo:  (1/N) sum_{i: M_i > 0} -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
             s_i = exp(mean_t log r)
    * luspo: (1/N) sum_i M_i * (GSPO's sample loss)
    * gmpo:  (1/N) sum_{i: M_i > 0} -A_i exp(mean_t clip_A(log r)), clip_A: min(., eps_high) if
             A_i > 0, max(., -eps_low) if A_i < 0
    * cispo: (1/max(T, 1)) sum_i sum_t -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_i log_prob_t
    """
    lp_rows = sample_rows(log_prob.to(torch.float64), cu_seqlens)
    old_rows = sample_rows(old_log_prob.to(torch.float64), cu_seqlens)
    m_rows = sample_rows(mask.to(torch.float64), cu_seqlens)
    n = len(lp_rows)
    total_tokens = float(sum(float((m != 0).sum()) for m in m_rows))
    j = torch.zeros((), dtype=torch.float64)
    for lp, old, m, a in zip(lp_rows, old_rows, m_rows, advantages.to(torch.float64).tolist(), strict=True):
        count = float(m.sum())
        log_r = lp - old
        if objective in ("gspo", "luspo"):
            s = torch.exp(masked_mean(log_r, m))
            sample_loss = -torch.min(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a)
            if objective == "gspo":
                j = j + (sample_loss if count > 0 else 0.0) / n
            else:
                j = j + count * sample_loss / n
        elif objective == "gmpo":
            if a > 0:
                clipped = torch.clamp(log_r, max=eps_high)
            elif a < 0:
                clipped = torch.clamp(log_r, min=-eps_low)
            else:
                clipped = log_r
            g = torch.exp(masked_mean(clipped, m))
            j = j + (-a * g if count > 0 else 0.0) / n
        elif objective == "cispo":
            weight = torch.exp(log_r.detach())
            weight = torch.clamp(weight, min=None if eps_low is None else 1 - eps_low, max=1 + eps_high)
            j = j + masked_sum(-weight * a * lp, m) / max(total_tokens, 1.0)
        else:
            raise ValueError(f"unknown objective {objective!r}")
    return j
