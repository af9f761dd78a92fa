"""CUDA-only behaviour: no host synchronisation, CUDA-graph capture, CPU/CUDA agreement,
large inputs that cross many tiles. Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch
from batches import big_cuda_batch, make_batch
from conftest import _NO_CUDA, HAS_CUDA
from reference import ref_reduce, ref_segment_sum

import lossagg

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason=_NO_CUDA or "CUDA")


def test_no_host_sync_forward_and_backward():
    values, mask, cu, denoms = big_cuda_batch(200_000, 50)
    values.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms)
        out.backward()
        lossagg.segment_sum(values.detach(), mask, cu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cuda_graph_capture_replays_exactly():
    values, mask, cu, denoms = big_cuda_batch(500_000, 100, dtype=torch.float32)
    static_values = values.clone()
    grad = torch.ones((), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as graph capture requires
        for _ in range(2):
            lossagg.reduce(static_values, mask, cu_seqlens=cu, sample_denoms=denoms)
            torch.ops.lossagg.reduce_backward(grad, mask, cu, denoms, torch.float32)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lossagg.reduce(static_values, mask, cu_seqlens=cu, sample_denoms=denoms)
        gvals = torch.ops.lossagg.reduce_backward(grad, mask, cu, denoms, torch.float32)
        sums = lossagg.segment_sum(static_values, mask, cu)
    new_values = torch.randn_like(values)
    static_values.copy_(new_values)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lossagg.reduce(new_values, mask, cu_seqlens=cu, sample_denoms=denoms))
    assert torch.equal(sums, lossagg.segment_sum(new_values, mask, cu))
    assert torch.equal(gvals, torch.ops.lossagg.reduce_backward(grad, mask, cu, denoms, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_input_matches_reference_and_is_deterministic(dtype):
    values, mask, cu, denoms = big_cuda_batch(dtype=dtype)
    out = lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms)
    expected = ref_reduce(values.cpu(), mask.cpu(), denoms.cpu(), cu.cpu())
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-4, atol=1e-4)
    sums = lossagg.segment_sum(values, mask, cu)
    torch.testing.assert_close(sums.cpu().double(), ref_segment_sum(values.cpu(), mask.cpu(), cu.cpu()), rtol=1e-4, atol=1e-2)
    for _ in range(3):
        assert torch.equal(out, lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms))
        assert torch.equal(sums, lossagg.segment_sum(values, mask, cu))


def test_cuda_agrees_with_cpu():
    for layout in ("packed32", "packed64", "padded"):
        b = make_batch(layout, dtype=torch.float32, num_metrics=3)
        cpu = lossagg.segment_sum(b.values, b.mask, b.cu_seqlens)
        gpu = lossagg.segment_sum(b.values.cuda(), b.mask.cuda(), None if b.cu_seqlens is None else b.cu_seqlens.cuda())
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-5)


def test_misaligned_views_take_the_scalar_path():
    values, mask, cu, denoms = big_cuda_batch(100_000, 20, dtype=torch.float32)
    # offset views: neither 16-byte aligned nor in phase with the mask
    v = torch.cat([values.new_zeros(1), values])[1:]
    m = torch.cat([mask.new_zeros(3), mask])[3:]
    torch.testing.assert_close(
        lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=denoms), lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=denoms)
    )
    torch.testing.assert_close(lossagg.segment_sum(v, m, cu), lossagg.segment_sum(values, mask, cu))


def test_device_checks_are_opt_in_on_cuda():
    values = torch.randn(10, device="cuda")
    mask = torch.ones(10, dtype=torch.bool, device="cuda")
    bad_denoms = torch.tensor([1.0, 0.0], device="cuda")
    cu = torch.tensor([0, 4, 10], device="cuda")
    old = lossagg.device_checks_enabled()
    try:
        lossagg.set_device_checks(True)
        with pytest.raises(ValueError, match="sample_denoms must be finite and > 0"):
            lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=bad_denoms)
        lossagg.set_device_checks(False)
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=bad_denoms)  # unchecked: no sync, no error
    finally:
        lossagg.set_device_checks(old)
