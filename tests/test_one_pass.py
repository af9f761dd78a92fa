"""One read of the tokens: ``segment_sum_and_count`` and the route ``aggregate`` takes with it.

``aggregate`` without ``sample_denoms`` (the batch is the whole step) reads the loss and the
mask once: the per-sample sums and token counts come from one pass, the denominators from the
counts (the plan of docs/modes.md), and J from the sums (docs/ops.md). Everything here is
checked bitwise against the two-pass route it replaces: ``token_counts``, a plan, then
``reduce``.
"""

from __future__ import annotations

import pytest
import torch
from batches import LAYOUTS, MASK_DTYPES, VALUE_DTYPES, every_path_batch, long_batch, make_batch, many_short_batch

import lossagg
from lossagg.modes import MODES

_ORDER = ("baseline", "avx2", "avx512")
ISAS = [isa for isa in _ORDER if _ORDER.index(isa) <= _ORDER.index(lossagg._native.cpu_best_isa())]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int64 if t.element_size() == 8 else torch.int32 if t.element_size() == 4 else torch.int16)


def two_passes(values, mask, cu):
    return torch.ops.lossagg.segment_sum(values, mask, cu), torch.ops.lossagg.token_counts(mask, cu)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("mask_dtype", [*MASK_DTYPES, torch.float64, torch.bfloat16])
def test_sums_and_counts_are_those_of_segment_sum_and_token_counts(device, layout, dtype, mask_dtype):
    b = make_batch(layout, dtype=dtype, mask_dtype=mask_dtype, device=device)
    sums, counts = torch.ops.lossagg.segment_sum_and_count(b.values, b.mask, b.cu_seqlens)
    want_sums, want_counts = two_passes(b.values, b.mask, b.cu_seqlens)
    assert counts.dtype == torch.int64 and sums.dtype == want_sums.dtype
    assert torch.equal(bits(sums), bits(want_sums))
    assert torch.equal(counts.cpu(), want_counts.cpu())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_every_summation_path_on_every_instruction_set(isa, threads, mask_dtype):
    """Windows, the short loop, the lanes (with their tail), pieces: sums and counts of one pass."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        lossagg.set_cpu_isa(isa)
        for b in (every_path_batch(torch.float32, mask_dtype), long_batch("cpu"), many_short_batch()):
            mask = b.mask.to(mask_dtype) if b.mask.dtype != mask_dtype else b.mask
            sums, counts = torch.ops.lossagg.segment_sum_and_count(b.values.detach(), mask, b.cu_seqlens)
            want_sums, want_counts = two_passes(b.values.detach(), mask, b.cu_seqlens)
            nan = torch.isnan(want_sums)
            assert torch.equal(torch.isnan(sums), nan)
            assert torch.equal(bits(sums)[~nan], bits(want_sums)[~nan])
            assert torch.equal(counts, want_counts)
    finally:
        lossagg.set_cpu_isa("auto")
        torch.set_num_threads(before)


def test_counts_against_a_count_written_for_clarity():
    mask = torch.tensor([0.0, 2.5, -1.0, 0.0, float("nan"), -0.0, 1.0])  # a weight of any sign counts; NaN counts; -0.0 does not
    cu = torch.tensor([0, 3, 3, 7])
    _, counts = torch.ops.lossagg.segment_sum_and_count(torch.ones(7), mask, cu)
    assert counts.tolist() == [2, 0, 2]


def test_metric_dimension_is_refused_by_name():
    message = r"segment_sum_and_count: values must be \[T\] when cu_seqlens is given \(packed layout\), got shape \[2, 5\]"
    with pytest.raises(RuntimeError, match=message):
        torch.ops.lossagg.segment_sum_and_count(torch.zeros(2, 5), torch.ones(5, dtype=torch.bool), torch.tensor([0, 5]))


# ------------------------------------------------------------------ aggregate
def _register_squared_mode():
    spec = lossagg.ModeSpec(
        name="one_pass_test_sqrt",
        summary="test mode: d[i] = N · sqrt(c(M[i]))",
        formula="(1/N) Σ_i Σ_t m·l / sqrt(c(M[i]))",
        denom_formula="N · sqrt(c(M[i]))",
        totals=("num_samples",),
        denoms=lambda x: float(x.totals.num_samples) * x.token_counts.clamp(min=1.0).sqrt(),
        reference=lambda r: sum(r.numerators[i] / max(float(r.token_counts[i]), 1.0) ** 0.5 for i in range(len(r.numerators))) / len(r.numerators),
    )
    return lossagg.register_mode(spec)


@pytest.fixture
def registered_mode():
    spec = _register_squared_mode()
    yield spec.name
    lossagg.unregister_mode(spec.name)


def _config(mode):
    spec = MODES[mode]
    return lossagg.LossAggregationConfig(mode=mode, **dict(spec.example_settings))


def _plan_then_reduce(config, values, mask, cu, groups):
    d = lossagg.StepPlan.from_mask(config, mask, cu, group_index=groups).sample_denoms
    return lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_aggregate_has_the_bits_of_plan_then_reduce(device, registered_mode, layout, dtype, mask_dtype):
    for mode in MODES:
        b = make_batch(layout, dtype=dtype, mask_dtype=mask_dtype, device=device, requires_grad=True)
        groups = torch.tensor([0, 0, 1, 1, 2, 2], device=device)
        config = _config(mode)
        got = lossagg.aggregate(config, b.values, b.mask, cu_seqlens=b.cu_seqlens, group_index=groups)
        (g_got,) = torch.autograd.grad(got, b.values)
        want = _plan_then_reduce(config, b.values, b.mask, b.cu_seqlens, groups)
        (g_want,) = torch.autograd.grad(want, b.values)
        assert got.dtype == want.dtype and torch.equal(bits(got), bits(want)), (mode, got, want)
        assert torch.equal(bits(g_got), bits(g_want)), mode


def test_aggregate_one_pass_equals_the_float64_reference():
    b = make_batch("packed64", dtype=torch.float64, mask_dtype=torch.float32)
    counts = lossagg.token_counts(b.mask, b.cu_seqlens).double()
    for mode in ("sample_mean", "token_mean", "max_length"):
        config = lossagg.LossAggregationConfig(mode=mode)
        got = lossagg.aggregate(config, b.values, b.mask, cu_seqlens=b.cu_seqlens)
        sums = [(b.values[s:e] * b.mask[s:e].double()).sum() for s, e in zip(b.cu_seqlens[:-1].tolist(), b.cu_seqlens[1:].tolist(), strict=True)]
        n, c = len(sums), counts.clamp(min=1)
        want = {
            "sample_mean": sum(x / ci for x, ci in zip(sums, c, strict=True)) / n,
            "token_mean": sum(sums) / max(float(counts.sum()), 1.0),
            "max_length": sum(sums) / (n * float(c.max())),
        }[mode]
        assert got.item() == pytest.approx(float(want), rel=1e-13, abs=1e-15)


def test_aggregate_reads_the_tokens_once(monkeypatch):
    """No token_counts or segment_sum pass besides the one segment_sum_and_count (the final
    reduce reads B values)."""
    calls = []
    real = torch.ops.lossagg.token_counts.default

    def counting(*args):
        calls.append("token_counts")
        return real(*args)

    b = make_batch("packed32", requires_grad=True)
    monkeypatch.setattr(torch.ops.lossagg.token_counts, "default", counting)
    with torch.autograd.profiler.profile() as prof:
        lossagg.aggregate(lossagg.LossAggregationConfig(mode="token_mean"), b.values, b.mask, cu_seqlens=b.cu_seqlens)
    names = [e.name for e in prof.function_events if e.name.startswith("lossagg::")]
    assert names.count("lossagg::segment_sum_and_count") == 1
    assert "lossagg::token_counts" not in names and "lossagg::segment_sum" not in names, names
    assert [n for n in names if n == "lossagg::reduce"] == ["lossagg::reduce"]


def test_aggregate_with_another_rollout_mask_counts_that_mask():
    b = make_batch("packed32")
    rollout = torch.ones_like(b.mask)
    config = lossagg.LossAggregationConfig(mode="sample_mean")
    got = lossagg.aggregate(config, b.values, b.mask, cu_seqlens=b.cu_seqlens, rollout_mask=rollout)
    want = _plan_then_reduce(config, b.values, b.mask, b.cu_seqlens, None)
    d = lossagg.StepPlan.from_mask(config, rollout, b.cu_seqlens).sample_denoms
    assert torch.equal(got, lossagg.reduce(b.values, b.mask, cu_seqlens=b.cu_seqlens, sample_denoms=d))
    assert not torch.equal(got, want)  # the rollout mask, not the loss mask, sets d


def test_aggregate_names_bad_input_as_reduce_does():
    config = lossagg.LossAggregationConfig(mode="sample_mean")
    with pytest.raises(ValueError, match=r"lossagg.reduce: values has shape \[2, 5\]"):
        lossagg.aggregate(config, torch.zeros(2, 5), torch.ones(5, dtype=torch.bool), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the number of tokens T = 5, got 4"):
        lossagg.aggregate(config, torch.zeros(5), torch.ones(5, dtype=torch.bool), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(TypeError, match="lossagg.reduce: values must be a torch.Tensor, got list"):
        lossagg.aggregate(config, [0.0] * 5, torch.ones(5, dtype=torch.bool), cu_seqlens=torch.tensor([0, 5]))
    mask = torch.ones(5, requires_grad=True)
    with pytest.raises(ValueError, match="not differentiable in mask"):
        lossagg.aggregate(config, torch.zeros(5, requires_grad=True), mask, cu_seqlens=torch.tensor([0, 5]))


def test_aggregate_double_backward_matches_reduce():
    """The gradient is differentiable in the incoming gradient, as reduce's is."""
    b = make_batch("padded", dtype=torch.float64, requires_grad=True)
    config = lossagg.LossAggregationConfig(mode="sample_mean")

    def second(route):
        u = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(route(b.values), b.values, grad_outputs=u, create_graph=True)
        (gu,) = torch.autograd.grad((g * g).sum(), u)
        return g, gu

    got = second(lambda v: lossagg.aggregate(config, v, b.mask))
    want = second(lambda v: _plan_then_reduce(config, v, b.mask, None, None))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_op_itself_is_not_differentiable():
    b = make_batch("packed32", requires_grad=True)
    sums, _ = torch.ops.lossagg.segment_sum_and_count(b.values, b.mask, b.cu_seqlens)
    with pytest.raises(RuntimeError, match="segment_sum_and_count is not differentiable"):
        sums.sum().backward()


def test_aggregate_under_torch_compile():
    b = make_batch("packed32", requires_grad=True)
    config = lossagg.LossAggregationConfig(mode="token_mean")
    compiled = torch.compile(lambda v: lossagg.aggregate(config, v, b.mask, cu_seqlens=b.cu_seqlens), backend="aot_eager")
    got = compiled(b.values)
    want = _plan_then_reduce(config, b.values, b.mask, b.cu_seqlens, None)
    assert torch.equal(got, want)
