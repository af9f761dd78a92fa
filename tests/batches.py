"""Random batches in both layouts, for the op tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

VALUE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
MASK_DTYPES = [torch.bool, torch.uint8, torch.int64, torch.int32, torch.float32]
LAYOUTS = ["packed32", "packed64", "padded"]


@dataclass
class Batch:
    values: torch.Tensor
    mask: torch.Tensor
    cu_seqlens: torch.Tensor | None
    sample_denoms: torch.Tensor

    @property
    def num_segments(self) -> int:
        return self.sample_denoms.shape[0]


def make_mask(shape, mask_dtype, generator, keep=0.7):
    keep_t = torch.rand(shape, generator=generator) < keep
    if mask_dtype == torch.bool:
        return keep_t
    if not mask_dtype.is_floating_point:  # integer masks as trainers hand them: 0/1
        return keep_t.to(mask_dtype)
    # floating masks carry weights (e.g. truncated importance weights)
    weights = 0.25 + torch.rand(shape, generator=generator)
    return torch.where(keep_t, weights, torch.zeros(())).to(mask_dtype)


def make_batch(
    layout: str,
    *,
    lengths=(5, 0, 17, 1, 64, 33),
    row_len: int = 40,
    dtype=torch.float32,
    mask_dtype=torch.bool,
    num_metrics: int | None = None,
    device="cpu",
    seed: int = 0,
    requires_grad: bool = False,
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    if layout == "padded":
        token_shape = (len(lengths), row_len)
        cu = None
    else:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        token_shape = (offsets[-1],)
        cu = torch.tensor(offsets, dtype=torch.int32 if layout == "packed32" else torch.int64)
    shape = token_shape if num_metrics is None else (num_metrics, *token_shape)
    values = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    mask = make_mask(token_shape, mask_dtype, g)
    denoms = 1.0 + 10.0 * torch.rand(len(lengths), generator=g, dtype=torch.float64)
    batch = Batch(
        values=values.to(device).requires_grad_(requires_grad),
        mask=mask.to(device),
        cu_seqlens=None if cu is None else cu.to(device),
        sample_denoms=denoms.to(torch.float32).to(device),
    )
    return batch
