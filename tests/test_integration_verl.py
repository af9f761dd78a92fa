"""lossagg.integrations.verl.agg_loss side by side with the real, installed verl
(``verl.trainer.ppo.core_algos.agg_loss``, verl 0.9.1): same values and gradients on random
batches for every verl mode, with and without the global-batch arguments. Skipped, with
the reason, when verl is not importable (scripts/install_peers.sh installs it)."""

from __future__ import annotations

import pytest
import torch

from lossagg.integrations.verl import VERL_MODES, agg_loss

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not importable (scripts/install_peers.sh installs it)")


def batch(seed, bs=6, length=9, dtype=torch.float64, mask_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(bs, length, generator=g, dtype=torch.float64).to(dtype)
    lengths = torch.randint(0, length + 1, (bs,), generator=g)
    lengths[0] = 0  # one fully masked response
    mask = (torch.arange(length)[None] < lengths[:, None]).to(mask_dtype)
    return loss, mask


def both(loss, mask, mode, **kw):
    ours_in = loss.clone().requires_grad_(True)
    theirs_in = loss.clone().requires_grad_(True)
    ours = agg_loss(ours_in, mask, mode, **kw)
    theirs = core_algos.agg_loss(theirs_in, mask, mode, **kw)
    ours.backward()
    theirs.backward()
    return ours, theirs, ours_in.grad, theirs_in.grad


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("seed", range(3))
def test_same_values_and_gradients_as_verl(mode, mask_dtype, seed):
    loss, mask = batch(seed, mask_dtype=mask_dtype)
    ours, theirs, g_ours, g_theirs = both(loss, mask, mode)
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(g_ours.double(), g_theirs.double(), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("mode", VERL_MODES)
def test_same_as_verl_with_the_global_batch_arguments(mode):
    loss, mask = batch(7, bs=8)
    kw = dict(dp_size=2, batch_num_tokens=int(mask.sum()) * 2 + 3, global_batch_size=16, loss_scale_factor=32)
    ours, theirs, g_ours, g_theirs = both(loss, mask, mode, **kw)
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(g_ours.double(), g_theirs.double(), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_float32_batches(mode):
    loss, mask = batch(3, bs=16, length=64, dtype=torch.float32)
    ours, theirs, g_ours, g_theirs = both(loss, mask, mode)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", VERL_MODES)
def test_micro_batches_add_up_with_global_arguments(mode):
    loss, mask = batch(11, bs=8)
    kw = dict(batch_num_tokens=int(mask.sum()), global_batch_size=8, loss_scale_factor=9)
    whole = agg_loss(loss, mask, mode, **kw)
    parts = sum(agg_loss(loss[i : i + 2], mask[i : i + 2], mode, **kw) for i in range(0, 8, 2))
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_where_verl_leaks_a_masked_nan_lossagg_does_not(mode):
    loss, mask = batch(5)
    loss[mask == 0] = float("nan")
    assert torch.isnan(core_algos.agg_loss(loss, mask, mode))
    ours = agg_loss(loss, mask, mode)
    assert torch.isfinite(ours)
    clean = torch.where(mask != 0, loss, torch.zeros(()))
    torch.testing.assert_close(ours.double(), core_algos.agg_loss(clean, mask, mode).double())


def test_all_masked_step_gives_zero_not_nan():
    loss, mask = batch(1)
    mask.zero_()
    for mode in VERL_MODES:
        assert agg_loss(loss, mask, mode).item() == 0.0
    assert torch.isnan(core_algos.agg_loss(loss, mask, "token-mean"))


def test_lossagg_modes_through_the_adapter():
    loss, mask = batch(2, bs=4)
    groups = torch.tensor([0, 0, 1, 1])
    j = agg_loss(loss, mask, "prompt_mean", group_index=groups)
    sums = (loss * mask).sum(-1)
    counts = mask.sum(-1)
    expected = 0.5 * (sums[:2].sum() / counts[:2].sum().clamp(min=1) + sums[2:].sum() / counts[2:].sum().clamp(min=1))
    torch.testing.assert_close(j.double(), expected.double())
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        agg_loss(loss, mask, "nope")
