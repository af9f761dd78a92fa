"""One test per kind of bad input to the ops: the error names the argument, the expectation
and what was given; the fake (meta) kernels check as the real ones do; denominators are checked
in the dtype they divide in; a gradient never goes silently missing; meta (data-less) tensors
are named by the argument on every entry point that reads them."""

from __future__ import annotations

import pytest
import torch
from batches import six_token_batch, two_sample_batch

import lossagg
from lossagg import LossAggregationConfig, StepPlan


@pytest.fixture(autouse=True)
def _device_checks_on():
    # Data checks are always on for CPU tensors; on CUDA they are opt-in.
    old = lossagg.device_checks_enabled()
    lossagg.set_device_checks(True)
    yield
    lossagg.set_device_checks(old)


CASES = {
    "values_dtype": (TypeError, ["values", "float32", "Long"]),
    "values_dim_packed": (ValueError, ["values", "[T]", "[2, 5, 2]"]),
    "values_dim_reduce_metric": (ValueError, ["values", "[T]", "[2, 10]"]),
    "values_dim_padded": (ValueError, ["values", "[B, T]", "[10]"]),
    "mask_shape": (ValueError, ["mask", "token shape", "[9]"]),
    "mask_dtype": (TypeError, ["mask", "bool", "integer", "ComplexFloat"]),
    "cu_dtype": (TypeError, ["cu_seqlens", "int32", "Float"]),
    "cu_dim": (ValueError, ["cu_seqlens", "1-D", "[1, 3]"]),
    "cu_empty": (ValueError, ["cu_seqlens", "at least one", "[0]"]),
    "cu_first": (ValueError, ["cu_seqlens[0]", "0", "1"]),
    "cu_decreasing": (ValueError, ["cu_seqlens", "non-decreasing", "cu_seqlens[2] = 3"]),
    "cu_last": (ValueError, ["cu_seqlens[-1]", "T = 10", "got 9"]),
    "denoms_length": (ValueError, ["sample_denoms", "length B = 2", "[3]"]),
    "denoms_dtype": (TypeError, ["sample_denoms", "floating", "Long"]),
    "denoms_zero": (ValueError, ["sample_denoms", "> 0", "sample_denoms[1] = 0"]),
    "denoms_negative": (ValueError, ["sample_denoms", "> 0", "-2"]),
    "denoms_nan": (ValueError, ["sample_denoms", "finite", "nan"]),
    "denoms_inf": (ValueError, ["sample_denoms", "finite", "inf"]),
    "backward_grad_shape": (ValueError, ["grad", "0-dim", "[2]"]),
    "segment_backward_grad_length": (ValueError, ["grad", "B = 2", "[3]"]),
}


def call(case, device):
    v, m, cu, d = two_sample_batch(device)
    ops = torch.ops.lossagg
    if case == "values_dtype":
        return lossagg.reduce(v.long(), m, cu_seqlens=cu, sample_denoms=d)
    if case == "values_dim_packed":
        return lossagg.segment_sum(v.reshape(2, 5, 1).expand(2, 5, 2), m, cu)
    if case == "values_dim_reduce_metric":
        return lossagg.reduce(torch.stack([v, v]), m, cu_seqlens=cu, sample_denoms=d)
    if case == "values_dim_padded":
        return lossagg.reduce(v, m, sample_denoms=d)
    if case == "mask_shape":
        return lossagg.reduce(v, m[:9], cu_seqlens=cu, sample_denoms=d)
    if case == "mask_dtype":
        return lossagg.reduce(v, m.to(torch.complex64), cu_seqlens=cu, sample_denoms=d)
    if case == "cu_dtype":
        return lossagg.reduce(v, m, cu_seqlens=cu.float(), sample_denoms=d)
    if case == "cu_dim":
        return lossagg.reduce(v, m, cu_seqlens=cu.reshape(1, 3), sample_denoms=d)
    if case == "cu_empty":
        return lossagg.segment_sum(v, m, cu[:0])
    if case == "cu_first":
        return lossagg.reduce(v, m, cu_seqlens=torch.tensor([1, 4, 10], device=device), sample_denoms=d)
    if case == "cu_decreasing":
        return lossagg.segment_sum(v, m, torch.tensor([0, 4, 3, 10], device=device))
    if case == "cu_last":
        return lossagg.reduce(v, m, cu_seqlens=torch.tensor([0, 4, 9], device=device), sample_denoms=d)
    if case == "denoms_length":
        return lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=torch.ones(3, device=device))
    if case == "denoms_dtype":
        return lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=torch.ones(2, dtype=torch.long, device=device))
    if case == "denoms_zero":
        return lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=torch.tensor([1.0, 0.0], device=device))
    if case == "denoms_negative":
        return lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=torch.tensor([-2.0, 1.0], device=device))
    if case == "denoms_nan":
        return lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=torch.tensor([1.0, float("nan")], device=device))
    if case == "denoms_inf":
        return lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=torch.tensor([float("inf"), 1.0], device=device))
    if case == "backward_grad_shape":
        return ops.reduce_backward(torch.ones(2, device=device), m, cu, d, torch.float32)
    if case == "segment_backward_grad_length":
        return ops.segment_sum_backward(torch.ones(3, device=device), m, cu, torch.float32)
    raise AssertionError(case)


# called as torch.ops.lossagg.* directly (no lossagg wrapper): the stable ABI raises
# RuntimeError, whose message starts with the Python exception the wrappers raise (docs/ops.md)
RAW_OP_CASES = {"backward_grad_shape", "segment_backward_grad_length"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_named(device, case):
    exc_type, fragments = CASES[case]
    with pytest.raises(RuntimeError if case in RAW_OP_CASES else exc_type) as info:
        call(case, device)
    message = str(info.value)
    if case in RAW_OP_CASES:
        assert message.startswith(f"{exc_type.__name__}: lossagg."), message
    else:
        assert type(info.value) is exc_type, type(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_device_mismatch_is_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to put one argument elsewhere")
    v, m, cu, d = two_sample_batch("cuda")
    with pytest.raises(ValueError, match="sample_denoms must be on the same device"):
        lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=d.cpu())
    with pytest.raises(ValueError, match="cu_seqlens must be on the same device"):
        lossagg.reduce(v, m, cu_seqlens=cu.cpu(), sample_denoms=d)
    with pytest.raises(ValueError, match="mask must be on the same device"):
        lossagg.reduce(v, m.cpu(), cu_seqlens=cu, sample_denoms=d)


def test_nothing_is_computed_on_bad_input_with_grad():
    v, m, cu, _ = two_sample_batch("cpu")
    v.requires_grad_(True)
    with pytest.raises(ValueError):
        lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=torch.tensor([1.0, -1.0]))
    assert v.grad is None


def test_fake_kernels_check_devices_shapes_and_dtypes():
    values, mask, cu, d = six_token_batch()
    with pytest.raises(ValueError, match="mask must be on the same device as values"):
        lossagg.segment_sum(values, mask.to("meta"), cu)
    with pytest.raises(ValueError, match="mask must be on the same device as values"):
        lossagg.reduce(values, mask.to("meta"), cu_seqlens=cu, sample_denoms=d)
    meta = [t.to("meta") for t in (values, mask, cu, d)]
    assert lossagg.reduce(meta[0], meta[1], cu_seqlens=meta[2], sample_denoms=meta[3]).shape == ()
    assert lossagg.segment_sum(meta[0].expand(3, 6), meta[1], meta[2]).shape == (3, 2)
    with pytest.raises(ValueError, match="mask must have the token shape"):
        lossagg.segment_sum(meta[0], meta[1][:5], meta[2])
    with pytest.raises(ValueError, match="sample_denoms must be a 1-D tensor of length B = 2"):
        lossagg.reduce(meta[0], meta[1], cu_seqlens=meta[2], sample_denoms=meta[3][:1])
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32 or int64"):
        lossagg.segment_sum(meta[0], meta[1], meta[2].float())


def test_denominators_checked_in_the_dtype_they_divide_in():
    values, mask, cu, _ = six_token_batch()
    tiny = torch.tensor([1e-300, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"sample_denoms\[0\] = 1e-300 is 0 in Float"):
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=tiny)
    huge = torch.tensor([1e300, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="is inf in Float"):
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=huge)
    j = lossagg.reduce(values.double(), mask, cu_seqlens=cu, sample_denoms=tiny)  # float64 values divide in float64
    assert torch.isfinite(j)


def test_gradients_never_go_missing():
    values, mask, cu, d = six_token_batch()
    values.requires_grad_(True)
    float_mask = mask.float().requires_grad_(True)
    with pytest.raises(ValueError, match="not differentiable in mask"):
        lossagg.reduce(values, float_mask, cu_seqlens=cu, sample_denoms=d)
    with pytest.raises(ValueError, match="not differentiable in sample_denoms"):
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d.clone().requires_grad_(True))
    with pytest.raises(ValueError, match="not differentiable in mask"):
        lossagg.segment_sum(values, float_mask, cu)
    # detached, they work
    lossagg.reduce(values, float_mask.detach(), cu_seqlens=cu, sample_denoms=d).backward()


# ---------------------------------------------- tensors the kernels cannot read where they lie
def _inference(t):
    with torch.inference_mode():
        return t.clone()


def _call_reduce(values, mask, cu, denoms):
    return lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms)


def _call_segment_sum(values, mask, cu, denoms):
    return lossagg.segment_sum(values, mask, cu)


def _call_token_counts(values, mask, cu, denoms):
    return lossagg.token_counts(mask, cu)


def _call_plan_loss(values, mask, cu, denoms):
    plan = lossagg.StepPlan({"mode": "sample_mean"}, torch.tensor([4.0, 6.0]))
    return plan.loss(values, mask, [0, 1], cu)


# (case, what to change: argument -> new tensor, entry points, kind, fragments of the message)
UNREADABLE = [
    ("sparse_values", {"values": lambda v: v.detach().to_sparse()}, ["reduce", "segment_sum"], TypeError,
     ["values", "dense (strided)", "sparse_coo"]),
    ("sparse_mask", {"mask": lambda m: m.to_sparse()}, ["reduce", "segment_sum", "token_counts", "plan"], TypeError, ["mask", "dense", "sparse_coo"]),
    ("sparse_denoms", {"denoms": lambda d: d.to_sparse()}, ["reduce"], TypeError, ["sample_denoms", "dense", "sparse_coo"]),
    ("expanded_mask", {"mask": lambda m: m[:1].expand(10)}, ["reduce", "segment_sum", "token_counts", "plan"], ValueError,
     ["mask is an expanded view", "stride 0 along dim 0 of size 10", "copied in full", "mask.contiguous()"]),
    ("expanded_values", {"values": lambda v: v[:1].expand(10)}, ["reduce", "segment_sum", "plan"], ValueError, ["values is an expanded view"]),
    ("expanded_denoms", {"denoms": lambda d: d[:1].expand(2)}, ["reduce"], ValueError, ["sample_denoms is an expanded view"]),
    ("inference_mask", {"mask": _inference}, ["reduce", "segment_sum", "plan"], ValueError,
     ["mask was made under torch.inference_mode()", "backward of values", "torch.no_grad()", "mask.clone()"]),
    ("inference_cu", {"cu": _inference}, ["reduce", "segment_sum"], ValueError, ["cu_seqlens was made under torch.inference_mode()"]),
    ("inference_denoms", {"denoms": _inference}, ["reduce"], ValueError, ["sample_denoms was made under torch.inference_mode()"]),
]  # fmt: skip
ENTRY_POINTS = {"reduce": _call_reduce, "segment_sum": _call_segment_sum, "token_counts": _call_token_counts, "plan": _call_plan_loss}


@pytest.mark.parametrize(("case", "entry"), [(c[0], e) for c in UNREADABLE for e in c[2]], ids=[f"{c[0]}-{e}" for c in UNREADABLE for e in c[2]])
def test_tensors_the_kernels_cannot_read_in_place_are_named(case, entry):
    """Sparse tensors, expanded views (a copy of every element, ~10 GB for 2**31 expanded tokens)
    and inference-mode tensors that autograd would have to save: a named error from lossagg's
    entry points, not the dispatcher's text or a silent copy."""
    (_, change, _, kind, fragments) = next(c for c in UNREADABLE if c[0] == case)
    values, mask, cu, denoms = two_sample_batch("cpu")
    values.requires_grad_(True)
    args = {"values": values, "mask": mask, "cu": cu, "denoms": denoms}
    for name, make in change.items():
        args[name] = make(args[name])
    with pytest.raises(kind) as info:
        ENTRY_POINTS[entry](args["values"], args["mask"], args["cu"], args["denoms"])
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


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


def test_inference_tensors_are_fine_where_nothing_is_saved_for_backward():
    values, mask, cu, denoms = two_sample_batch("cpu")
    with torch.inference_mode():
        want = lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms)
        mask_i, cu_i, denoms_i = mask.clone(), cu.clone(), denoms.clone()
    assert torch.equal(lossagg.reduce(values, mask_i, cu_seqlens=cu_i, sample_denoms=denoms_i), want)  # values need no grad
    with torch.no_grad():
        assert torch.equal(lossagg.reduce(values.requires_grad_(True), mask_i, cu_seqlens=cu_i, sample_denoms=denoms_i), want)


def test_a_view_with_strides_is_read_and_a_contiguous_copy_gives_the_same_bits():
    """Non-contiguous views that are not expanded (a column of a matrix, every other token) are
    accepted and give the bits of their contiguous copy."""
    base = torch.randn(10, 3, dtype=torch.float64)
    values = base[:, 1]
    mask = torch.ones(20, dtype=torch.bool)[::2]
    cu = torch.tensor([0, 4, 10])
    denoms = torch.tensor([2.0, 3.0], dtype=torch.float64)
    got = lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms)
    assert torch.equal(got, lossagg.reduce(values.contiguous(), mask.contiguous(), cu_seqlens=cu, sample_denoms=denoms))


# ------------------------------------------------------------------ small surfaces
def test_small_surfaces_name_their_arguments():
    # all_reduce_sum's argument is `group` (not `cp_group`, the sequence reductions' name for it)
    with pytest.raises(TypeError, match="^group must be a torch.distributed process group .* got object"):
        lossagg.all_reduce_sum(torch.ones(1), group=object())
    with pytest.raises(lossagg.ConfigError) as info:
        LossAggregationConfig.from_dict({1: 2})
    assert info.value.issues[0][0] == "1"
    plan = StepPlan(LossAggregationConfig(mode="token_mean"), torch.full((100,), 1e6))
    with pytest.raises(ValueError, match=r"weight of sample 0 is 1e-08, which is 0.0 in torch.float16"):
        plan.token_weights(torch.ones(100, 3, dtype=torch.bool), slice(None), convention="sum", dtype=torch.float16)
