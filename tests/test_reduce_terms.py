"""lossagg.reduce_terms, the whole loss of K terms in one pass (docs/terms.md), against the float64
reference over device x dtype x layout x mask dtype x weights; its bits against reduce's (the
single-term path) on every ISA and thread count; gradients; bad input by name."""

from __future__ import annotations

import pytest
import torch
from batches import LAYOUTS, MASK_DTYPES, VALUE_DTYPES, long_batch, make_batch
from conftest import DEVICES
from reference import acc_dtype, fwd_tol, ref_reduce_terms, ref_reduce_terms_grads
from test_golden import ISAS
from tiers import grid

import lossagg

COEFFICIENTS = [1.0, -0.01, 0.05]
# the gradient: ((g c_k) / d) w in the accumulation dtype (three roundings), then one to the values dtype
GRAD_TOL = {
    torch.float32: dict(rtol=4e-7, atol=1e-9),
    torch.float64: dict(rtol=1e-12, atol=1e-15),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-7),
    torch.float16: dict(rtol=1e-3, atol=1e-7),
}


def terms_batch(layout, dtype=torch.float32, mask_dtype=torch.bool, device="cpu", k=3, weighted=False, requires_grad=False, seed=0):
    """K value tensors of their own (not rows of one [K, T] tensor), the mask, cu_seqlens, d [K, B]
    and, when weighted, w [K, B] of both signs with zeros."""
    b = make_batch(layout, dtype=dtype, mask_dtype=mask_dtype, num_metrics=k, device=device, seed=seed)
    values = [b.values[i].clone().requires_grad_(requires_grad) for i in range(k)]
    g = torch.Generator().manual_seed(seed + 1)
    n = b.sample_denoms.shape[0]
    denoms = (1.0 + 10.0 * torch.rand(k, n, generator=g, dtype=torch.float64)).to(device)
    weights = None
    if weighted:
        weights = torch.randn(k, n, generator=g, dtype=torch.float64)
        weights[torch.rand(k, n, generator=g) < 0.2] = 0.0
        weights = weights.to(device)
    return values, b.mask, b.cu_seqlens, denoms, weights


# every pair of values in the default tier, the product in the full one (tests/tiers.py)
@pytest.mark.parametrize("device,dtype,layout,mask_dtype,weighted", grid(DEVICES, VALUE_DTYPES, LAYOUTS, MASK_DTYPES, [False, True]))
def test_reduce_terms_and_grads_match_reference(device, dtype, layout, mask_dtype, weighted):
    values, mask, cu, d, w = terms_batch(layout, dtype, mask_dtype, device, weighted=weighted, requires_grad=True)
    total, parts = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d, sample_weights=w, coefficients=COEFFICIENTS)
    cpu = lambda t: None if t is None else t.cpu()
    want, want_parts = ref_reduce_terms([v.detach().cpu() for v in values], mask.cpu(), d.cpu(), cpu(w), COEFFICIENTS, cpu(cu))
    assert total.dim() == 0 and total.dtype == acc_dtype(dtype) and parts.shape == (3,) and parts.dtype == acc_dtype(dtype)
    assert not parts.requires_grad
    tol = fwd_tol(dtype)
    torch.testing.assert_close(total.detach().cpu().double(), want, **tol)
    torch.testing.assert_close(parts.cpu().double(), want_parts, **tol)

    total.backward()
    # the coefficients and weights as the kernel reads them (in the accumulation dtype)
    acc = acc_dtype(dtype)
    c_acc = [float(torch.tensor(c, dtype=acc)) for c in COEFFICIENTS]
    w_acc = None if w is None else w.cpu().to(acc).double()
    want_grads = ref_reduce_terms_grads(mask.cpu(), d.cpu().to(acc).double(), w_acc, c_acc, cpu(cu))
    for k, v in enumerate(values):
        assert v.grad.dtype == dtype and v.grad.shape == v.shape
        torch.testing.assert_close(v.grad.cpu().double(), want_grads[k], **GRAD_TOL[dtype], msg=lambda m, k=k: f"values[{k}]: {m}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_one_term_has_the_bits_of_reduce(device, dtype, layout):
    values, mask, cu, d, _ = terms_batch(layout, dtype, device=device, k=1, requires_grad=True)
    total, parts = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d)
    v = values[0].detach().clone().requires_grad_(True)
    want = lossagg.reduce(v, mask, cu_seqlens=cu, sample_denoms=d[0])
    assert torch.equal(total, want) and torch.equal(parts[0], want.detach())
    total.backward()
    want.backward()
    assert torch.equal(values[0].grad, v.grad)


def _per_term_route(values, mask, cu, d, w, coefficients):
    """The terms one call each, with the numbers docs/ops.md ("Precision of the terms") promises:
    reduce per term (a weighted term's quotients w·S/d computed in float64 and rounded once to the
    accumulation dtype, then added as reduce adds them), c_k J_k computed in float64 and rounded
    once, the products added in order."""
    total, parts = None, []
    for k, v in enumerate(values):
        if w is None:
            part = lossagg.reduce(v, mask, cu_seqlens=cu, sample_denoms=d[k])
        else:
            sums = lossagg.segment_sum(v.detach(), mask, cu)
            quotients = (sums.double() * w[k].double() / d[k].double()).to(sums.dtype)
            rows = torch.ones((sums.shape[0], 1), dtype=torch.bool, device=sums.device)
            part = lossagg.reduce(quotients.unsqueeze(1), rows, sample_denoms=torch.ones_like(quotients))
        part = part.detach()
        parts.append(part)
        scaled = (part.double() * coefficients[k]).to(part.dtype)
        total = scaled if total is None else total + scaled
    return total, torch.stack(parts)


def _per_term_grads(values, mask, cu, d, w, coefficients):
    """d J / d values_k with an incoming gradient of 1: ((1 · c_k) / d[k, i]) · w[k, i] computed in
    float64 and rounded once to the accumulation dtype, on each kept token of sample i."""
    acc = torch.float64 if values[0].dtype == torch.float64 else torch.float32
    out = []
    for k, v in enumerate(values):
        coef = (torch.ones((), dtype=torch.float64, device=d.device) * coefficients[k]) / d[k].to(acc).double()
        if w is not None:
            coef = coef * w[k].to(acc).double()
        coef = coef.to(acc)
        if cu is None:
            per_token = coef[:, None].expand(mask.shape)
        else:
            per_token = torch.repeat_interleave(coef, (cu[1:] - cu[:-1]).long(), output_size=mask.shape[0])
        kept = mask != 0
        out.append(torch.where(kept, per_token * (mask.to(acc) if mask.dtype.is_floating_point else 1), torch.zeros_like(per_token)).to(v.dtype))
    return out


# every pair of values in the default tier, the product in the full one (tests/tiers.py)
@pytest.mark.parametrize("device,dtype,layout,weighted", grid(DEVICES, VALUE_DTYPES, LAYOUTS, [False, True]))
def test_the_bits_of_one_call_per_term(device, dtype, layout, weighted):
    # each J_k is added as reduce adds its quotients and the terms in order: the bits of K calls
    values, mask, cu, d, w = terms_batch(layout, dtype, device=device, weighted=weighted, requires_grad=True)
    acc = acc_dtype(dtype)
    d_acc = d.to(acc)
    w_acc = None if w is None else w.to(acc)
    total, parts = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d_acc, sample_weights=w_acc, coefficients=COEFFICIENTS)
    want, want_parts = _per_term_route([v.detach() for v in values], mask, cu, d_acc, w_acc, COEFFICIENTS)
    assert torch.equal(parts, want_parts), (parts, want_parts)
    assert torch.equal(total.detach(), want), (total, want)
    total.backward()
    for k, g in enumerate(_per_term_grads(values, mask, cu, d_acc, w_acc, COEFFICIENTS)):
        assert torch.equal(values[k].grad, g), f"values[{k}]"


def test_extreme_magnitudes_in_float32_are_the_formulas():
    """A weight times a sum, or a coefficient, outside float32's range does not make a float32
    result inf or 0 when the formula's value is a float32: the per-sample numbers are computed in
    float64 and rounded once (docs/ops.md, "Precision of the terms")."""
    mask = torch.ones(2, dtype=torch.bool)
    cu = torch.tensor([0, 1, 2])
    values = torch.tensor([1e20, 1e20], dtype=torch.float32, requires_grad=True)
    d = torch.full((1, 2), 1e30, dtype=torch.float32)
    w = torch.full((1, 2), 1e30, dtype=torch.float32)
    total, _ = lossagg.reduce_terms([values], mask, cu_seqlens=cu, sample_denoms=d, sample_weights=w)
    assert total.item() == pytest.approx(2e20, rel=1e-6)  # w·S = 1e50 overflows float32
    tiny = torch.tensor([1e-20, 1e-20], dtype=torch.float32)
    total, _ = lossagg.reduce_terms([tiny], mask, cu_seqlens=cu, sample_denoms=torch.full((1, 2), 1e-30), sample_weights=torch.full((1, 2), 1e-30))
    assert total.item() == pytest.approx(2e-20, rel=1e-6)  # w·S = 1e-50 underflows float32
    # a coefficient of 1e39 (inf in float32) on a term whose c·J is a float32
    small = torch.tensor([-0.59e-10, -0.59e-10], dtype=torch.float32, requires_grad=True)
    total, parts = lossagg.reduce_terms([small], mask, cu_seqlens=cu, sample_denoms=torch.full((1, 2), 100.0), coefficients=[1e39])
    assert torch.isfinite(total) and total.item() == pytest.approx(1e39 * parts.item(), rel=1e-6)
    total.backward()  # c / d = 1e37 on each token (the gradient of a float32 value)
    assert torch.isfinite(small.grad).all() and small.grad[0].item() == pytest.approx(1e37, rel=1e-6)


def test_subnormal_denominators_and_weights_are_refused_where_float32_would_lose_them():
    """A weight and a denominator of 1e-45 (subnormal in float32, ~1 bit) with w / d ~ 1 gave J and a gradient off
    the formula, each rounded its own way: refused by name in float32, served in float64 (docs/ops.md, "Bad input")."""
    mask, cu = torch.ones(2, dtype=torch.bool), torch.tensor([0, 1, 2])
    d, w = torch.full((1, 2), 1e-45, dtype=torch.float64), torch.full((1, 2), 1.1e-45, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match="smallest normal number"):
            lossagg.reduce_terms([torch.ones(2, dtype=dtype)], mask, cu_seqlens=cu, sample_denoms=d, sample_weights=w)
    values = torch.ones(2, dtype=torch.float64, requires_grad=True)
    total, _ = lossagg.reduce_terms([values], mask, cu_seqlens=cu, sample_denoms=d, sample_weights=w, coefficients=[1e-45 / 1e-45])
    assert total.item() == pytest.approx(2 * 1.1, rel=1e-12)  # normal in float64: w / d kept
    total.backward()
    assert values.grad.tolist() == pytest.approx([1.1, 1.1], rel=1e-12)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ISAS)
def test_the_bits_on_every_isa_and_thread_count(isa, threads):
    # segments longer than one CPU work piece and many short ones; the K values read where they
    # lie: each J_k has the bits of reduce over that term, which the golden corpus pins down
    batches = [long_batch("cpu", seed=s) for s in range(3)]
    values = [b.values.detach() for b in batches]
    mask, cu = batches[0].mask, batches[0].cu_seqlens
    d = torch.stack([b.sample_denoms for b in batches])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        lossagg.set_cpu_isa(isa)
        total, parts = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d, coefficients=COEFFICIENTS)
        want, want_parts = _per_term_route(values, mask, cu, d, None, COEFFICIENTS)
    finally:
        lossagg.set_cpu_isa("auto")
        torch.set_num_threads(old)
    assert torch.equal(parts, want_parts) and torch.equal(total, want)
    reference = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d, coefficients=COEFFICIENTS)
    assert torch.equal(total, reference[0]) and torch.equal(parts, reference[1])


def test_many_terms_and_strided_values():
    # K beyond the CUDA kernels' chunk of 8; a term that is a strided view is read as its values
    values, mask, cu, d, w = terms_batch("packed64", k=11, weighted=True, seed=3)
    values[4] = torch.stack([values[4], torch.zeros_like(values[4])], dim=1)[:, 0]
    assert not values[4].is_contiguous()
    coefficients = [0.5 * k - 2.0 for k in range(11)]
    total, parts = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d, sample_weights=w, coefficients=coefficients)
    want, want_parts = ref_reduce_terms(values, mask, d, w, coefficients, cu)
    torch.testing.assert_close(total.double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(parts.double(), want_parts, rtol=2e-5, atol=2e-5)


def test_each_term_gets_a_gradient_of_its_own():
    values, mask, cu, d, _ = terms_batch("packed32", requires_grad=True)
    total, _ = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d, coefficients=COEFFICIENTS)
    total.backward()
    for v in values:  # not rows of one [K, T] buffer that would live as long as the last of them
        assert v.grad.untyped_storage().nbytes() == v.numel() * v.element_size()
    # a term that does not require grad gets none, the others theirs
    frozen, mask, cu, d, _ = terms_batch("packed32", requires_grad=True)
    frozen[1] = frozen[1].detach()
    lossagg.reduce_terms(frozen, mask, cu_seqlens=cu, sample_denoms=d)[0].backward()
    assert frozen[0].grad is not None and frozen[1].grad is None and frozen[2].grad is not None


@pytest.mark.parametrize("layout", ["packed32", "padded"])
def test_gradcheck_and_double_backward_float64(device, layout):
    values, mask, cu, d, w = terms_batch(layout, torch.float64, torch.float64, device, weighted=True, requires_grad=True)

    def f(*vs):
        return lossagg.reduce_terms(list(vs), mask, cu_seqlens=cu, sample_denoms=d, sample_weights=w, coefficients=COEFFICIENTS)[0]

    assert torch.autograd.gradcheck(f, tuple(values))
    assert torch.autograd.gradgradcheck(f, tuple(values))

    def op(*vs):  # the registered autograd, as direct callers of torch.ops reach it
        return torch.ops.lossagg.reduce_terms(list(vs), mask, cu, d, w, COEFFICIENTS)[0]

    assert torch.autograd.gradcheck(op, tuple(values))
    assert torch.autograd.gradgradcheck(op, tuple(values))


def test_torch_compile_fullgraph(device):
    values, mask, cu, d, w = terms_batch("packed32", device=device, weighted=True, requires_grad=True)

    def loss_fn(pg, entropy, kl):
        return lossagg.reduce_terms([pg * 2.0, entropy, kl], mask, cu_seqlens=cu, sample_denoms=d, sample_weights=w, coefficients=COEFFICIENTS)[0]

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    out = compiled(*values)
    out.backward()
    grads = [v.grad.clone() for v in values]
    for v in values:
        v.grad = None
    eager = loss_fn(*values)
    eager.backward()
    torch.testing.assert_close(out, eager)
    for g, v in zip(grads, values, strict=True):
        torch.testing.assert_close(g, v.grad)


def _bad_cases():
    values, mask, cu, d, w = terms_batch("packed32", weighted=True)
    half = [v.half() if k == 1 else v for k, v in enumerate(values)]
    nan_w = w.clone()
    nan_w[2, 3] = float("nan")
    big_w = w.clone()
    big_w[1, 0] = 1e39
    zero_d = d.clone()
    zero_d[1, 4] = 0.0
    base = dict(cu_seqlens=cu, sample_denoms=d)
    subnormal_d, subnormal_w = d.clone(), w.clone()
    subnormal_d[2, 1], subnormal_w[0, 3] = 1e-40, 1e-42  # subnormal in float32: a few bits left
    return [
        ("a tensor", (values[0], mask), base, TypeError, "values must be a list of the K terms' per-token tensors"),
        ("empty list", ([], mask), base, ValueError, "values must hold at least one term's tensor"),
        ("mixed dtypes", (half, mask), base, TypeError, "values[1] of dtype"),
        ("term shape", ([values[0], values[1][:-1], values[2]], mask), base, ValueError, "values[1] must have the token shape of mask"),
        ("denoms shape", (values, mask), dict(base, sample_denoms=d[:2]), ValueError, "sample_denoms must be [K, B] = [3, 6]"),
        ("denom not > 0", (values, mask), dict(base, sample_denoms=zero_d), ValueError, "sample_denoms[1, 4] = 0"),
        ("weights shape", (values, mask), dict(base, sample_weights=w[:, :2]), ValueError, "sample_weights must be [K, B] = [3, 6]"),
        ("weight NaN", (values, mask), dict(base, sample_weights=nan_w), ValueError, "sample_weights must be finite, got sample_weights[2, 3] = nan"),
        ("weight inf in float32", (values, mask), dict(base, sample_weights=big_w), ValueError, "sample_weights[1, 0] = 1e+39 is inf in Float"),
        (
            "coefficient count",
            (values, mask),
            dict(base, coefficients=[1.0, 2.0]),
            ValueError,
            "coefficients must hold one number per term (K = 3), got 2",
        ),
        ("coefficient inf", (values, mask), dict(base, coefficients=[1.0, float("inf"), 2.0]), ValueError, "coefficients[1] = inf"),
        ("coefficient type", (values, mask), dict(base, coefficients=[1.0, "a", 2.0]), TypeError, "coefficients[1] must be a number, got str"),
        ("coefficient beyond float64", (values, mask), dict(base, coefficients=[1.0, 2**1030, 2.0]), ValueError, "an integer of 1031 bits"),
        ("denom subnormal in float32", (values, mask), dict(base, sample_denoms=subnormal_d), ValueError, "the smallest normal number there"),
        ("weight subnormal in float32", (values, mask), dict(base, sample_weights=subnormal_w), ValueError, "at least its smallest normal number"),
        ("no denoms", (values, mask), dict(cu_seqlens=cu), TypeError, "missing the keyword argument sample_denoms"),
        ("positional", (values, mask, cu), dict(sample_denoms=d), TypeError, "takes 2 positional arguments, got 3"),
        ("expanded view", ([values[0], torch.ones(()).expand(values[0].shape), values[2]], mask), base, ValueError, "values[1] is an expanded view"),
        (
            "grad of denoms",
            (values, mask),
            dict(base, sample_denoms=d.clone().requires_grad_(True)),
            ValueError,
            "not differentiable in sample_denoms",
        ),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_is_named(case):
    _, args, kwargs, kind, text = case
    with pytest.raises(kind) as info:
        lossagg.reduce_terms(*args, **kwargs)
    assert text in str(info.value), str(info.value)
    assert str(info.value).startswith("lossagg.reduce_terms") or "lossagg.reduce_terms" in str(info.value)


def test_inference_mode_values_are_refused_when_they_need_a_gradient():
    values, mask, cu, d, _ = terms_batch("packed32")
    with torch.inference_mode():
        d_inf = d.clone()
    leaves = [v.clone().requires_grad_(True) for v in values]
    with pytest.raises(ValueError, match="sample_denoms was made under torch.inference_mode"):
        lossagg.reduce_terms(leaves, mask, cu_seqlens=cu, sample_denoms=d_inf)


def test_numbers_and_lists_are_read_as_users_write_them():
    """Coefficients as NumPy scalars and 0-dim tensors (as a number is accepted everywhere); a term
    that is not a tensor named by its position; a backward's values_dtype named as the argument."""
    import numpy as np

    values, mask, cu, d, _ = terms_batch("packed32", torch.float64)
    want = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d, coefficients=[1.0, -0.5, 0.25])
    for c in ([np.float64(1.0), np.float32(-0.5), torch.tensor(0.25)], [np.int64(1), torch.tensor(-0.5, dtype=torch.float64), 0.25]):
        got = lossagg.reduce_terms(values, mask, cu_seqlens=cu, sample_denoms=d, coefficients=c)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(TypeError, match=r"lossagg.reduce_terms: values\[1\] must be a torch.Tensor .* got NoneType"):
        lossagg.reduce_terms([values[0], None, values[2]], mask, cu_seqlens=cu, sample_denoms=d)
    for op, args in (
        (torch.ops.lossagg.reduce_terms_backward, (torch.tensor(1.0), mask, cu, d, None, [1.0, 1.0, 1.0], torch.int64)),
        (torch.ops.lossagg.reduce_backward, (torch.tensor(1.0), mask, cu, d[0], torch.int64)),
        (torch.ops.lossagg.segment_sum_backward, (torch.ones(d.shape[1]), mask, cu, torch.int64)),
    ):
        for meta in (False, True):
            call_args = tuple(a.to("meta") if meta and isinstance(a, torch.Tensor) else a for a in args)
            with pytest.raises((TypeError, RuntimeError), match=r"values_dtype \(the gradient's dtype, that of the values\) must"):
                op(*call_args)
