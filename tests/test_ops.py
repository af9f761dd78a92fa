"""The native ops against the float64 reference, over device x dtype x layout x mask dtype;
gradients (gradcheck, double backward), opcheck and torch.compile."""

from __future__ import annotations

import native_ops
import pytest
import torch
from batches import LAYOUTS, MASK_DTYPES, VALUE_DTYPES, make_batch
from conftest import DEVICES
from reference import acc_dtype, fwd_tol, ref_reduce, ref_reduce_grad, ref_segment_sum
from tiers import grid

import lossagg

# Gradients are returned in the values dtype: one rounding of m / d.
GRAD_TOL = {
    torch.float32: dict(rtol=1e-6, atol=1e-7),
    torch.float64: dict(rtol=1e-12, atol=1e-14),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-6),
}


# every pair of values in the default tier, the product in the full one (tests/tiers.py)
@pytest.mark.parametrize("device,dtype,layout,mask_dtype,num_metrics", grid(DEVICES, VALUE_DTYPES, LAYOUTS, MASK_DTYPES, [None, 3]))
def test_segment_sum_matches_reference(device, dtype, layout, mask_dtype, num_metrics):
    b = make_batch(layout, dtype=dtype, mask_dtype=mask_dtype, num_metrics=num_metrics, device=device)
    out = lossagg.segment_sum(b.values, b.mask, b.cu_seqlens)
    expected = ref_segment_sum(b.values.cpu(), b.mask.cpu(), None if b.cu_seqlens is None else b.cu_seqlens.cpu())
    assert out.dtype == acc_dtype(dtype)
    assert out.shape == expected.shape
    assert out.device.type == device
    torch.testing.assert_close(out.cpu().double(), expected, **fwd_tol(dtype))


# every pair of values in the default tier, the product in the full one (tests/tiers.py)
@pytest.mark.parametrize("device,dtype,layout,mask_dtype", grid(DEVICES, VALUE_DTYPES, LAYOUTS, MASK_DTYPES))
def test_reduce_and_grad_match_reference(device, dtype, layout, mask_dtype):
    b = make_batch(layout, dtype=dtype, mask_dtype=mask_dtype, device=device, requires_grad=True)
    out = lossagg.reduce(b.values, b.mask, cu_seqlens=b.cu_seqlens, sample_denoms=b.sample_denoms)
    cu = None if b.cu_seqlens is None else b.cu_seqlens.cpu()
    expected = ref_reduce(b.values.detach().cpu(), b.mask.cpu(), b.sample_denoms.cpu(), cu)
    assert out.dim() == 0 and out.dtype == acc_dtype(dtype)
    torch.testing.assert_close(out.detach().cpu().double(), expected, **fwd_tol(dtype))

    out.backward()
    assert b.values.grad.dtype == dtype and b.values.grad.shape == b.values.shape
    expected_grad = ref_reduce_grad(b.mask.cpu(), b.sample_denoms.cpu(), cu)
    torch.testing.assert_close(b.values.grad.cpu().double(), expected_grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_sum_grad_matches_reference(device, dtype, layout):
    b = make_batch(layout, dtype=dtype, num_metrics=2, device=device, requires_grad=True)
    out = lossagg.segment_sum(b.values, b.mask, b.cu_seqlens)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device)
    (out * upstream).sum().backward()
    cu = None if b.cu_seqlens is None else b.cu_seqlens.cpu()
    values64 = b.values.detach().cpu().double().requires_grad_(True)
    (ref_segment_sum(values64, b.mask.cpu(), cu) * upstream.cpu().double()).sum().backward()
    torch.testing.assert_close(b.values.grad.cpu().double(), values64.grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_float64(device, layout):
    b = make_batch(layout, dtype=torch.float64, mask_dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: lossagg.reduce(v, b.mask, cu_seqlens=b.cu_seqlens, sample_denoms=b.sample_denoms.double()), (b.values,))
    bk = make_batch(layout, dtype=torch.float64, num_metrics=2, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: lossagg.segment_sum(v, bk.mask, bk.cu_seqlens), (bk.values,))


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_double_backward_is_exact(layout):
    g = torch.Generator().manual_seed(0)
    if layout == "packed":
        values = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
        mask = torch.rand(7, generator=g) < 0.7
        cu = torch.tensor([0, 3, 7])
        metric_values = torch.randn(2, 7, dtype=torch.float64, generator=g, requires_grad=True)
    else:
        values = torch.randn(2, 4, dtype=torch.float64, generator=g, requires_grad=True)
        mask = torch.rand(2, 4, generator=g) < 0.7
        cu = None
        metric_values = torch.randn(2, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    d = torch.tensor([3.0, 5.0], dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda v: lossagg.reduce(v, mask, cu_seqlens=cu, sample_denoms=d), (values,))
    assert torch.autograd.gradgradcheck(lambda v: lossagg.segment_sum(v, mask, cu), (metric_values,))


def sample_inputs(device, requires_grad):
    """Inputs for opcheck: every op, both layouts, a few dtypes."""
    cases = []
    for layout in ("packed32", "padded"):
        for dtype in (torch.float32, torch.bfloat16):
            b = make_batch(layout, dtype=dtype, device=device, requires_grad=requires_grad)
            bk = make_batch(layout, dtype=dtype, num_metrics=2, device=device, requires_grad=requires_grad)
            cases.append((torch.ops.lossagg.segment_sum.default, (b.values, b.mask, b.cu_seqlens)))
            cases.append((torch.ops.lossagg.segment_sum.default, (bk.values, bk.mask, bk.cu_seqlens)))
            cases.append((torch.ops.lossagg.reduce.default, (b.values, b.mask, b.cu_seqlens, b.sample_denoms)))
            cases.append((torch.ops.lossagg.segment_sum_and_count.default, (b.values, b.mask, b.cu_seqlens)))
            cases.append((torch.ops.lossagg.aggregate.default, (b.values, b.mask, b.cu_seqlens, [1, 6], 0.0)))  # N · c(M[i])
            cases.append((torch.ops.lossagg.aggregate.default, (b.values, b.mask, b.cu_seqlens, [1, 5], 8.0)))  # N · L
            grad = torch.tensor(1.5, device=device)
            cases.append(
                (
                    torch.ops.lossagg.reduce_backward.default,
                    (grad, b.mask, b.cu_seqlens, b.sample_denoms, dtype),
                )
            )
            seg_grad = torch.randn(2, b.num_segments, device=device)
            cases.append((torch.ops.lossagg.segment_sum_backward.default, (seg_grad, b.mask, b.cu_seqlens, dtype)))
            cases.append((torch.ops.lossagg.token_counts.default, (b.mask, b.cu_seqlens)))
            terms = [bk.values[k].detach().clone().requires_grad_(requires_grad) for k in range(2)]
            term_denoms = torch.stack([b.sample_denoms, b.sample_denoms * 2])
            term_weights = torch.tensor([[0.5, -1.0, 0.0, 2.0, 1.0, 3.0]] * 2, device=device)
            for weights in (None, term_weights):
                cases.append((torch.ops.lossagg.reduce_terms.default, (terms, b.mask, b.cu_seqlens, term_denoms, weights, [1.0, -0.5])))
                cases.append(
                    (torch.ops.lossagg.reduce_terms_backward.default, (grad, b.mask, b.cu_seqlens, term_denoms, weights, [1.0, -0.5], dtype))
                )
    if device == "cpu":  # a plan's totals and d (lossagg/step.py's native route): a CPU kernel only
        counts, labels = torch.tensor([3, 0, 5, 2]), torch.tensor([0, 0, 1, 1])
        # prompt_session_mean's d = P · Sp[g(i)] · K[s(i)] (codes: lossagg/step.py's _factor_codes), and c(M[i])
        program = [3, 5, 0, 0, 0, 13, 0, 0, 0, 10, 0, 0, 0, 1, -2, 0, 1, 0]
        cases.append((torch.ops.lossagg.plan_totals.default, (counts, labels, labels * 2, 1, False, True, [4, 1], True, program, [0.0, 0.0])))
        cases.append((torch.ops.lossagg.plan_totals.default, (counts.double(), None, None, -1, False, False, [], False, [1, -1, 0, 0, 0], [8.0])))
        # the labels' half done before (a closing DeferredPlan's layout), then read with the counts alone and with a block
        laid = torch.ops.lossagg.plan_layout.default(labels, labels * 2, 1, False, True, False)
        cases.append((torch.ops.lossagg.plan_layout.default, (labels, labels * 2, 1, False, True, False)))
        cases.append((torch.ops.lossagg.plan_totals.default, (counts.double(), labels, labels * 2, 1, False, True, [], False, [], [], laid)))
        cases.append((torch.ops.lossagg.plan_totals.default, (counts, labels, labels * 2, 1, False, True, [4, 1], True, program, [0.0, 0.0], laid)))
        # J and d of the step by the plan's passes: session_mean's S · K[s(i)] · c(M[i]), prompt_mean's P · c(Sg[g(i)])
        for layout in ("packed32", "padded"):
            b = make_batch(layout, dtype=torch.float32, device=device, requires_grad=requires_grad)
            labels = torch.arange(b.num_segments) // 2
            session = [3, 7, 0, 0, 0, 10, 0, 0, 0, -2, 0, 1, 0]
            planned = torch.ops.lossagg.aggregate_planned.default
            cases.append((planned, (b.values, b.mask, b.cu_seqlens, None, labels, -1, False, False, session, 0.0)))
            prompt = [2, 5, 0, 0, 0, 9, 0, 1, 0]
            cases.append((planned, (b.values, b.mask, b.cu_seqlens, labels, None, 2, True, False, prompt, 0.0)))
    return cases


def test_the_tests_list_of_ops_is_the_librarys():
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("lossagg::")}
    assert registered == set(native_ops.OPS)
    assert {op.name().split("::", 1)[1] for op, _ in sample_inputs("cpu", False)} == set(native_ops.OPS)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    for op, args in sample_inputs(device, requires_grad):
        if requires_grad and op.name().split("::", 1)[1] in native_ops.NOT_GRADCHECKED:
            continue
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("layout", ["packed32", "padded"])
def test_torch_compile_fullgraph(device, layout):
    b = make_batch(layout, dtype=torch.float32, device=device, requires_grad=True)

    def loss_fn(values, mask, denoms, cu):
        per_token = values * 2.0 - 1.0
        return lossagg.reduce(per_token, mask, cu_seqlens=cu, sample_denoms=denoms)

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    out = compiled(b.values, b.mask, b.sample_denoms, b.cu_seqlens)
    out.backward()
    grad_compiled = b.values.grad.clone()
    b.values.grad = None
    eager = loss_fn(b.values, b.mask, b.sample_denoms, b.cu_seqlens)
    eager.backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(grad_compiled, b.values.grad)
