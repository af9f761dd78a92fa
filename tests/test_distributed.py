"""Multi-process (gloo) check: DP=2 x CP=2, two micro-batches per rank, a tiny model.

After the framework-style gradient reduction (summed, or averaged over the DP x CP
world as DDP/FSDP do, with lossagg.gradient_scale), every rank's gradients equal the
single-process gradient of the step scalar J, for every mode.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import worlds
from batches import per_prompt, sessions_in
from worlds import dp_cp_groups

import lossagg

DP, CP, MICRO_BATCHES = 2, 2, 2
# the multi-process engine tests share one xdist worker (scripts/test.sh runs pytest -n 2)
pytestmark = pytest.mark.xdist_group("engines")
N_PER_PROMPT = 4


def make_step(seed=0):
    g = torch.Generator().manual_seed(seed)
    n_samples = 4 * N_PER_PROMPT
    lengths = torch.randint(0, 30, (n_samples,), generator=g)
    lengths[5] = 0  # an empty sample
    cu = torch.zeros(n_samples + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    features = torch.randn(total, 6, generator=g)
    targets = torch.randn(total, generator=g)
    mask = torch.rand(total, generator=g) < 0.75
    mask[cu[2] : cu[3]] = False  # a fully masked sample
    groups = torch.arange(n_samples // N_PER_PROMPT).repeat_interleave(N_PER_PROMPT)
    return features, targets, mask, cu, groups


def make_model():
    torch.manual_seed(123)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def per_token_loss(model, features, targets):
    return (model(features).squeeze(-1) - targets) ** 2


def reference_grads(config, step):
    from lossagg.testing import reference_loss

    features, targets, mask, cu, groups = step
    model = make_model().double()
    loss = per_token_loss(model, features.double(), targets.double())
    j = reference_loss(config, loss, mask, cu, groups, session_index=sessions_in(groups))
    j.backward()
    return [p.grad.float() for p in model.parameters()]


def worker(rank, world, init_file, convention, results_dir, setup=None, modes=None):
    """One rank. ``setup`` (a picklable callable) runs first, e.g. to register a mode in this
    process; ``modes`` are the modes to check (default: every registered one)."""
    from lossagg import LossAggregationConfig, StepPlan, gradient_scale, zigzag_local_cu_seqlens, zigzag_shard

    if setup is not None:
        setup()
    modes = {name: dict(lossagg.MODES[name].example_settings) for name in (modes or lossagg.MODES)}

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    dp_rank, cp_rank, dp_group, _ = dp_cp_groups(rank, DP, CP)

    step = make_step()
    features, targets, mask, cu, groups = step
    n = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    own = torch.tensor_split(torch.arange(n), DP)[dp_rank]
    rollout_counts = lossagg.token_counts(mask, cu)[own]  # rollout side, full masks

    failures = []
    for mode, extra in modes.items():
        config = LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, N_PER_PROMPT), global_batch_size=n, **extra)
        model = make_model()
        # sessions of two samples in each group (docs/modes.md, "Sessions"), read by the session modes
        plan = StepPlan(config, rollout_counts, group_index=groups[own], session_index=sessions_in(groups)[own], process_group=dp_group)
        scale = gradient_scale(convention, dp_size=DP, cp_size=CP, num_micro_batches=MICRO_BATCHES)
        for mb_local in torch.tensor_split(torch.arange(own.numel()), MICRO_BATCHES):
            mb = own[mb_local]
            idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in mb.tolist()] + [torch.zeros(0, dtype=torch.long)])
            mb_cu = torch.zeros(mb.numel() + 1, dtype=torch.int64)
            mb_cu[1:] = torch.cumsum(lengths[mb], 0)
            local_cu = zigzag_local_cu_seqlens(mb_cu, CP)
            local_features = zigzag_shard(features[idx].T, mb_cu, CP, cp_rank).T
            local_targets = zigzag_shard(targets[idx], mb_cu, CP, cp_rank)
            local_mask = zigzag_shard(mask[idx], mb_cu, CP, cp_rank, pad_value=False)
            loss = per_token_loss(model, local_features, local_targets)
            contribution = plan.loss(loss, local_mask, mb_local, local_cu)
            (contribution * scale).backward()
        # the framework's gradient reduction over the whole DP x CP world
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            if convention == "mean":
                p.grad /= world
        expected = reference_grads(config, step)
        for p, e in zip(model.parameters(), expected, strict=True):
            if not torch.allclose(p.grad, e, rtol=1e-4, atol=1e-6):
                failures.append(f"rank {rank} mode {mode}: max error {(p.grad - e).abs().max():.3g}")
    with open(os.path.join(results_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures))
    dist.destroy_process_group()


@pytest.mark.parametrize("convention", ["sum", "mean"])
def test_dp2_cp2_gradients_equal_single_process(convention, tmp_path):
    world = DP * CP
    init_file = tempfile.mktemp(dir=tmp_path)
    worlds.start(worker, (world, init_file, convention, str(tmp_path)), world)
    failures = []
    for rank in range(world):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        if text:
            failures.append(text)
    assert not failures, "\n".join(failures)
