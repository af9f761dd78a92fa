"""What a late rescale costs in low-precision gradients (docs/composition.md, "Filters inside the loss").

A linear per-token loss model, computed in float64, whose gradient is accumulated over the
micro-batches in a buffer of bfloat16, float16 or float32 (each micro-batch's gradient rounded to
the buffer's dtype and added there, as a trainer's gradient buffer without float32 main gradients
does), on a step whose loss filters its mask after the forward. Three ways to the step's gradient,
each against the float64 gradient of the filtered step:

  in-loss       a StepPlan of the final masks (the counts known in advance: the best case)
  late, est.    a DeferredPlan with the rollout plan as estimate: rescale = rollout / final totals (near 1)
  late, none    a DeferredPlan without estimate: every step-level factor 1 until the end, rescale = 1 / G

Prints the relative error (max |g - g64| / max |g64|) of each, per mode and dtype, and the
rescale; "inf" where the accumulated gradients overflowed.

    python benchmarks/deferred_precision.py [--tokens 200000] [--micro-batches 8]
"""

from __future__ import annotations

import argparse

import torch

import lossagg

FEATURES = 16


def make_step(num_samples: int, mean_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (num_samples,), generator=g)
    cu = lossagg.cu_seqlens_from_lengths(lengths).long()
    total = int(cu[-1])
    x = torch.randn(total, FEATURES, generator=g, dtype=torch.float64)
    x[:, 0] = 1.0  # a bias: its gradient sums over the tokens, as real gradients do
    mask = torch.rand(total, generator=g) < 0.9
    w0 = torch.randn(FEATURES, generator=g, dtype=torch.float64) / FEATURES**0.5
    return lengths, cu, x, mask, w0


def per_token(w, x):
    return torch.nn.functional.softplus(x @ w)  # a positive per-token loss


def keep(values, mask, cu):
    """The filter inside the loss: tokens whose loss is above 1.5, samples whose mean loss is above 1.0."""
    v = values.detach().double()
    mean = lossagg.sequence_mean(v, mask, cu)
    return mask & (v <= 1.5) & (lossagg.broadcast_to_tokens((mean <= 1.0).double(), mask, cu) != 0)


def micro_batches(lengths, cu, count):
    for samples in torch.arange(lengths.numel()).tensor_split(count):
        lo, hi = int(cu[samples[0]]), int(cu[samples[-1] + 1])
        yield samples, lo, hi, lossagg.cu_seqlens_from_lengths(lengths[samples]).long()


def run(config, step, dtype, scheme, count):
    lengths, cu, x, mask, w0 = step
    w = w0.clone().requires_grad_(True)
    buffer = torch.zeros(FEATURES, dtype=dtype)  # the gradient buffer
    rollout = lossagg.StepPlan.from_mask(config, mask, cu)
    if scheme == "in-loss":
        final = keep(per_token(w.detach(), x), mask, cu)
        plan = lossagg.StepPlan.from_mask(config, final, cu)
    else:
        plan = lossagg.DeferredPlan(config, lengths.numel(), estimate=rollout if scheme == "late, est." else None)
    for samples, lo, hi, mb_cu in micro_batches(lengths, cu, count):
        values = per_token(w, x[lo:hi])
        m = keep(values, mask[lo:hi], mb_cu)
        (grad,) = torch.autograd.grad(plan.loss(values, m, samples, mb_cu), w)
        buffer += grad.to(dtype)  # accumulated in the buffer's dtype
    scale = 1.0
    if scheme != "in-loss":
        closed = plan.close()
        scale = closed.scale
        closed.apply_([buffer])  # the rescale, in the buffer's dtype
    return buffer.double(), scale


def truth(config, step):
    lengths, cu, x, mask, w0 = step
    w = w0.clone().requires_grad_(True)
    values = per_token(w, x)
    lossagg.testing.reference_loss(config, values, keep(values, mask, cu), cu).backward()
    return w.grad


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2_000_000)
    p.add_argument("--micro-batches", type=int, default=8)
    args = p.parse_args(argv)
    import lossagg.testing  # noqa: F401

    num_samples = 64
    step = make_step(num_samples, args.tokens // num_samples)
    print(
        f"# lossagg late rescale in low precision: torch {torch.__version__}, {int(step[1][-1])} tokens, "
        f"{num_samples} samples, {args.micro_batches} micro-batches\n"
    )
    print("| mode | grad dtype | in-loss | late, est. (rescale) | late, none (rescale) |")
    print("|---|---|---|---|---|")
    for mode in ("token_mean", "sample_mean"):
        config = lossagg.LossAggregationConfig(mode=mode)
        want = truth(config, step)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            cells = []
            for scheme in ("in-loss", "late, est.", "late, none"):
                got, scale = run(config, step, dtype, scheme, args.micro_batches)
                err = float((got - want).abs().max() / want.abs().max())
                text = "inf (overflow)" if not torch.isfinite(got).all() else f"{err:.2e}"
                cells.append(text if scheme == "in-loss" else f"{text} ({scale:.3g})")
            print(f"| {mode} | {str(dtype).replace('torch.', '')} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
