"""Scalar terms (``StepPlan.scalar_term``) and empty steps (``StepPlan.empty``, ``DeferredStep.empty``).

A scalar term is one number per micro-batch, itself a mean over the micro-batch (a MoE router
auxiliary loss, an MTP loss). Scaled by the micro-batch's share of the step and summed over every
micro-batch and rank, it is the step's token- (or sample-) weighted mean: for a per-micro-batch token
mean of a per-token quantity, the mean over every loss token of the step, whatever the split. The
tests split one step over 1-4 ranks (plans from the step's totals) and 1-3 micro-batches each and
compare value and gradient with the float64 unsplit mean; the trainers' own arithmetic (the plain
mean of the micro-batch numbers) is checked to depend on the split, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch

import lossagg
from lossagg import LossAggregationConfig, StepPlan


def random_step(seed, n=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (n,), generator=g)
    masks = [(torch.rand(int(k), generator=g) < 0.7).to(torch.int32) for k in lengths]
    masks[3].zero_()
    q = torch.randn(int(lengths.sum()), generator=g, dtype=torch.float64)
    return lengths, masks, q


def splits(n, seed):
    """Every sample's rank and micro-batch, for a few splits: (ranks, micro-batches per rank)."""
    g = torch.Generator().manual_seed(seed)
    for ranks, per_rank in ((1, 1), (1, 3), (2, 2), (4, 1), (3, 3)):
        owner = torch.randint(0, ranks, (n,), generator=g)
        micro = torch.randint(0, per_rank, (n,), generator=g)
        yield ranks, per_rank, owner, micro


def run_split(weight, lengths, masks, q, ranks, per_rank, owner, micro, *, trainers_own=False):
    """Σ over ranks and micro-batches of the scaled scalar terms (or the trainers' plain mean of the numbers)."""
    counts = torch.tensor([int(m.sum()) for m in masks])
    config = LossAggregationConfig()
    cu = torch.zeros(len(masks) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    qq = q.clone().requires_grad_(True)
    total, numbers = 0.0, []
    for r in range(ranks):
        mine = [i for i in range(len(masks)) if int(owner[i]) == r]
        plan = StepPlan.from_totals(config, counts[mine], num_samples=len(masks), total_tokens=int(counts.sum()))
        for k in range(per_rank):
            chosen = [j for j, i in enumerate(mine) if int(micro[i]) == k]
            if not chosen:
                continue
            ids = [mine[j] for j in chosen]
            mask = torch.cat([masks[i] for i in ids])
            vals = torch.cat([qq[cu[i] : cu[i + 1]] for i in ids])
            mb_cu = torch.zeros(len(ids) + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor([int(lengths[i]) for i in ids]), 0, out=mb_cu[1:])
            mb = plan.micro_batch(torch.tensor(chosen), mask, mb_cu)
            if weight == "tokens":  # the micro-batch's token mean of q
                value = (vals * mask).sum() / mask.sum().clamp(min=1)
            else:  # the micro-batch's mean over its samples of each sample's token mean
                value = torch.stack([(qq[cu[i] : cu[i + 1]] * masks[i]).sum() / masks[i].sum().clamp(min=1) for i in ids]).mean()
            numbers.append(value)
            total = total + plan.scalar_term(value, mb, weight=weight)
    if trainers_own:
        total = torch.stack(numbers).mean()
    (g,) = torch.autograd.grad(total, qq)
    return float(total.detach()), g


@pytest.mark.parametrize("weight", ["tokens", "samples"])
@pytest.mark.parametrize("seed", range(4))
def test_a_scalar_term_is_the_steps_weighted_mean_under_any_split(weight, seed):
    lengths, masks, q = random_step(seed)
    qq = q.clone().requires_grad_(True)
    cu = torch.zeros(len(masks) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    mask = torch.cat(masks).to(torch.float64)
    if weight == "tokens":  # the mean over every loss token of the step
        ref = (qq * mask).sum() / mask.sum()
    else:  # the mean over every sample of its token mean
        ref = torch.stack([(qq[cu[i] : cu[i + 1]] * masks[i]).sum() / masks[i].sum().clamp(min=1) for i in range(len(masks))]).mean()
    (ref_g,) = torch.autograd.grad(ref, qq)
    own_values = set()
    for ranks, per_rank, owner, micro in splits(len(masks), seed):
        got, g = run_split(weight, lengths, masks, q, ranks, per_rank, owner, micro)
        assert got == pytest.approx(float(ref.detach()), rel=1e-12, abs=1e-15), (ranks, per_rank)
        torch.testing.assert_close(g, ref_g, rtol=1e-12, atol=1e-15)
        own, _ = run_split(weight, lengths, masks, q, ranks, per_rank, owner, micro, trainers_own=True)
        own_values.add(round(own, 12))
    # the trainers' own arithmetic (the plain mean of the micro-batch numbers) changes with the split
    assert len(own_values) > 1


def test_scalar_term_refuses_what_it_cannot_scale():
    plan = StepPlan(LossAggregationConfig(), torch.tensor([2, 1]))
    mb = plan.micro_batch(torch.tensor([0, 1]), torch.tensor([1, 1, 1]), torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="0-dim floating tensor"):
        plan.scalar_term(torch.ones(2), mb)
    with pytest.raises(ValueError, match="weight must be 'tokens' or 'samples', got 'sequences'"):
        plan.scalar_term(torch.tensor(1.0), mb, weight="sequences")
    for weight in ("samples", "tokens"):
        for cp_size in (0, -1, "2"):
            with pytest.raises(ValueError, match=f"cp_size must be an integer >= 1, got {cp_size!r}"):
                plan.scalar_term(torch.tensor(1.0), mb, weight=weight, cp_size=cp_size)
    with pytest.raises(TypeError, match="StepPlan.scalar_term: micro_batch must be a MicroBatch of this plan .* got Tensor"):
        plan.scalar_term(torch.tensor(1.0), torch.tensor([1, 1, 1]))
    given = StepPlan.from_totals(LossAggregationConfig(), torch.tensor([2, 1]), num_samples=2)
    gmb = given.micro_batch(slice(None), torch.tensor([1, 1, 1]), torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="weight='tokens' reads the step's total_tokens: pass total_tokens to StepPlan.from_totals"):
        given.scalar_term(torch.tensor(1.0), gmb)
    other = StepPlan(LossAggregationConfig(), torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="another plan|not this plan|owner|plan"):
        other.scalar_term(torch.tensor(1.0), mb)
    # CP: each CP rank's share of the samples is 1/cp of the micro-batch's
    assert float(plan.scalar_term(torch.tensor(6.0, dtype=torch.float64), mb, weight="samples", cp_size=2)) == pytest.approx(6.0 * 2 / (2 * 2))


def test_empty_steps_are_told():
    assert StepPlan(LossAggregationConfig(), torch.tensor([0, 0])).empty
    assert not StepPlan(LossAggregationConfig(), torch.tensor([0, 3])).empty
    assert StepPlan.from_totals(LossAggregationConfig(mode="token_mean"), torch.tensor([0]), total_tokens=0).empty
    assert not StepPlan.from_totals(LossAggregationConfig(mode="token_mean"), torch.tensor([0]), total_tokens=5).empty
    no_t = StepPlan.from_totals(LossAggregationConfig(), torch.tensor([0]), num_samples=2)
    if "total_tokens" not in no_t.totals:
        with pytest.raises(ValueError, match="total_tokens"):
            _ = no_t.empty
    # a filter inside the loss that drops every token: the deferred step with its final masks is empty
    deferred = lossagg.DeferredPlan(LossAggregationConfig(), 2)
    mb = deferred.micro_batch(torch.tensor([0, 1]), torch.tensor([0, 0, 0]), torch.tensor([0, 2, 3]))
    deferred.loss(torch.zeros(3, requires_grad=True), mb)
    assert deferred.close().empty
