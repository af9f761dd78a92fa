"""Sequence-level objectives split for real: 4 gloo processes on CPU (DP 2 x CP 2), two
micro-batches per DP rank, each micro-batch's tokens in the zigzag CP layout
(lossagg.context_parallel), a tiny float64 policy whose per-token log-probabilities feed
``lossagg.sequence_loss`` with the CP group.

For GSPO, GMPO, LUSPO and CISPO, the contributions of every rank summed, and the gradients
summed over the world, equal the unsplit J of tests/sequence_reference.py and its gradient to
float64 rounding. Two controls show what the check rests on: without the CP group each CP rank
averages its own half of a sample (J is wrong), and without the all-reduce in the backward the
value is right but the gradient is not.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sequence_reference import reference_objective
from worlds import crashed, dp_cp_groups, leave, run_world

import lossagg
import lossagg.sequence

DP, CP, MICRO_BATCHES = 2, 2, 2
EPS_LOW, EPS_HIGH = 0.2, 0.28
VOCAB, FEATURES = 5, 6
# the multi-process engine tests share one xdist worker (scripts/test.sh runs pytest -n 2)
pytestmark = pytest.mark.xdist_group("engines")


def make_step(seed=0):
    """12 packed samples (one empty, one fully masked): features, target tokens, 0/1 mask,
    cu_seqlens, per-sample advantages and old log-probabilities (a perturbed policy, with a
    per-sample shift so that sample ratios clip on both sides)."""
    g = torch.Generator().manual_seed(seed)
    n = 12
    lengths = torch.randint(1, 19, (n,), generator=g)
    lengths[4] = 0
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    total = int(cu[-1])
    features = torch.randn(total, FEATURES, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (total,), generator=g)
    mask = (torch.rand(total, generator=g) < 0.85).to(torch.float64)
    mask[cu[7] : cu[8]] = 0.0
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    with torch.no_grad():
        old_model = make_model(seed=1)
        shift = torch.repeat_interleave(0.4 * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1), lengths)
        old_log_prob = log_probs(old_model, features, targets) - shift
    return features, targets, mask, cu, advantages, old_log_prob


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB)).double()


def log_probs(model, features, targets):
    return torch.log_softmax(model(features), -1).gather(-1, targets[:, None]).squeeze(-1)


def reference(objective, step):
    """Unsplit J and its gradient, from the float64 reference loops."""
    features, targets, mask, cu, advantages, old_log_prob = step
    model = make_model()
    j = reference_objective(objective, log_probs(model, features, targets), old_log_prob, advantages, mask, cu, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    j.backward()
    return j.detach(), [p.grad for p in model.parameters()]


def split_step(objective, step, dp_rank, cp_rank, dp_group, cp_group):
    """This rank's share: the sum of its contributions (all micro-batches) and its model's gradient."""
    features, targets, mask, cu, advantages, old_log_prob = step
    n = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    own = torch.tensor_split(torch.arange(n), DP)[dp_rank]
    model = make_model()
    config = lossagg.objective_config(objective)
    plan = lossagg.StepPlan(config, lossagg.token_counts(mask, cu)[own], process_group=dp_group)
    contributions = torch.zeros((), dtype=torch.float64)
    for mb_local in torch.tensor_split(torch.arange(own.numel()), MICRO_BATCHES):
        mb = own[mb_local]
        lo, hi = int(cu[mb[0]]), int(cu[mb[-1] + 1])
        mb_cu = lossagg.cu_seqlens_from_lengths(lengths[mb], dtype=torch.int64)
        local_cu = lossagg.zigzag_local_cu_seqlens(mb_cu, CP)
        local_features = lossagg.zigzag_shard(features[lo:hi].T, mb_cu, CP, cp_rank).T
        local = [lossagg.zigzag_shard(t[lo:hi], mb_cu, CP, cp_rank) for t in (targets, old_log_prob, mask)]
        contribution = lossagg.sequence_loss(
            objective,
            plan,
            log_probs(model, local_features, local[0]),
            local[1],
            advantages[mb],
            local[2],
            mb_local,
            local_cu,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            cp_group=cp_group,
        )
        (contribution * lossagg.gradient_scale("sum")).backward()
        contributions = contributions + contribution.detach()
    dist.all_reduce(contributions)
    grads = [p.grad for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)  # the framework's gradient reduction over the DP x CP world (summed)
    return contributions, grads


def relative_error(got, expected) -> float:
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-300))


class _ForwardOnlySum(torch.autograd.Function):
    """The control: the CP sum in the forward, the gradient left as it came in the backward."""

    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def worker(rank, world, init_file, results_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    dp_rank, cp_rank, dp_group, cp_group = dp_cp_groups(rank, DP, CP)
    step = make_step()
    failures, ran = [], 0
    try:
        for objective in lossagg.SEQUENCE_OBJECTIVES:
            j_ref, grads_ref = reference(objective, step)
            j, grads = split_step(objective, step, dp_rank, cp_rank, dp_group, cp_group)
            ran += 1
            if not relative_error(j, j_ref) <= 1e-13:
                failures.append(f"rank {rank} {objective}: J {float(j)!r} vs unsplit {float(j_ref)!r}")
            for g, e in zip(grads, grads_ref, strict=True):
                if not relative_error(g, e) <= 1e-12:
                    failures.append(f"rank {rank} {objective}: gradient relative error {relative_error(g, e):.3g}")
        for objective in ("gspo", "gmpo"):
            j_ref, grads_ref = reference(objective, step)
            # control 1: no CP group, each CP rank's half of a sample averaged alone
            j, _ = split_step(objective, step, dp_rank, cp_rank, dp_group, None)
            ran += 1
            if not relative_error(j, j_ref) > 1e-3:
                failures.append(f"rank {rank} {objective}: J without the CP group is J ({float(j)!r}): the check cannot fail")
            # control 2: the CP sum without its backward all-reduce
            lossagg.sequence._AllReduceSum, real = _ForwardOnlySum, lossagg.sequence._AllReduceSum
            try:
                j, grads = split_step(objective, step, dp_rank, cp_rank, dp_group, cp_group)
            finally:
                lossagg.sequence._AllReduceSum = real
            ran += 1
            if not relative_error(j, j_ref) <= 1e-13:
                failures.append(f"rank {rank} {objective}: J with a forward-only CP sum should still be J")
            if not max(relative_error(g, e) for g, e in zip(grads, grads_ref, strict=True)) > 1e-3:
                failures.append(f"rank {rank} {objective}: the gradient without the backward all-reduce is J's: the check cannot fail")
    except Exception as exc:
        failures.append(crashed(f"rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


def test_gspo_gmpo_luspo_cispo_over_micro_batches_dp2_cp2_are_the_unsplit_j(tmp_path):
    world = DP * CP
    failures, runs = run_world(worker, world, (), tmp_path)
    assert not failures, "\n".join(failures)[:6000]
    assert runs == world * (len(lossagg.SEQUENCE_OBJECTIVES) + 4)
