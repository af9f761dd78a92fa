"""A Megatron-style PG loss function built on lossagg, runnable on the CPU.

Megatron's pipeline schedule calls ``forward_step`` once per micro-batch; the loss
function it returns reduces per-token losses to this micro-batch's contribution.
Megatron-Core (without --calculate-per-token-loss) multiplies each micro-batch loss by the
CP size, divides it by the number of micro-batches and averages gradients over DP x CP
ranks, so the contribution is multiplied by ``gradient_scale("megatron", ...)``
(micro-batches x DP) to make the final gradient the gradient of the step scalar J.

    python examples/megatron_loss.py examples/loss_aggregation.yaml
"""

from __future__ import annotations

import functools
import sys

import torch

import lossagg


def pg_loss_func(plan, samples, cu_seqlens, loss_mask, old_logp, advantages, scale, logp):
    """Megatron's loss_func(output_tensor): returns (loss, report)."""
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    mb = plan.micro_batch(samples, loss_mask, cu_seqlens)
    contribution = plan.loss(per_token, mb)
    metrics = plan.metrics({"ratio": ratio, "neg_logp": -logp}, mb)
    return contribution * scale, {"pg_loss": contribution.detach(), **metrics}


def main(config_path: str | None = None) -> None:
    cfg = (
        lossagg.LossAggregationConfig.from_file(config_path)
        if config_path
        else lossagg.LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=4)
    )
    g = torch.Generator().manual_seed(0)
    n = cfg.n_samples_per_prompt
    num_samples, micro_batches = 4 * n, 4
    lengths = torch.randint(1, 50, (num_samples,), generator=g)
    cu = torch.zeros(num_samples + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    tokens = int(cu[-1])
    features = torch.randn(tokens, 16, generator=g)
    mask = torch.rand(tokens, generator=g) < 0.9
    old_logp = -torch.rand(tokens, generator=g)
    advantages = torch.randn(num_samples, generator=g).repeat_interleave(lengths)
    group_index = torch.arange(num_samples) // n
    policy = torch.nn.Linear(16, 1)

    # once per optimizer step (one all-reduce over DP when a process group is given)
    plan = lossagg.StepPlan(cfg, lossagg.token_counts(mask, cu), group_index=group_index)
    scale = lossagg.gradient_scale("megatron", dp_size=1, cp_size=1, num_micro_batches=micro_batches)
    reports = []
    for samples in torch.tensor_split(torch.arange(num_samples), micro_batches):
        lo, hi = int(cu[samples[0]]), int(cu[samples[-1] + 1])
        mb_cu = (cu[samples[0] : samples[-1] + 2] - lo).to(torch.int32)
        logp = -torch.nn.functional.softplus(policy(features[lo:hi]).squeeze(-1))
        loss_func = functools.partial(pg_loss_func, plan, samples, mb_cu, mask[lo:hi], old_logp[lo:hi], advantages[lo:hi], scale)
        loss, report = loss_func(logp)
        (loss / micro_batches).backward()  # what Megatron's schedule does
        reports.append(report)
    j = sum(r["pg_loss"] for r in reports)
    print(f"mode={cfg.mode}: J = {j.item():.6f}, |grad| = {policy.weight.grad.norm():.6f}")
    print({k: round(float(sum(r[k] for r in reports)), 6) for k in ("ratio", "neg_logp")})

    # the same gradient from the unsplit step
    grad_split = policy.weight.grad.clone()
    policy.zero_grad()
    logp = -torch.nn.functional.softplus(policy(features).squeeze(-1))
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    lossagg.aggregate(cfg, per_token, mask, cu_seqlens=cu, group_index=group_index).backward()
    assert torch.allclose(grad_split, policy.weight.grad, rtol=1e-4, atol=1e-6), "split changed the gradient"
    print("micro-batched gradient == unsplit gradient")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
