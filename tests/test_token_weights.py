"""StepPlan.token_weights, the reduction folded into per-token weights (docs/trainers/skyrl.md,
"Advantage scaling (SkyRL)"): for every registered mode (built in, and one registered here), in both
layouts, over micro-batches and CP shards, ``(weights * loss * mask).sum()`` is ``plan.loss``
times the engine's scale, and so is the masked sum of a PPO-clip loss whose advantages were
multiplied by the weights; a term without the advantage is not reweighted; bad arguments are
named. Float64 throughout, against ``plan.loss`` and the float64 reference J."""

from __future__ import annotations

import math
import re

import pytest
import torch
from batches import per_prompt, random_float64_step, sessions_in

import lossagg
from lossagg import LossAggregationConfig, StepPlan, gradient_scale
from lossagg.context_parallel import zigzag_local_cu_seqlens, zigzag_shard
from lossagg.modes import ModeSpec, register_mode, unregister_mode
from lossagg.step import GRADIENT_CONVENTIONS
from lossagg.testing import reference_loss

REGISTERED = "sqrt_length"  # a mode registered by the test: d[i] = N · sqrt(c(M[i]))
F64 = dict(rtol=1e-12, atol=1e-14)


def _sqrt_length() -> ModeSpec:
    return ModeSpec(
        name=REGISTERED,
        summary="each sample's token sum over the square root of its length (a test mode)",
        formula="(1/N) Σ_i Σ_t m·l / sqrt(c(M[i]))",
        denom_formula="N · sqrt(c(M[i]))",
        totals=("num_samples",),
        denoms=lambda x: x.totals.num_samples * x.token_counts.clamp(min=1.0).sqrt(),
        reference=lambda r: sum(num / math.sqrt(max(m, 1.0)) for num, m in zip(r.numerators, r.token_counts, strict=True)) / len(r.numerators),
    )


@pytest.fixture
def mode(request):
    """The mode named by the parameter; the test mode is registered for the test's duration."""
    if request.param != REGISTERED:
        yield request.param
        return
    register_mode(_sqrt_length())
    try:
        yield REGISTERED
    finally:
        unregister_mode(REGISTERED)


ALL_MODES = [*lossagg.MODES, REGISTERED]


def config_of(name: str) -> LossAggregationConfig:
    settings = lossagg.MODES[name].example_settings
    return LossAggregationConfig(mode=name, n_samples_per_prompt=per_prompt(name, 4), **settings)


def step(seed=3):
    """A packed float64 step of 4 prompt groups × 4 samples (one empty) and its plan's inputs."""
    values, mask, cu, groups = random_float64_step(seed=seed)
    return values, mask, cu, groups, lossagg.token_counts(mask, cu)


def padded(x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """The packed ``x`` as right-padded rows ``[B, longest]`` (zeros after each sample)."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    out = torch.zeros(len(lengths), max(lengths, default=0), dtype=x.dtype)
    for i, n in enumerate(lengths):
        out[i, :n] = x[int(cu[i]) : int(cu[i]) + n]
    return out


def micro_batches(cu: torch.Tensor, layout: str, parts: int, *tensors: torch.Tensor):
    """(samples, cu_seqlens or None, the tensors cut to the micro-batch) of contiguous micro-batches."""
    rows = [padded(t, cu) for t in tensors] if layout == "padded" else None
    for own in torch.tensor_split(torch.arange(cu.numel() - 1), parts):
        a, b = int(own[0]), int(own[-1]) + 1
        if layout == "padded":
            yield own, None, [r[a:b] for r in rows]
        else:
            lo, hi = int(cu[a]), int(cu[b])
            yield own, cu[a : b + 1] - lo, [t[lo:hi] for t in tensors]


# --------------------------------------------------------- the contract, every mode
@pytest.mark.parametrize("mode", ALL_MODES, indirect=True)
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_weighted_masked_sum_is_the_plans_loss_and_adds_up_to_j(mode, layout):
    values, mask, cu, groups, counts = step()
    config = config_of(mode)
    plan = StepPlan(config, counts, group_index=groups, session_index=sessions_in(groups))
    total = torch.zeros((), dtype=torch.float64)
    for samples, mb_cu, (v, m) in micro_batches(cu, layout, 3, values, mask):
        w = plan.token_weights(m, samples, mb_cu, convention="sum", dtype=torch.float64)
        assert w.shape == m.shape and w.dtype == torch.float64
        by_weights = v.clone().requires_grad_(True)
        by_plan = v.clone().requires_grad_(True)
        ours = (w * by_weights * m).sum()
        theirs = plan.loss(by_plan, m, samples, mb_cu)
        torch.testing.assert_close(ours, theirs, **F64)
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(by_weights.grad, by_plan.grad, **F64)
        total = total + ours.detach()
    torch.testing.assert_close(total, reference_loss(config, values, mask, cu, groups, session_index=sessions_in(groups)), **F64)


@pytest.mark.parametrize("convention", GRADIENT_CONVENTIONS)
def test_each_token_holds_the_engines_scale_over_its_samples_denominator(convention):
    values, mask, cu, groups, counts = step(seed=8)
    plan = StepPlan(config_of("sample_mean"), counts)
    sizes = dict(dp_size=2, cp_size=3, num_micro_batches=4)
    scale = gradient_scale(convention, **sizes)
    samples = torch.arange(4, 11)
    mb_cu = cu[4:12] - cu[4]
    v, m = values[int(cu[4]) : int(cu[11])], mask[int(cu[4]) : int(cu[11])]
    w = plan.token_weights(m, samples, mb_cu, convention=convention, dtype=torch.float64, **sizes)
    lengths = (mb_cu[1:] - mb_cu[:-1]).tolist()
    expected = torch.cat(
        [torch.full((n,), scale / float(plan.sample_denoms[i]), dtype=torch.float64) for n, i in zip(lengths, samples.tolist(), strict=True)]
    )
    assert torch.equal(w, expected)
    torch.testing.assert_close((w * v * m).sum(), plan.loss(v, m, samples, mb_cu) * scale, **F64)


def test_context_parallel_shards_add_up_to_the_micro_batch():
    values, mask, cu, groups, counts = step(seed=4)
    plan = StepPlan(config_of("token_mean"), counts)
    samples = torch.arange(16)
    local_cu = zigzag_local_cu_seqlens(cu, 2)
    sharded = torch.zeros((), dtype=torch.float64)
    for rank in range(2):
        v, m = zigzag_shard(values, cu, 2, rank), zigzag_shard(mask, cu, 2, rank)
        w = plan.token_weights(m, samples, local_cu, convention="mean", cp_size=2, dtype=torch.float64)
        sharded = sharded + (w * v * m).sum() / 2  # torch DDP averages over the 2 CP ranks
    torch.testing.assert_close(sharded, plan.loss(values, mask, samples, cu), **F64)


def test_a_fractional_mask_weighs_as_it_does_in_the_loss():
    values, mask, cu, groups, counts = step(seed=6)
    weighted_mask = mask * (0.25 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    plan = StepPlan(config_of("sample_mean"), counts)
    w = plan.token_weights(weighted_mask, slice(None), cu, convention="sum", dtype=torch.float64)
    torch.testing.assert_close((w * values * weighted_mask).sum(), plan.loss(values, weighted_mask, slice(None), cu), **F64)


# ------------------------------------------------------ scaling the advantages
def ppo_clip(logp, old_logp, advantages, eps=0.2, dual_clip=None):
    """The per-token PPO-clip loss (with dual clip for negative advantages when given), float64."""
    ratio = torch.exp(logp - old_logp)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -advantages * dual_clip), loss)
    return loss


def ppo_inputs(values, seed=0):
    """old log-probs, log-probs that move some ratios past the clip range, per-token advantages."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(values.shape, generator=g, dtype=torch.float64) * 3
    logp = old + 0.8 * torch.randn(values.shape, generator=g, dtype=torch.float64)
    return logp, old, values


@pytest.mark.parametrize("mode", ALL_MODES, indirect=True)
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_scaled_advantages_give_the_plans_ppo_clip_loss_and_gradient(mode, layout, dual_clip):
    values, mask, cu, groups, counts = step(seed=11)
    logp, old, adv = ppo_inputs(values)
    plan = StepPlan(config_of(mode), counts, group_index=groups, session_index=sessions_in(groups))
    for samples, mb_cu, (lp, o, a, m) in micro_batches(cu, layout, 2, logp, old, adv, mask):
        w = plan.token_weights(m, samples, mb_cu, convention="sum", dtype=torch.float64)
        by_advantages = lp.clone().requires_grad_(True)
        by_plan = lp.clone().requires_grad_(True)
        ours = (ppo_clip(by_advantages, o, a * w, dual_clip=dual_clip) * m).sum()
        theirs = plan.loss(ppo_clip(by_plan, o, a, dual_clip=dual_clip), m, samples, mb_cu)
        torch.testing.assert_close(ours, theirs, **F64)
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(by_advantages.grad, by_plan.grad, **F64)


def test_a_term_without_the_advantage_is_not_reweighted():
    """A KL term added to the scaled-advantage loss keeps its plain sum; reduced by the plan on its
    own and added, the total is the plan's loss of the whole per-token loss."""
    values, mask, cu, groups, counts = step(seed=12)
    logp, old, adv = ppo_inputs(values)
    ref = old + 0.1
    kl = torch.exp(ref - logp) - (ref - logp) - 1  # k3 estimator
    beta = 0.1
    plan = StepPlan(config_of("sample_mean"), counts)
    w = plan.token_weights(mask, slice(None), cu, convention="sum", dtype=torch.float64)
    pg_scaled = ppo_clip(logp, old, adv * w)
    j = plan.loss(ppo_clip(logp, old, adv) + beta * kl, mask, slice(None), cu)
    folded_kl = ((pg_scaled + beta * kl) * mask).sum()
    assert abs(float(folded_kl - j)) > 1e-3, "a KL term summed without weights is not J's KL term"
    torch.testing.assert_close((pg_scaled * mask).sum() + beta * plan.loss(kl, mask, slice(None), cu), j, **F64)


# ------------------------------------------------------ dtype, device, edges
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_dtype_and_device(device, dtype):
    values, mask, cu, groups, counts = step(seed=5)
    plan = StepPlan(config_of("token_mean"), counts)
    exact = plan.token_weights(mask, slice(None), cu, convention="mean", dp_size=2, dtype=torch.float64)
    kw = {} if dtype is None else {"dtype": dtype}
    w = plan.token_weights(mask.to(device), slice(None), cu.to(device), convention="mean", dp_size=2, **kw)
    assert w.dtype == (dtype or torch.float32) and w.device.type == device and w.is_contiguous()
    assert torch.equal(w.cpu(), exact.to(dtype or torch.float32))  # rounded once, from float64
    rows = plan.token_weights(padded(mask, cu).to(device), slice(None), convention="mean", dp_size=2, **kw)
    per_sample = (2.0 / plan.sample_denoms).to(dtype or torch.float32)
    assert rows.is_contiguous() and torch.equal(rows.cpu(), per_sample[:, None].expand(padded(mask, cu).shape))


def test_an_empty_micro_batch_has_no_weights():
    plan = StepPlan(config_of("sample_mean"), torch.tensor([3, 4]))
    assert plan.token_weights(torch.zeros(0, dtype=torch.bool), [], torch.tensor([0]), convention="sum").shape == (0,)
    assert plan.token_weights(torch.zeros(0, 5, dtype=torch.bool), [], convention="sum").shape == (0, 5)


PLAN = StepPlan(LossAggregationConfig(mode="sample_mean"), torch.tensor([3, 1, 2]))
MASK = torch.ones(6, dtype=torch.bool)
CU = torch.tensor([0, 3, 4, 6])
# (arguments changed from a valid call, the error, the start of its message)
BAD = [
    ({"mask": [1, 1, 0]}, TypeError, "mask must be a tensor, got list"),
    ({"mask": MASK.to_sparse()}, TypeError, "StepPlan.token_weights: mask must be a dense (strided) tensor, got layout torch.sparse_coo"),
    ({"mask": MASK.to(torch.complex64)}, TypeError, "StepPlan.token_weights: mask must have dtype bool, an integer dtype"),
    ({"cu_seqlens": None}, ValueError, "mask must be [B, T] when cu_seqlens is None (padded layout), got shape (6,)"),
    ({"mask": MASK.view(2, 3)}, ValueError, "mask must be [T] when cu_seqlens is given (packed layout), got shape (2, 3)"),
    ({"cu_seqlens": [0, 3, 4, 6]}, TypeError, "cu_seqlens must be a 1-D int32/int64 tensor [B+1], got list"),
    ({"cu_seqlens": torch.tensor([0, 3, 4, 5])}, ValueError, "StepPlan.token_weights: cu_seqlens[-1] must equal the number of tokens T = 6, got 5"),
    ({"cu_seqlens": torch.tensor([0.0, 3.0, 4.0, 6.0])}, TypeError, "StepPlan.token_weights: cu_seqlens must have dtype int32 or int64, got Float"),
    ({"cu_seqlens": torch.tensor([0, 4, 3, 6])}, ValueError, "cu_seqlens must be non-decreasing, got cu_seqlens[2] = 3 < cu_seqlens[1] = 4"),
    ({"samples": [0, 1]}, ValueError, "samples selects 2 sample(s) but cu_seqlens has 3: one position per sample of the micro-batch"),
    ({"samples": [0, 1, 3]}, ValueError, "samples must be positions in [0, 3) among this rank's samples, got values in [0, 3]"),
    ({"convention": "average"}, ValueError, "convention must be one of sum, mean, micro_batch_mean, megatron, got 'average'"),
    ({"dp_size": 0}, ValueError, "dp_size must be an integer >= 1, got 0"),
    ({"num_micro_batches": 2.0}, ValueError, "num_micro_batches must be an integer >= 1, got 2.0"),
    ({"dtype": torch.int64}, TypeError, "dtype must be a floating torch.dtype (the weights are 1/d[i]), got torch.int64"),
    ({"dtype": "float32"}, TypeError, "dtype must be a floating torch.dtype (the weights are 1/d[i]), got 'float32'"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD, ids=[f"{next(iter(c))}-{i}" for i, (c, _, _) in enumerate(BAD)])
def test_bad_arguments_are_named(change, error, message):
    args = {"mask": MASK, "samples": [0, 1, 2], "cu_seqlens": CU, "convention": "sum", **change}
    with pytest.raises(error, match=re.escape(message)):
        PLAN.token_weights(args.pop("mask"), args.pop("samples"), args.pop("cu_seqlens"), **args)


def test_the_convention_must_be_given():
    with pytest.raises(TypeError, match="convention"):
        PLAN.token_weights(MASK, [0, 1, 2], CU)
