"""One optimizer step of gradient accumulation under torch DDP or FSDP2, with lossagg.

The recipe (`accumulate`): every micro-batch's loss is ``plan.loss(...) * scale`` with
``scale = lossagg.gradient_scale("mean", dp_size=..., cp_size=...)``, because DDP and
FSDP2 average gradients over every rank of their process group (DP x CP here); gradient
synchronisation is skipped for all micro-batches but the last (``no_sync()`` for DDP,
``set_requires_gradient_sync(False)`` for FSDP2). The step's ``StepPlan`` all-reduces its
totals over the DP group (CP ranks hold the same samples).

Run it (4 CPU processes, gloo, DP 2 x CP 2; prints the largest difference from the
gradient of J computed in one process):

    python examples/torch_engines.py [ddp|fsdp2]

tests/test_torch_engines.py runs the same functions for every mode.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lossagg
from lossagg import zigzag_local_cu_seqlens, zigzag_shard

FEATURES = 6


def make_model() -> torch.nn.Module:
    torch.manual_seed(123)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def per_token_loss(model, features, targets):
    return (model(features).squeeze(-1) - targets) ** 2


def make_step(n_per_prompt=4, prompts=4, seed=0):
    """A step of packed rollouts: (features, targets, mask, cu_seqlens, prompt groups)."""
    g = torch.Generator().manual_seed(seed)
    n = n_per_prompt * prompts
    lengths = torch.randint(0, 30, (n,), generator=g)
    lengths[5] = 0  # an empty sample
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    total = int(cu[-1])
    features = torch.randn(total, FEATURES, generator=g, dtype=torch.float64)
    targets = torch.randn(total, generator=g, dtype=torch.float64)
    mask = torch.rand(total, generator=g) < 0.75
    mask[cu[2] : cu[3]] = False  # a fully masked sample
    groups = torch.arange(n) // n_per_prompt
    return features, targets, mask, cu, groups


def wrap(model: torch.nn.Module, engine: str) -> torch.nn.Module:
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        return fully_shard(model)
    raise ValueError(f"engine must be 'ddp' or 'fsdp2', got {engine!r}")


def local_micro_batches(step, own, num_micro_batches, cp_size, cp_rank):
    """This rank's micro-batches: (local sample positions, features, targets, mask, cu_seqlens), CP-sharded."""
    features, targets, mask, cu, _ = step
    lengths = cu[1:] - cu[:-1]
    out = []
    for local in torch.tensor_split(torch.arange(own.numel()), num_micro_batches):
        samples = own[local]
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in samples.tolist()] + [torch.zeros(0, dtype=torch.long)])
        mb_cu = lossagg.cu_seqlens_from_lengths(lengths[samples], dtype=torch.int64)
        out.append(
            (
                local,
                zigzag_shard(features[idx].T, mb_cu, cp_size, cp_rank).T,
                zigzag_shard(targets[idx], mb_cu, cp_size, cp_rank),
                zigzag_shard(mask[idx], mb_cu, cp_size, cp_rank, pad_value=False),
                zigzag_local_cu_seqlens(mb_cu, cp_size),
            )
        )
    return out


def accumulate(model, engine: str, plan: lossagg.StepPlan, micro_batches, scale: float) -> None:
    """Backward of every micro-batch; the engine synchronises gradients on the last one."""
    for i, (samples, x, y, mask, cu) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        if engine == "fsdp2":
            model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext()
        else:
            sync = contextlib.nullcontext() if last else model.no_sync()
        with sync:
            mb = plan.micro_batch(samples, mask, cu)
            (plan.loss(per_token_loss(model, x, y), mb) * scale).backward()


def full_grads(model, engine: str) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters()]
    return [g.full_tensor() if engine == "fsdp2" else g for g in grads]


def reference_grads(config, step, session_index=None) -> list[torch.Tensor]:
    from lossagg.testing import reference_loss

    features, targets, mask, cu, groups = step
    model = make_model()
    reference_loss(config, per_token_loss(model, features, targets), mask, cu, groups, session_index=session_index).backward()
    return [p.grad for p in model.parameters()]


def run_rank(engine, config, dp, cp, num_micro_batches, rank, step=None, session_index=None):
    """One rank's step (inside an initialised gloo world of dp * cp ranks); returns (grads, expected).
    ``session_index``: each sample's session (global labels), for a mode with sessions (docs/modes.md)."""
    dp_rank, cp_rank = divmod(rank, cp)
    # every rank creates every DP group, in the same order
    dp_groups = [dist.new_group([d * cp + c for d in range(dp)]) for c in range(cp)]
    step = step or make_step(n_per_prompt=config.n_samples_per_prompt or 4)
    features, targets, mask, cu, groups = step
    own = torch.tensor_split(torch.arange(cu.numel() - 1), dp)[dp_rank]
    sessions = {}
    if session_index is not None:
        sessions = {"session_index": session_index[own], "num_session_labels": int(session_index.max()) + 1}
    plan = lossagg.StepPlan(
        config,
        lossagg.token_counts(mask, cu)[own],
        group_index=groups[own],
        process_group=dp_groups[cp_rank],
        num_group_labels=int(groups.max()) + 1,
        **sessions,
    )
    model = wrap(make_model(), engine)
    scale = lossagg.gradient_scale("mean", dp_size=dp, cp_size=cp)
    accumulate(model, engine, plan, local_micro_batches(step, own, num_micro_batches, cp, cp_rank), scale)
    return full_grads(model, engine), reference_grads(config, step, session_index)


def _demo(rank, world, engine, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    config = lossagg.LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=4)
    grads, expected = run_rank(engine, config, 2, 2, 3, rank)
    err = max(float((g - e).abs().max()) for g, e in zip(grads, expected, strict=True))
    if rank == 0:
        print(f"{engine}: DP 2 x CP 2, 3 micro-batches, mode prompt_mean: largest gradient difference from J's {err:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    engine = sys.argv[1] if len(sys.argv) > 1 else "ddp"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_demo, args=(4, engine, os.path.join(tmp, "init")), nprocs=4, join=True)
