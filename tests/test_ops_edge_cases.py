"""Determinism (reruns, threads, instruction sets), masked NaN/inf, NaN results, empty
batches, zero-length segments, offsets dtypes, bool masks read from bytes, the token_counts
op, the instruction-set switch."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys

import pytest
import torch
from batches import every_path_batch, long_batch, make_batch, many_short_batch
from reference import ref_reduce, ref_segment_sum

import lossagg


def run_once(b):
    b.values.grad = None
    out = lossagg.reduce(b.values, b.mask, cu_seqlens=b.cu_seqlens, sample_denoms=b.sample_denoms)
    out.backward()
    sums = lossagg.segment_sum(b.values.detach(), b.mask, b.cu_seqlens)
    return out.detach().clone(), b.values.grad.clone(), sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_deterministic_across_reruns(device, dtype):
    b = long_batch(device, dtype)
    first = run_once(b)
    for _ in range(3):
        again = run_once(b)
        for x, y in zip(first, again, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("make", [long_batch, many_short_batch], ids=["long", "many_short"])
def test_bitwise_deterministic_across_thread_counts(make):
    b = make("cpu") if make is long_batch else make()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_once(b)
        torch.set_num_threads(2)
        two = run_once(b)
        torch.set_num_threads(max(old, 3))
        more = run_once(b)
    finally:
        torch.set_num_threads(old)
    for x, y, z in zip(one, two, more, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_long_segments_match_reference(device):
    b = long_batch(device)
    out = lossagg.reduce(b.values.detach(), b.mask, cu_seqlens=b.cu_seqlens, sample_denoms=b.sample_denoms)
    expected = ref_reduce(b.values.detach().cpu(), b.mask.cpu(), b.sample_denoms.cpu(), b.cu_seqlens.cpu())
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["packed32", "padded"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_masked_nan_and_inf_do_not_leak(device, layout, mask_dtype, bad):
    b = make_batch(layout, mask_dtype=mask_dtype, device=device, requires_grad=False)
    values = b.values.detach().clone()
    values[b.mask == 0] = bad
    values.requires_grad_(True)
    out = lossagg.reduce(values, b.mask, cu_seqlens=b.cu_seqlens, sample_denoms=b.sample_denoms)
    out.backward()
    sums = lossagg.segment_sum(values.detach(), b.mask, b.cu_seqlens)
    assert torch.isfinite(out) and torch.isfinite(sums).all()
    assert torch.isfinite(values.grad).all()
    assert (values.grad[b.mask == 0] == 0).all()
    cu = None if b.cu_seqlens is None else b.cu_seqlens.cpu()
    clean = torch.where(b.mask.cpu() != 0, values.detach().cpu(), torch.zeros(()))
    torch.testing.assert_close(out.detach().cpu().double(), ref_reduce(clean, b.mask.cpu(), b.sample_denoms.cpu(), cu), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_empty_batch_packed(device, offsets_dtype):
    values = torch.zeros(0, device=device, requires_grad=True)
    mask = torch.zeros(0, dtype=torch.bool, device=device)
    cu = torch.zeros(1, dtype=offsets_dtype, device=device)
    denoms = torch.zeros(0, device=device)
    out = lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms)
    assert out.item() == 0.0
    out.backward()
    assert values.grad.shape == (0,)
    assert lossagg.segment_sum(values.detach(), mask, cu).shape == (0,)
    assert lossagg.segment_sum(torch.zeros(4, 0, device=device), mask, cu).shape == (4, 0)


def test_empty_batch_padded(device):
    values = torch.zeros(0, 7, device=device, requires_grad=True)
    mask = torch.zeros(0, 7, dtype=torch.bool, device=device)
    out = lossagg.reduce(values, mask, sample_denoms=torch.zeros(0, device=device))
    assert out.item() == 0.0
    out.backward()
    assert values.grad.shape == (0, 7)
    # rows of zero tokens are segments too
    values = torch.zeros(3, 0, device=device)
    assert lossagg.segment_sum(values, torch.zeros(3, 0, device=device)).tolist() == [0.0, 0.0, 0.0]


def test_zero_length_segments_and_fully_masked(device):
    cu = torch.tensor([0, 0, 3, 3, 3, 6, 6], device=device)
    values = torch.arange(6, dtype=torch.float32, device=device)
    mask = torch.tensor([1, 1, 1, 0, 0, 0], dtype=torch.bool, device=device)
    sums = lossagg.segment_sum(values, mask, cu)
    assert sums.tolist() == [0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    denoms = torch.ones(6, device=device)
    assert lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms).item() == 3.0


def test_non_contiguous_inputs(device):
    b = make_batch("padded", num_metrics=2, device=device)
    values_t = b.values.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not values_t.is_contiguous()
    torch.testing.assert_close(lossagg.segment_sum(values_t, b.mask), lossagg.segment_sum(b.values, b.mask))
    expected = ref_segment_sum(b.values[0].cpu(), b.mask.cpu())
    torch.testing.assert_close(lossagg.segment_sum(b.values[0], b.mask).cpu().double(), expected, rtol=2e-5, atol=2e-5)


def test_float64_denominators_and_mixed_float_mask(device):
    b = make_batch("packed32", dtype=torch.bfloat16, mask_dtype=torch.float32, device=device)
    out = lossagg.reduce(b.values, b.mask.to(torch.bfloat16), cu_seqlens=b.cu_seqlens, sample_denoms=b.sample_denoms.double())
    expected = ref_reduce(b.values.cpu(), b.mask.to(torch.bfloat16).cpu(), b.sample_denoms.cpu(), b.cu_seqlens.cpu())
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------- instruction sets x threads
ISAS = [
    isa
    for isa in ("baseline", "avx2", "avx512")
    if ("baseline", "avx2", "avx512").index(isa) <= ("baseline", "avx2", "avx512").index(lossagg._native.cpu_best_isa())
]


def run_metrics(b):
    stacked = torch.stack([b.values.detach(), b.values.detach() * 0.5, -b.values.detach()])
    return lossagg.segment_sum(stacked, b.mask, b.cu_seqlens)


@pytest.mark.parametrize(
    ("dtype", "mask_dtype"),
    [
        (torch.float32, torch.bool),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.int64),
        (torch.float16, torch.uint8),
        (torch.float64, torch.float64),
    ],
)
def test_bitwise_identical_across_instruction_sets_and_threads(dtype, mask_dtype):
    b = every_path_batch(dtype, mask_dtype)
    old_threads, results = torch.get_num_threads(), {}
    try:
        for isa in ISAS:
            lossagg.set_cpu_isa(isa)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                results[(isa, threads)] = (*run_once(b), run_metrics(b))
    finally:
        lossagg.set_cpu_isa("auto")
        torch.set_num_threads(old_threads)
    first = next(iter(results.values()))
    for key, got in results.items():
        for x, y in zip(first, got, strict=True):
            assert torch.equal(x, y), key
    out, grad, sums, _ = first
    assert torch.isfinite(out) and torch.isfinite(sums).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(
        sums.double(), ref_segment_sum(b.values.detach(), b.mask, b.cu_seqlens), rtol=2e-2 if dtype != torch.float64 else 1e-9, atol=1e-2
    )


def test_a_segment_sums_to_the_same_bits_wherever_it_lies():
    # The same short segments alone (batched window path), after a segment longer than a
    # piece (every segment then takes the per-segment path) and at the very end of the tensor.
    lengths = torch.randint(0, 17, (500,), generator=torch.Generator().manual_seed(3)).tolist()
    b = make_batch("packed64", lengths=lengths, seed=3, requires_grad=False)
    alone = lossagg.segment_sum(b.values, b.mask, b.cu_seqlens)
    long = 20_000
    values = torch.cat([torch.randn(long), b.values])
    mask = torch.cat([torch.ones(long, dtype=b.mask.dtype), b.mask])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), b.cu_seqlens + long])
    after_long = lossagg.segment_sum(values, mask, cu)[1:]
    assert torch.equal(alone, after_long)
    for i in (0, 250, 499):  # one segment at the end of its own tensor
        lo, hi = int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1])
        single = lossagg.segment_sum(b.values[lo:hi], b.mask[lo:hi], torch.tensor([0, hi - lo]))
        assert torch.equal(single[0], alone[i])


def test_nan_results_are_nan_on_every_isa_and_the_rest_bitwise_equal():
    outs = []
    for isa in ISAS:
        lossagg.set_cpu_isa(isa)
        try:
            row = []
            for length in (5, 16, 40, 100, 20000):
                for bits in (0x7FC12345, 0xFFC54321, 0x7F812345):
                    v = torch.randn(3, 2 * length, generator=torch.Generator().manual_seed(length))
                    v[1, length // 3] = struct.unpack("f", struct.pack("I", bits))[0]
                    v[2, length + 1] = float("inf")
                    v[2, length + 2] = float("-inf")
                    mask = torch.ones(2 * length, dtype=torch.bool)
                    cu = torch.tensor([0, length, 2 * length])
                    row.append(lossagg.segment_sum(v, mask, cu))
                    row.append(lossagg.reduce(v[1], mask, cu_seqlens=cu, sample_denoms=torch.tensor([2.0, 3.0])).reshape(1))
            outs.append(torch.cat([r.reshape(-1) for r in row]))
        finally:
            lossagg.set_cpu_isa("auto")
    first = outs[0]
    assert torch.isnan(first).any()
    for isa, out in zip(ISAS[1:], outs[1:], strict=True):
        assert torch.equal(torch.isnan(out), torch.isnan(first)), isa
        keep = ~torch.isnan(first)
        assert torch.equal(out[keep].view(torch.int32), first[keep].view(torch.int32)), isa


def test_the_ops_docs_state_the_nan_exception():
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "ops.md")).read()
    assert re.search(r"payload and sign bit are not promised", text)


def test_cpu_isa_switch():
    assert lossagg.cpu_isa() in ("baseline", "avx2", "avx512")
    with pytest.raises(ValueError, match="isa must be one of"):
        lossagg.set_cpu_isa("sse9")
    try:
        lossagg.set_cpu_isa("baseline")
        assert lossagg.cpu_isa() == "baseline"
    finally:
        lossagg.set_cpu_isa("auto")
    assert lossagg.cpu_isa() == lossagg._native.cpu_best_isa()


def test_a_bad_cpu_isa_variable_is_raised_by_the_ops_not_at_import():
    code = (
        "import torch, lossagg\n"
        "try:\n"
        "    lossagg.segment_sum(torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "lossagg.set_cpu_isa('baseline')\n"
        "print(lossagg.segment_sum(torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3])).item())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "LOSSAGG_CPU_ISA": "avx9"}, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("LOSSAGG_CPU_ISA must be one of auto, avx512, avx2, baseline, got 'avx9'") and lines[1] == "3.0"


# ------------------------------------------------------------ masks and token counts
def test_bool_mask_viewed_from_bytes_reads_any_nonzero_byte_as_kept():
    raw = torch.tensor([0, 2, 255, 1, 128, 0], dtype=torch.uint8)
    mask = raw.view(torch.bool)
    values = torch.arange(1.0, 7.0)
    cu = torch.tensor([0, 3, 6])
    expected = torch.tensor([2.0 + 3.0, 4.0 + 5.0])
    assert torch.equal(lossagg.segment_sum(values, mask, cu), expected)
    assert torch.equal(lossagg.segment_sum(values, raw != 0, cu), expected)
    values.requires_grad_(True)
    lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=torch.ones(2)).backward()
    assert values.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_token_counts_are_exact_integers():
    n = 2**24 + 1  # float32 cannot hold it
    mask = torch.ones(n, dtype=torch.bool)
    counts = lossagg.token_counts(mask, torch.tensor([0, 1, n]))
    assert counts.dtype == torch.int64 and counts.tolist() == [1, n - 1]
    assert lossagg.token_counts(mask[:8].reshape(2, 4)).tolist() == [4, 4]
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the number of tokens"):
        lossagg.token_counts(mask[:8], torch.tensor([0, 9]))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.int8, torch.int64, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["packed32", "packed64", "padded"])
def test_token_counts_op_counts_nonzero_mask_entries(mask_dtype, layout):
    lengths = [0, 1, 5, 31, 32, 33, 100, 4000] + torch.randint(0, 9, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    b = make_batch(layout, lengths=lengths, row_len=70, mask_dtype=mask_dtype, seed=1)
    mask = b.mask.clone()
    if mask_dtype in (torch.uint8, torch.int8, torch.int64, torch.float16, torch.float32):
        mask[mask != 0] = 3  # a weight, still one kept token
        mask.view(-1)[::11] = 0
    counts = lossagg.token_counts(mask, b.cu_seqlens)
    kept = (mask != 0).long()
    expected = (
        kept.sum(1)
        if b.cu_seqlens is None
        else torch.stack([kept[a:c].sum() for a, c in zip(b.cu_seqlens[:-1].tolist(), b.cu_seqlens[1:].tolist(), strict=True)])
    )
    assert counts.dtype == torch.int64 and torch.equal(counts, expected)
    if mask_dtype == torch.bool:  # bytes other than 1 in a bool tensor are True
        raw = mask.view(torch.uint8).clone()
        raw[raw != 0] = 7
        assert torch.equal(lossagg.token_counts(raw.view(torch.bool), b.cu_seqlens), expected)


def test_token_counts_op_checks_its_offsets():
    mask = torch.ones(6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"lossagg.token_counts: cu_seqlens must be non-decreasing"):
        lossagg.token_counts(mask, torch.tensor([0, 4, 3, 6]))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the number of tokens T = 6"):
        lossagg.token_counts(mask, torch.tensor([0, 4]))
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32 or int64"):
        lossagg.token_counts(mask, torch.tensor([0.0, 6.0]))
    # the op itself (no wrapper): RuntimeError, the message naming the Python exception first (docs/ops.md)
    with pytest.raises(RuntimeError, match=r"^ValueError: lossagg.token_counts: cu_seqlens must be non-decreasing"):
        torch.ops.lossagg.token_counts(mask, torch.tensor([0, 4, 3, 6]))
    fake = torch.empty(6, dtype=torch.bool, device="meta")
    assert torch.ops.lossagg.token_counts(fake, torch.empty(4, dtype=torch.int64, device="meta")).shape == (3,)
