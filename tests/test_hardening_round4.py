"""Round 4 of hostile input (docs/ops.md, "Bad input"): one answer per input on every route.

* The one-pass routes of ``lossagg.aggregate`` (the native ``aggregate`` op, ``reduce_with_counts``)
  and plan-then-reduce (``StepPlan`` + ``reduce``) give the same bits or the same error (type and
  message), over random modes, settings, dtypes and hostile denominators and masks (a property test);
  the CUDA composite of ``aggregate``, run on CPU tensors, too.
* A token count is a non-zero entry of the mask the user passed, for every mask dtype: a float64
  mask entry that float32 rounds to 0 still counts, in ``segment_sum_and_count`` as in ``token_counts``.
* ``DenomProduct`` cannot change under the registry; its factors are strings, named otherwise.
* Meta (data-less) tensors are refused by the argument's own name on every entry point that reads them.
* The sequence objectives keep NaN/inf under a zero mask, and the overflow of a clipped branch, out of
  the gradient (values and gradients against float64).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossagg
from lossagg import LossAggregationConfig, StepPlan
from lossagg.ops import _aggregate_composite
from lossagg.sequence import SEQUENCE_OBJECTIVES

VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
PRODUCT_MODES = ("sample_mean", "token_mean", "constant", "max_length")


def outcome(fn):
    """('ok', bits) or ('error', type, message) of a call."""
    try:
        out = fn()
    except (TypeError, ValueError) as exc:
        return ("error", type(exc).__name__, str(exc))
    return ("ok", out.detach().to(torch.float64).item(), str(out.dtype))


def plan_route(config, values, mask, cu):
    return lambda: lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=StepPlan.from_mask(config, mask, cu).sample_denoms)


@settings(max_examples=150, deadline=None)
@given(
    mode=st.sampled_from(PRODUCT_MODES + ("prompt_mean",)),
    dtype=st.sampled_from(VALUE_DTYPES),
    mask_dtype=st.sampled_from((torch.bool, torch.int32, torch.float32, torch.float64)),
    divisor=st.sampled_from((1e-46, 1e-300, 1e-30, 0.5, 3.0, 1e38, 1e300)),
    empty=st.sampled_from(("count", "skip")),
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    tiny=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_pass_and_plan_routes_agree(mode, dtype, mask_dtype, divisor, empty, lengths, tiny, seed):
    g = torch.Generator().manual_seed(seed)
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    t = int(cu[-1])
    values = (torch.randn(t, generator=g) * 3).to(dtype)
    kept = torch.rand(t, generator=g) < 0.7
    mask = kept.to(mask_dtype)
    if mask_dtype == torch.float64 and tiny and t:
        mask[torch.nonzero(kept).flatten()[:1]] = 1e-300  # kept by the user's mask, 0 once rounded to float32
    settings_ = {"mode": mode, "empty_samples": empty}
    if mode == "constant":
        settings_["divisor"] = divisor
    if mode == "prompt_mean":
        settings_["n_samples_per_prompt"] = 1
    config = LossAggregationConfig(**settings_)
    groups = torch.arange(len(lengths)) if mode == "prompt_mean" else None
    one_pass = outcome(lambda: lossagg.aggregate(config, values, mask, cu_seqlens=cu, group_index=groups))
    plan = outcome(
        lambda: lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=StepPlan.from_mask(config, mask, cu, group_index=groups).sample_denoms)
    )
    assert one_pass == plan
    program = lossagg.MODES[mode].denoms.program(empty) if isinstance(lossagg.MODES[mode].denoms, lossagg.DenomProduct) else None
    if program is not None and plan[0] == "ok":  # the CUDA composite, on CPU tensors
        composite = outcome(lambda: _aggregate_composite(values, mask, cu, program, config.divisor or 0.0)[0])
        assert composite == plan


def test_denominator_zero_in_the_division_dtype_is_refused_on_every_route():
    config = LossAggregationConfig(mode="constant", divisor=1e-46)
    values, mask, cu = torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3])
    message = r"lossagg.reduce: sample_denoms\[0\] = 1e-46 is 0 in Float, the dtype the division happens in for Float values"
    with pytest.raises(ValueError, match=message):
        lossagg.aggregate(config, values, mask, cu_seqlens=cu)
    with pytest.raises(ValueError, match=message):
        plan_route(config, values, mask, cu)()
    with pytest.raises(RuntimeError, match="ValueError: " + message):  # the raw op: the stable ABI's RuntimeError, the message's kind first
        torch.ops.lossagg.aggregate(values, mask, cu, lossagg.MODES["constant"].denoms.program("count"), 1e-46)
    with pytest.raises(ValueError, match=message):
        _aggregate_composite(values, mask, cu, lossagg.MODES["constant"].denoms.program("count"), 1e-46)
    # float64 values divide in float64: accepted, the float64 number
    got = lossagg.aggregate(config, values.double(), mask, cu_seqlens=cu)
    assert got.item() == pytest.approx(3 / (1 * 1e-46), rel=1e-15)


def test_a_token_count_is_a_non_zero_entry_of_the_mask_passed():
    mask = torch.tensor([1e-300, 1.0, -1e-320, 0.0], dtype=torch.float64)
    cu = torch.tensor([0, 2, 4])
    assert lossagg.token_counts(mask, cu).tolist() == [2, 1]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        _, counts = torch.ops.lossagg.segment_sum_and_count(torch.ones(4, dtype=dtype), mask, cu)
        assert counts.tolist() == [2, 1], dtype
    config = LossAggregationConfig(mode="token_mean")
    one_pass, plan = lossagg.aggregate(config, torch.ones(4), mask, cu_seqlens=cu), plan_route(config, torch.ones(4), mask, cu)()
    assert torch.equal(one_pass, plan) and plan.item() == pytest.approx(1 / 3)  # T = 3 tokens; the tiny entries weigh 0 in float32


def test_denoms_that_require_grad_are_refused_by_aggregate_as_by_plan_loss():
    w = torch.tensor(2.0, requires_grad=True)
    spec = lossagg.ModeSpec(
        name="round4_grad_denoms",
        summary="test mode: d[i] = w · N",
        formula="(1/(wN)) Σ_i Σ_t m·l",
        denom_formula="w · N",
        totals=("num_samples",),
        denoms=lambda x: w * x.token_counts.new_full(x.token_counts.shape, float(x.totals.num_samples)),
        reference=lambda r: sum(r.numerators) / (2.0 * len(r.numerators)),
    )
    lossagg.register_mode(spec)
    try:
        config = LossAggregationConfig(mode=spec.name)
        values = torch.ones(3, requires_grad=True)
        mask, cu = torch.ones(3, dtype=torch.bool), torch.tensor([0, 1, 3])
        message = "not differentiable in sample_denoms, which requires grad"
        with pytest.raises(ValueError, match=message):
            StepPlan.from_mask(config, mask, cu).loss(values, mask, slice(None), cu)
        with pytest.raises(ValueError, match=message):
            lossagg.aggregate(config, values, mask, cu_seqlens=cu)
    finally:
        lossagg.unregister_mode(spec.name)


def test_denom_product_is_immutable_and_names_bad_factors():
    product = lossagg.DenomProduct("N", "c(M[i])")
    for name in ("factors", "formula", "totals", "_programs"):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(product, name, ("L",))
    assert product.factors == ("N", "c(M[i])") and product.program("count") is not None
    with pytest.raises(TypeError, match=r"separate strings.*got list \['N'\].*DenomProduct\(\*\['N'\]\)"):
        lossagg.DenomProduct(["N"])
    with pytest.raises(TypeError, match="got int 3"):
        lossagg.DenomProduct("N", 3)


# ------------------------------------------------------------------ meta tensors
def meta(t):
    return t.to("meta")


def test_meta_tensors_are_named_by_the_argument():
    mask = torch.ones(5, dtype=torch.bool)
    cu = torch.tensor([0, 2, 5])
    plan = StepPlan(LossAggregationConfig(mode="sample_mean"), torch.tensor([2.0, 3.0]))
    cases = {
        "cu_seqlens (token_counts)": (lambda: lossagg.token_counts(mask, meta(cu)), "cu_seqlens must hold data"),
        "mask (token_counts)": (lambda: lossagg.token_counts(meta(mask), cu), "mask must hold data"),
        "samples (sample_denoms_for)": (lambda: plan.sample_denoms_for(meta(torch.tensor([0, 1]))), "samples must hold data"),
        "samples (loss)": (lambda: plan.loss(torch.ones(5), mask, meta(torch.tensor([0, 1])), cu), "samples must hold data"),
        "cu_seqlens (loss)": (lambda: plan.loss(torch.ones(5), mask, [0, 1], meta(cu)), "cu_seqlens must hold data"),
        "samples (token_weights)": (
            lambda: plan.token_weights(mask, meta(torch.tensor([0, 1])), cu, convention="sum"),
            "samples must hold data",
        ),
        "cu_seqlens (token_weights)": (lambda: plan.token_weights(mask, [0, 1], meta(cu), convention="sum"), "cu_seqlens must hold data"),
        "cu_seqlens (broadcast_to_tokens)": (lambda: lossagg.broadcast_to_tokens(torch.ones(2), mask, meta(cu)), "cu_seqlens must hold data"),
        "per_sample (broadcast_to_tokens)": (lambda: lossagg.broadcast_to_tokens(meta(torch.ones(2)), mask, cu), "per_sample must hold data"),
        "rollout_mask (aggregate)": (
            lambda: lossagg.aggregate(LossAggregationConfig(), torch.ones(5), mask, cu_seqlens=cu, rollout_mask=meta(mask)),
            "rollout_mask must hold data",
        ),
        "mask (aggregate)": (lambda: lossagg.aggregate(LossAggregationConfig(), torch.ones(5), meta(mask), cu_seqlens=cu), "mask must hold data"),
        "cu_seqlens (aggregate)": (
            lambda: lossagg.aggregate(LossAggregationConfig(), torch.ones(5), mask, cu_seqlens=meta(cu)),
            "cu_seqlens must hold data",
        ),
    }
    for what, (call, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            call()
        assert what


def test_aggregate_blames_a_rollout_mask_of_the_wrong_length_on_it():
    mask = torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"rollout_mask must have the shape of mask \(5,\), got \(4,\)"):
        lossagg.aggregate(LossAggregationConfig(), torch.ones(5), mask, cu_seqlens=torch.tensor([0, 5]), rollout_mask=torch.ones(4, dtype=torch.bool))


def test_small_surfaces_name_their_arguments():
    # all_reduce_sum's argument is `group` (not `cp_group`, the sequence reductions' name for it)
    with pytest.raises(ValueError, match="^group was given but torch.distributed is not initialised"):
        lossagg.all_reduce_sum(torch.ones(1), group=object())
    with pytest.raises(lossagg.ConfigError) as info:
        LossAggregationConfig.from_dict({1: 2})
    assert info.value.issues[0][0] == "1"
    plan = StepPlan(LossAggregationConfig(mode="token_mean"), torch.full((100,), 1e6))
    with pytest.raises(ValueError, match=r"weight of sample 0 is 1e-08, which is 0.0 in torch.float16"):
        plan.token_weights(torch.ones(100, 3, dtype=torch.bool), slice(None), convention="sum", dtype=torch.float16)


# ----------------------------------------------------------- sequence objectives
def _step(dtype, log_ratio_of_first: float):
    cu = torch.tensor([0, 3, 6])
    mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool)
    log_prob = torch.tensor([-1.0, -1.5, float("nan"), -0.5, float("inf"), -2.0], dtype=dtype)
    old = torch.tensor([-1.0, -1.5, float("nan"), -0.7, float("-inf"), -1.9], dtype=dtype)
    old[:2] = log_prob[:2] - log_ratio_of_first  # sample 0's mean log ratio
    return log_prob, old, mask, cu


@pytest.mark.parametrize("name", sorted(SEQUENCE_OBJECTIVES))
@pytest.mark.parametrize("log_ratio", [0.1, 100.0])
def test_sequence_objectives_keep_nan_and_overflow_out_of_the_gradient(name, log_ratio):
    obj = SEQUENCE_OBJECTIVES[name]
    adv = torch.tensor([1.0, -0.5])
    kwargs = {"eps_low": 0.2, "eps_high": 0.28}
    results = {}
    for dtype in (torch.float32, torch.float64):
        log_prob, old, mask, cu = _step(dtype, log_ratio)
        log_prob.requires_grad_(True)
        j = lossagg.aggregate(obj.config(), obj.token_loss(log_prob, old, adv.to(dtype), mask, cu, **kwargs), mask, cu_seqlens=cu)
        j.backward()
        grad = log_prob.grad
        assert torch.isfinite(j), (name, dtype, j)
        assert torch.isfinite(grad).all(), (name, dtype, grad)
        assert (grad[~mask] == 0).all(), (name, dtype, grad)
        results[dtype] = (j.item(), grad.to(torch.float64))
    (j32, g32), (j64, g64) = results[torch.float32], results[torch.float64]
    assert j32 == pytest.approx(j64, rel=1e-5, abs=1e-6)
    assert torch.allclose(g32, g64, rtol=1e-5, atol=1e-6), (name, g32, g64)
    if log_ratio > 50 and name in ("gspo", "luspo", "gmpo"):  # the clipped branch: a constant, gradient 0 on sample 0
        assert (g64[:3] == 0).all()


def test_gspo_clipped_branch_value_is_the_bound():
    log_prob, old, mask, cu = _step(torch.float32, 100.0)
    loss = lossagg.gspo_token_loss(log_prob, old, torch.tensor([2.0, -0.5]), mask, cu, eps_low=0.2, eps_high=0.28)
    assert loss[0].item() == pytest.approx(-1.28 * 2.0) and math.isfinite(loss[3].item())
