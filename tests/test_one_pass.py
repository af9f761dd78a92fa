"""One read of the tokens: ``segment_sum_and_count`` and the route ``aggregate`` takes with it.

``aggregate`` without ``sample_denoms`` (the batch is the whole step) reads the loss and the
mask once: the per-sample sums and token counts come from one pass, the denominators from the
counts (the plan of docs/modes.md), and J from the sums (docs/ops.md). Everything here is
checked bitwise against the two-pass route it replaces: ``token_counts``, a plan, then
``reduce``; over random modes, settings, dtypes and hostile denominators and masks the two routes
(and the CUDA composite, on CPU tensors) give the same bits or the same error (a property test).
"""

from __future__ import annotations

import pytest
import torch
from batches import LAYOUTS, MASK_DTYPES, VALUE_DTYPES, every_path_batch, function_mode, long_batch, make_batch, many_short_batch
from conftest import DEVICES
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import grid

import lossagg
from lossagg import LossAggregationConfig, StepPlan
from lossagg.modes import MODES
from lossagg.one_pass import reduce_with_counts
from lossagg.ops import _aggregate_composite
from lossagg.testing import reference_loss

_ORDER = ("baseline", "avx2", "avx512")
ISAS = [isa for isa in _ORDER if _ORDER.index(isa) <= _ORDER.index(lossagg._native.cpu_best_isa())]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int64 if t.element_size() == 8 else torch.int32 if t.element_size() == 4 else torch.int16)


def two_passes(values, mask, cu):
    return torch.ops.lossagg.segment_sum(values, mask, cu), torch.ops.lossagg.token_counts(mask, cu)


# every pair of values in the default tier, the product in the full one (tests/tiers.py)
@pytest.mark.parametrize("device,layout,dtype,mask_dtype", grid(DEVICES, LAYOUTS, VALUE_DTYPES, [*MASK_DTYPES, torch.float64, torch.bfloat16]))
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
    spec = function_mode(
        "one_pass_test_sqrt",
        "N · sqrt(c(M[i]))",
        lambda x: float(x.totals.num_samples) * x.token_counts.clamp(min=1.0).sqrt(),
        lambda r: sum(r.numerators[i] / max(float(r.token_counts[i]), 1.0) ** 0.5 for i in range(len(r.numerators))) / len(r.numerators),
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


def _plan_then_reduce(config, values, mask, cu, groups, sessions=None):
    d = lossagg.StepPlan.from_mask(config, mask, cu, group_index=groups, session_index=sessions).sample_denoms
    return lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_aggregate_has_the_bits_of_plan_then_reduce(device, registered_mode, layout, dtype, mask_dtype):
    for mode in MODES:
        b = make_batch(layout, dtype=dtype, mask_dtype=mask_dtype, device=device, requires_grad=True)
        groups = torch.tensor([0, 0, 1, 1, 2, 2], device=device)
        sessions = torch.tensor([0, 0, 1, 2, 3, 3], device=device)  # nested in the groups (docs/modes.md, "Sessions")
        config = _config(mode)
        got = lossagg.aggregate(config, b.values, b.mask, cu_seqlens=b.cu_seqlens, group_index=groups, session_index=sessions)
        (g_got,) = torch.autograd.grad(got, b.values)
        want = _plan_then_reduce(config, b.values, b.mask, b.cu_seqlens, groups, sessions)
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


def test_aggregate_reads_the_tokens_once():
    """On the CPU a mode whose d[i] is a DenomProduct is one native call (sums, counts, d and J): aggregate for
    the products of step totals and M[i], aggregate_planned for those that read prompt groups or sessions (the
    plan's passes over the B counts and labels inside it). Labels the native passes do not read as they are (int32)
    take the composite: one segment_sum_and_count, the plan in Python and a reduce over the B sums. No token_counts
    or segment_sum pass."""
    b = make_batch("packed32", requires_grad=True)

    def ops(mode, **kw):
        with torch.autograd.profiler.profile() as prof:
            lossagg.aggregate(_config(mode), b.values, b.mask, cu_seqlens=b.cu_seqlens, **kw)
        return [e.name for e in prof.function_events if e.name.startswith("lossagg::")]

    for mode in ("sample_mean", "token_mean", "constant", "max_length"):
        assert ops(mode) == ["lossagg::aggregate"], mode
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    for mode in ("prompt_mean", "session_mean", "session_token_mean", "prompt_session_mean", "prompt_session_token_mean"):
        assert ops(mode, group_index=labels, session_index=torch.arange(6)) == ["lossagg::aggregate_planned"], mode
    names = ops("prompt_mean", group_index=labels.int())
    assert sorted(names) == ["lossagg::reduce", "lossagg::segment_sum_and_count"], names


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


# ------------------------------------------- the native denominators (DenomProduct programs)
PROGRAM_MODES = [name for name, spec in MODES.items() if isinstance(spec.denoms, lossagg.DenomProduct) and spec.denoms.program() is not None]


def test_every_built_in_mode_but_the_grouped_one_is_a_native_program():
    assert PROGRAM_MODES == ["sample_mean", "token_mean", "constant", "max_length"]
    assert MODES["prompt_mean"].denoms.program() is None  # its groups are planned in Python
    for name in PROGRAM_MODES:
        assert MODES[name].denom_formula == MODES[name].denoms.formula


@pytest.mark.parametrize("empty_samples", ["count", "skip"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_native_d_is_the_plans_d(empty_samples, layout, dtype):
    """d from the one native call equals the StepPlan's (DenomProduct's Python evaluation) bit for
    bit, with empty samples in the batch, and so does J."""
    b = make_batch(layout, dtype=dtype, mask_dtype=torch.float32)
    mask = b.mask.clone()
    if b.cu_seqlens is None:
        mask[1] = 0  # an empty sample
    else:
        mask[int(b.cu_seqlens[1]) : int(b.cu_seqlens[2])] = 0
    for mode in PROGRAM_MODES:
        config = lossagg.LossAggregationConfig(mode=mode, empty_samples=empty_samples, **dict(MODES[mode].example_settings))
        program = MODES[mode].denoms.program(empty_samples)
        got_j, got_d = torch.ops.lossagg.aggregate(b.values, mask, b.cu_seqlens, program, float(config.divisor or 0.0))
        plan_d = lossagg.StepPlan.from_mask(config, mask, b.cu_seqlens).sample_denoms
        assert got_d.dtype == torch.float64 and torch.equal(bits(got_d), bits(plan_d)), (mode, got_d, plan_d)
        want = lossagg.reduce(b.values, mask, cu_seqlens=b.cu_seqlens, sample_denoms=plan_d)
        assert torch.equal(bits(got_j), bits(want)), mode


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_aggregate_on_every_summation_path(isa, threads):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        lossagg.set_cpu_isa(isa)
        for b in (every_path_batch(torch.float32, torch.bool), long_batch("cpu"), many_short_batch()):
            for mode in PROGRAM_MODES:
                config = _config(mode)
                got = lossagg.aggregate(config, b.values.detach(), b.mask, cu_seqlens=b.cu_seqlens)
                want = _plan_then_reduce(config, b.values.detach(), b.mask, b.cu_seqlens, None)
                assert torch.equal(bits(got), bits(want)) or (torch.isnan(got) and torch.isnan(want)), (mode, got, want)
    finally:
        lossagg.set_cpu_isa("auto")
        torch.set_num_threads(before)


def test_the_composite_other_devices_run_has_the_bits_of_the_native_kernel():
    """CUDA runs aggregate as segment_sum_and_count + d in tensor ops + reduce (lossagg/ops.py);
    on CPU tensors that composite must give the native kernel's J and d exactly."""
    from lossagg.ops import _aggregate_composite

    for layout in LAYOUTS:
        b = make_batch(layout, dtype=torch.float32, mask_dtype=torch.bool)
        for mode in PROGRAM_MODES:
            for empty in ("count", "skip"):
                program = MODES[mode].denoms.program(empty)
                divisor = float(MODES[mode].example_settings.get("divisor", 0.0))
                got_j, got_d = _aggregate_composite(b.values, b.mask, b.cu_seqlens, program, divisor)
                want_j, want_d = torch.ops.lossagg.aggregate(b.values, b.mask, b.cu_seqlens, program, divisor)
                assert torch.equal(bits(got_j), bits(want_j)) and torch.equal(bits(got_d), bits(want_d)), (layout, mode, empty)


def test_empty_and_all_empty_batches():
    config = lossagg.LossAggregationConfig(mode="sample_mean", empty_samples="skip")
    for values, mask, cu in (
        (torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.tensor([0])),  # no sample
        (torch.randn(5), torch.zeros(5, dtype=torch.bool), torch.tensor([0, 2, 5])),  # no kept token
        (torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool), None),
    ):
        got = lossagg.aggregate(config, values, mask, cu_seqlens=cu)
        want = _plan_then_reduce(config, values, mask, cu, None)
        assert got.item() == 0.0 and torch.equal(bits(got), bits(want))


def test_an_overflowing_denominator_is_named_as_the_plan_names_it():
    config = lossagg.LossAggregationConfig(mode="constant", divisor=1e308)
    values, mask, cu = torch.randn(6), torch.ones(6, dtype=torch.bool), torch.tensor([0, 3, 6])
    with pytest.raises(ValueError) as plan_error:
        lossagg.StepPlan.from_mask(config, mask, cu)
    assert "overflows float64" in str(plan_error.value)
    with pytest.raises(ValueError) as got:
        lossagg.aggregate(config, values, mask, cu_seqlens=cu)
    assert str(got.value) == str(plan_error.value)
    with pytest.raises(RuntimeError, match=r"ValueError: lossagg.aggregate: a denominator is not finite and > 0: d\[0\] = inf"):
        torch.ops.lossagg.aggregate(values, mask, cu, [1, 5], 1e308)


@pytest.mark.parametrize(
    ("program", "divisor", "message"),
    [
        ([], 0.0, r"denom_program must be a list of 1 to 15 factor codes \(csrc/denom_program.h\), got 0"),
        ([1] * 16, 0.0, r"denom_program must be a list of 1 to 15 factor codes \(csrc/denom_program.h\), got 16"),
        ([1, 0, 6], 0.0, "denom_program factor 1 must be a code of 1 to 6, got 0"),
        ([7], 0.0, "denom_program factor 0 must be a code of 1 to 6, got 7"),
        ([1, 5], 0.0, r"divisor must be finite and > 0 \(the program divides by L\), got 0"),
        ([1, 5], float("nan"), r"divisor must be finite and > 0 \(the program divides by L\), got nan"),
    ],
)
def test_a_malformed_program_is_refused_by_name(program, divisor, message):
    values, mask, cu = torch.randn(6), torch.ones(6, dtype=torch.bool), torch.tensor([0, 3, 6])
    with pytest.raises(RuntimeError, match="ValueError: lossagg.aggregate: " + message):
        torch.ops.lossagg.aggregate(values, mask, cu, program, divisor)
    from lossagg.ops import _aggregate_composite  # the composite refuses the same programs

    with pytest.raises(ValueError, match="lossagg.aggregate: " + message):
        _aggregate_composite(values, mask, cu, program, divisor)


def test_the_op_gives_reduces_gradient():
    b = make_batch("packed32", dtype=torch.float64, requires_grad=True)
    j, d = torch.ops.lossagg.aggregate(b.values, b.mask, b.cu_seqlens, [1, 6], 0.0)
    (g,) = torch.autograd.grad(j, b.values)
    want = torch.autograd.grad(lossagg.reduce(b.values, b.mask, cu_seqlens=b.cu_seqlens, sample_denoms=d), b.values)[0]
    assert torch.equal(g, want) and not d.requires_grad
    assert torch.autograd.gradcheck(lambda v: torch.ops.lossagg.aggregate(v, b.mask, b.cu_seqlens, [1, 6], 0.0)[0], (b.values,))


def _product_mode(name, product, **changes):
    fields = dict(
        name=name,
        summary="test mode: a declared product",
        formula="Σ_i Σ_t m·l / (N · c(T))",
        denom_formula=product.formula,
        totals=("num_samples", "total_tokens"),
        denoms=product,
        reference=lambda r: sum(r.numerators) / (len(r.numerators) * max(sum(r.token_counts), 1.0)),
    )
    fields.update(changes)
    return lossagg.ModeSpec(**fields)


def test_a_registered_product_mode_runs_natively_with_the_plans_bits():
    spec = lossagg.register_mode(_product_mode("one_pass_product", lossagg.DenomProduct("N", "c(T)")))
    try:
        assert spec.denoms.program() == (1, 3)
        b = make_batch("packed32", requires_grad=True)
        config = lossagg.LossAggregationConfig(mode=spec.name)
        with torch.autograd.profiler.profile() as prof:
            got = lossagg.aggregate(config, b.values, b.mask, cu_seqlens=b.cu_seqlens)
        assert [e.name for e in prof.function_events if e.name.startswith("lossagg::")] == ["lossagg::aggregate"]
        want = _plan_then_reduce(config, b.values, b.mask, b.cu_seqlens, None)
        assert torch.equal(bits(got), bits(want))
        reference = reference_loss(config, b.values.detach(), b.mask, b.cu_seqlens)  # the mode's own formula, float64
        assert got.item() == pytest.approx(float(reference), rel=1e-5)
    finally:
        lossagg.unregister_mode(spec.name)


def test_a_config_used_again_reads_the_program_its_mode_has_now():
    """aggregate keeps each config's native program for its next call (a config is immutable): every call has the
    plan's bits and is one native op, and a mode registered again under the same name is read anew."""
    b = make_batch("packed32", requires_grad=True)
    name = "one_pass_again"
    spec = lossagg.register_mode(_product_mode(name, lossagg.DenomProduct("N", "c(T)")))
    config = lossagg.LossAggregationConfig(mode=name)
    try:
        for product, totals in ((("N", "c(T)"), ("num_samples", "total_tokens")), (("N", "c(M[i])"), ("num_samples",))):
            if product != ("N", "c(T)"):  # the same name, another d: the next call must not reuse the first program
                lossagg.unregister_mode(name)
                spec = lossagg.register_mode(_product_mode(name, lossagg.DenomProduct(*product), totals=totals))
            want = _plan_then_reduce(config, b.values, b.mask, b.cu_seqlens, None)
            (g_want,) = torch.autograd.grad(want, b.values)
            for _ in range(3):
                with torch.autograd.profiler.profile() as prof:
                    got = lossagg.aggregate(config, b.values, b.mask, cu_seqlens=b.cu_seqlens)
                assert [e.name for e in prof.function_events if e.name.startswith("lossagg::")] == ["lossagg::aggregate"]
                (g_got,) = torch.autograd.grad(got, b.values)
                assert torch.equal(bits(got), bits(want)) and torch.equal(bits(g_got), bits(g_want)), product
                with torch.no_grad():
                    assert torch.equal(bits(lossagg.aggregate(config, b.values, b.mask, cu_seqlens=b.cu_seqlens)), bits(want.detach()))
    finally:
        lossagg.unregister_mode(spec.name)
    # a config seen before, without a gradient: the op alone, and still the refusals of the general route
    config, values, cu = lossagg.LossAggregationConfig(mode="sample_mean"), torch.randn(6), torch.tensor([0, 2, 6])
    want = lossagg.aggregate(config, values, torch.ones(6), cu_seqlens=cu)
    strided = torch.randn(12)[::2]  # not contiguous: read through the general route's checks
    with torch.no_grad():
        got = lossagg.aggregate(config, strided, torch.ones(6), cu_seqlens=cu)
    assert torch.equal(bits(got), bits(lossagg.aggregate(config, strided.contiguous(), torch.ones(6), cu_seqlens=cu)))
    with pytest.raises(ValueError, match=r"lossagg.reduce: not differentiable in mask, which requires grad"):
        lossagg.aggregate(config, values, torch.ones(6, requires_grad=True), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"lossagg.aggregate: .*cu_seqlens"):
        lossagg.aggregate(config, values, torch.ones(6), cu_seqlens=torch.tensor([0, 2, 7]))
    assert torch.equal(bits(lossagg.aggregate(config, values, torch.ones(6), cu_seqlens=cu)), bits(want))
    with pytest.raises(ValueError, match="per_token_loss must hold data"):  # the checks the usual call skips still name their argument
        lossagg.aggregate(
            lossagg.LossAggregationConfig(mode="sample_mean"), torch.zeros(5, device="meta"), torch.ones(5), cu_seqlens=torch.tensor([0, 5])
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"denom_formula": "N · T"}, r"denom_formula of mode 'bad_product' must be the formula of its DenomProduct, 'N · c\(T\)'"),
        ({"totals": ("num_samples",)}, "reads the step total\\(s\\) total_tokens, which ModeSpec.totals does not declare"),
        ({"needs_divisor": True}, "needs_divisor of mode 'bad_product' must be False"),
    ],
)
def test_a_product_mode_that_contradicts_its_entry_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        lossagg.register_mode(_product_mode("bad_product", lossagg.DenomProduct("N", "c(T)"), **changes))
    assert "bad_product" not in MODES


def test_denom_product_refuses_unknown_factors():
    with pytest.raises(ValueError, match=r"DenomProduct factor 'c\(M\)' is not one of N, P, c\(T\)"):
        lossagg.DenomProduct("N", "c(M)")
    with pytest.raises(ValueError, match="DenomProduct takes 1 to 15 factors, got 0"):
        lossagg.DenomProduct()


# ------------------------------------- segments summed side by side (csrc/cpu/engine_loops.h)
def _runs_of_long_segments(mask_dtype, many=False):
    """Runs of segments of kBlock (64) tokens or more, whose blocks the AVX-512 kernel
    interleaves two at a time and whose tails it finishes sixteen at a time, broken by short
    ones and ending in a partial run; tails of 0 to 63 tokens, NaN and inf under a zero mask,
    -0.0 values and weights. ``many``: 700 segments (most of them long, every tail length),
    enough tokens for the call to be split between threads, so every thread's batch is
    flushed part-full."""
    g = torch.Generator().manual_seed(28)
    lengths = [64, 127, 128, 300, 65, 191, 64, 64, 5, 70, 700, 256, 63, 64, 129, 130, 131, 200, 77, 3, 64, 100, 90]
    if many:
        lengths = torch.randint(1, 400, (700,), generator=g).tolist()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    t = int(cu[-1])
    values = torch.randn(3, t, generator=g)
    values[:, ::17] = float("nan")
    values[:, 5::23] = float("inf")
    values[:, 7::29] = -0.0
    keep = torch.rand(t, generator=g) < 0.8
    keep[::17] = False
    keep[5::23] = False
    mask = keep if mask_dtype == torch.bool else torch.where(keep, torch.rand(t, generator=g) * 2 - 0.5, torch.zeros(t))
    if mask_dtype != torch.bool:
        mask[11::31] = -0.0
    return values, mask, cu


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("many", [False, True], ids=["runs", "many"])
def test_segments_side_by_side_have_the_bits_of_every_instruction_set(mask_dtype, threads, many):
    values, mask, cu = _runs_of_long_segments(mask_dtype, many)
    before = torch.get_num_threads()
    got = {}
    try:
        torch.set_num_threads(threads)
        for isa in ISAS:
            lossagg.set_cpu_isa(isa)
            sums, counts = torch.ops.lossagg.segment_sum_and_count(values[0], mask, cu)
            got[isa] = (
                torch.ops.lossagg.segment_sum(values, mask, cu),
                sums,
                counts,
                torch.ops.lossagg.reduce(values[1], mask, cu, torch.linspace(0.5, 3.0, cu.numel() - 1, dtype=torch.float64)),
            )
    finally:
        lossagg.set_cpu_isa("auto")
        torch.set_num_threads(before)
    want = got["baseline"]
    assert torch.equal(bits(want[0][0]), bits(want[1]))  # the one pass sums as segment_sum does
    for isa, outs in got.items():
        for a, b in zip(outs, want, strict=True):
            assert torch.equal(bits(a), bits(b)), isa
    kept = [int((mask[s:e] != 0).sum()) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    assert got["avx512" if "avx512" in got else ISAS[-1]][2].tolist() == kept


# ------------------------------- one answer per input on both routes (one pass, plan then reduce)
# the property test's value dtypes (test_one_pass.py's VALUE_DTYPES, from batches, lists them in another order)
ROUTE_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
PRODUCT_MODES = ("sample_mean", "token_mean", "constant", "max_length")
SESSION_MODES = ("session_mean", "session_token_mean", "prompt_session_mean", "prompt_session_token_mean")


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
    mode=st.sampled_from(PRODUCT_MODES + ("prompt_mean",) + SESSION_MODES),
    dtype=st.sampled_from(ROUTE_VALUE_DTYPES),
    mask_dtype=st.sampled_from((torch.bool, torch.int32, torch.float32, torch.float64)),
    divisor=st.sampled_from((1e-46, 1e-300, 1e-30, 0.5, 3.0, 1e38, 1e300)),
    empty=st.sampled_from(("count", "skip")),
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    tiny=st.booleans(),
    seed=st.integers(0, 2**16),
    labels=st.sampled_from(("pairs", "runs", "any order")),
)
def test_one_pass_and_plan_routes_agree(mode, dtype, mask_dtype, divisor, empty, lengths, tiny, seed, labels):
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
    n = len(lengths)
    groups, sessions = torch.arange(n), None
    if mode in SESSION_MODES:  # aggregate_planned: the plan's passes over the labels inside the native call
        sessions = torch.arange(n) // 2 if labels != "runs" else torch.arange(n) // 3
        groups = sessions // 2 if labels != "any order" else (sessions // 2) % 2  # a group in two runs: the table
        if MODES[mode].needs_groups:
            settings_["n_samples_per_prompt"] = 2  # each group's sessions: wrong for some steps, which both routes refuse
    config = LossAggregationConfig(**settings_)
    if not MODES[mode].needs_groups:
        groups = None
    one_pass = outcome(lambda: lossagg.aggregate(config, values, mask, cu_seqlens=cu, group_index=groups, session_index=sessions))
    plan = outcome(
        lambda: lossagg.reduce(
            values, mask, cu_seqlens=cu, sample_denoms=StepPlan.from_mask(config, mask, cu, group_index=groups, session_index=sessions).sample_denoms
        )
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
    for _ in range(2):  # the second call of the config takes the op alone first (lossagg/one_pass.py): the same error
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
    spec = function_mode(
        "round4_grad_denoms",
        "w · N",
        lambda x: w * x.token_counts.new_full(x.token_counts.shape, float(x.totals.num_samples)),
        lambda r: sum(r.numerators) / (2.0 * len(r.numerators)),
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


def test_aggregate_blames_a_rollout_mask_of_the_wrong_length_on_it():
    mask = torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"rollout_mask must have the shape of mask \(5,\), got \(4,\)"):
        lossagg.aggregate(LossAggregationConfig(), torch.ones(5), mask, cu_seqlens=torch.tensor([0, 5]), rollout_mask=torch.ones(4, dtype=torch.bool))


def test_denoms_of_that_returns_no_tensor_is_named():
    values = torch.randn(6)
    mask = torch.ones(6, dtype=torch.bool)
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(
        TypeError, match=r"lossagg.reduce: sample_denoms \(what denoms_of returned\) must be a torch.Tensor of B = 2 denominators, got list"
    ):
        reduce_with_counts(values, mask, cu, lambda counts: [1.0, 2.0])
