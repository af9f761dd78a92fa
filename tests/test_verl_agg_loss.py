"""lossagg.integrations.verl.agg_loss, verl's drop-in.

* Side by side with the real, installed verl (``verl.trainer.ppo.core_algos.agg_loss``, verl
  0.9.1): same values and gradients on random batches for every verl mode, with and without
  the global-batch arguments. Those tests are skipped, with the reason, when verl is not
  importable (scripts/install_peers.sh installs it).
* Hostile and careless arguments (no verl needed): each case is an input and its verdict,
  refused with a message naming the argument the user typed, or accepted with a value checked
  against a float64 formula; properties over numbers of every kind.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batches import padded_loss_batch
from hostile_numbers import PROPERTY, int_like, number_like, numbers, refused_naming
from hypothesis import example, given
from hypothesis import strategies as st

from lossagg.integrations.verl import VERL_MODES, agg_loss


def core_algos():
    """verl's own ``core_algos``; the test that calls this is skipped when verl is not importable."""
    return pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not importable (scripts/install_peers.sh installs it)")


def both(loss, mask, mode, **kw):
    ours_in = loss.clone().requires_grad_(True)
    theirs_in = loss.clone().requires_grad_(True)
    ours = agg_loss(ours_in, mask, mode, **kw)
    theirs = core_algos().agg_loss(theirs_in, mask, mode, **kw)
    ours.backward()
    theirs.backward()
    return ours, theirs, ours_in.grad, theirs_in.grad


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("seed", range(3))
def test_same_values_and_gradients_as_verl(mode, mask_dtype, seed):
    loss, mask = padded_loss_batch(seed, mask_dtype=mask_dtype)
    ours, theirs, g_ours, g_theirs = both(loss, mask, mode)
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(g_ours.double(), g_theirs.double(), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("mode", VERL_MODES)
def test_same_as_verl_with_the_global_batch_arguments(mode):
    loss, mask = padded_loss_batch(7, bs=8)
    kw = dict(dp_size=2, batch_num_tokens=int(mask.sum()) * 2 + 3, global_batch_size=16, loss_scale_factor=32)
    ours, theirs, g_ours, g_theirs = both(loss, mask, mode, **kw)
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(g_ours.double(), g_theirs.double(), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_float32_batches(mode):
    loss, mask = padded_loss_batch(3, bs=16, length=64, dtype=torch.float32)
    ours, theirs, g_ours, g_theirs = both(loss, mask, mode)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", VERL_MODES)
def test_micro_batches_add_up_with_global_arguments(mode):
    loss, mask = padded_loss_batch(11, bs=8)
    kw = dict(batch_num_tokens=int(mask.sum()), global_batch_size=8, loss_scale_factor=9)
    whole = agg_loss(loss, mask, mode, **kw)
    parts = sum(agg_loss(loss[i : i + 2], mask[i : i + 2], mode, **kw) for i in range(0, 8, 2))
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_where_verl_leaks_a_masked_nan_lossagg_does_not(mode):
    loss, mask = padded_loss_batch(5)
    loss[mask == 0] = float("nan")
    assert torch.isnan(core_algos().agg_loss(loss, mask, mode))
    ours = agg_loss(loss, mask, mode)
    assert torch.isfinite(ours)
    clean = torch.where(mask != 0, loss, torch.zeros(()))
    torch.testing.assert_close(ours.double(), core_algos().agg_loss(clean, mask, mode).double())


def test_all_masked_step_gives_zero_not_nan():
    loss, mask = padded_loss_batch(1)
    mask.zero_()
    for mode in VERL_MODES:
        assert agg_loss(loss, mask, mode).item() == 0.0
    assert torch.isnan(core_algos().agg_loss(loss, mask, "token-mean"))


def test_lossagg_modes_through_the_adapter():
    loss, mask = padded_loss_batch(2, bs=4)
    groups = torch.tensor([0, 0, 1, 1])
    j = agg_loss(loss, mask, "prompt_mean", group_index=groups)
    sums = (loss * mask).sum(-1)
    counts = mask.sum(-1)
    expected = 0.5 * (sums[:2].sum() / counts[:2].sum().clamp(min=1) + sums[2:].sum() / counts[2:].sum().clamp(min=1))
    torch.testing.assert_close(j.double(), expected.double())
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        agg_loss(loss, mask, "nope")
    # a multi-turn trajectory's rows: each session once (docs/modes.md, "Sessions"), the micro-batch the whole step
    sessions = torch.tensor([0, 0, 0, 1])
    j = agg_loss(loss, mask, "session_mean", session_index=sessions)
    rows = sums / counts.clamp(min=1)
    torch.testing.assert_close(j.double(), (0.5 * (rows[:3].mean() + rows[3])).double())
    with pytest.raises(ValueError, match="session_index is required under mode=session_mean"):
        agg_loss(loss, mask, "session_mean")
    with pytest.raises(ValueError, match="loss_agg_mode=session_mean needs the step total\\(s\\) num_sessions, session_sizes"):
        agg_loss(loss, mask, "session_mean", dp_size=2, global_batch_size=8, session_index=sessions)


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.bool])
def test_underscore_spelling_gives_the_bits_of_verls_name(mode, mask_dtype):
    """docs/modes.md: '-' and '_' count as the same in every name (no verl needed). token_mean is
    lossagg's own mode (a mode's own name is looked up first): on a 0/1 mask, verl's bits too."""
    loss, mask = padded_loss_batch(13, bs=8, mask_dtype=mask_dtype)
    for kw in ({}, dict(dp_size=2, batch_num_tokens=int(mask.sum()) * 2 + 3, global_batch_size=16, loss_scale_factor=32)):
        dash_in, underscore_in = loss.clone().requires_grad_(True), loss.clone().requires_grad_(True)
        dash, underscore = agg_loss(dash_in, mask, mode, **kw), agg_loss(underscore_in, mask, mode.replace("-", "_"), **kw)
        dash.backward()
        underscore.backward()
        assert torch.equal(underscore, dash), (mode, kw)
        assert torch.equal(underscore_in.grad, dash_in.grad), (mode, kw)
    weights = mask.double() * 0.5  # a weight mask: verl's names take it, lossagg's token_mean refuses it
    if mode == "token-mean":
        with pytest.raises(ValueError, match="needs a 0/1 loss_mask"):
            agg_loss(loss, weights, "token_mean")
    else:
        assert torch.equal(agg_loss(loss, weights, mode.replace("-", "_")), agg_loss(loss, weights, mode))


# ------------------------------------------------------ hostile and careless arguments
# a micro-batch of 3 sequences, 11 valid tokens
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
LOSS = torch.arange(15, dtype=torch.float64).reshape(3, 5) / 7.0
MASKED_SUM = float((LOSS * MASK).sum())


def verl(**kwargs):
    args = dict(loss_mat=LOSS, loss_mask=MASK, loss_agg_mode="token-mean")
    args.update(kwargs)
    return agg_loss(args.pop("loss_mat"), args.pop("loss_mask"), args.pop("loss_agg_mode"), **args)


VERL_REFUSED = [
    ("batch_num_tokens=0 with 11 tokens", dict(batch_num_tokens=0), ValueError, "batch_num_tokens"),
    ("batch_num_tokens below the micro-batch's", dict(batch_num_tokens=5), ValueError, "batch_num_tokens"),
    ("batch_num_tokens=nan", dict(batch_num_tokens=float("nan")), ValueError, "batch_num_tokens"),
    ("batch_num_tokens=-3", dict(batch_num_tokens=-3), ValueError, "batch_num_tokens"),
    ("batch_num_tokens a string", dict(batch_num_tokens="22"), ValueError, "batch_num_tokens"),
    ("global_batch_size=0", dict(loss_agg_mode="seq-mean-token-sum", global_batch_size=0), ValueError, "global_batch_size"),
    ("global_batch_size below the micro-batch's", dict(loss_agg_mode="seq-mean-token-mean", global_batch_size=2), ValueError, "global_batch_size"),
    ("global_batch_size=2.5", dict(loss_agg_mode="seq-mean-token-sum", global_batch_size=2.5), ValueError, "global_batch_size"),
    ("loss_scale_factor=0 (constant)", dict(loss_agg_mode="constant", loss_scale_factor=0), ValueError, "loss_scale_factor"),
    ("loss_scale_factor=-1 (constant)", dict(loss_agg_mode="constant", loss_scale_factor=-1), ValueError, "loss_scale_factor"),
    ("loss_scale_factor=0 (norm)", dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=0), ValueError, "loss_scale_factor"),
    ("dp_size=0", dict(dp_size=0), ValueError, "dp_size"),
    ("dp_size=True", dict(dp_size=True), ValueError, "dp_size"),
    ("loss_mat a list", dict(loss_mat=LOSS.tolist()), TypeError, "loss_mat"),
    ("loss_mask a list", dict(loss_mask=MASK.tolist()), TypeError, "loss_mask"),
    ("loss_mask on the meta device", dict(loss_mask=MASK.to("meta")), ValueError, "loss_mask"),
    ("unknown mode", dict(loss_agg_mode="bogus"), ValueError, "loss_agg_mode"),
    ("batch_num_tokens beyond float64", dict(batch_num_tokens=10**400), ValueError, "batch_num_tokens"),
    ("loss_mat of integers", dict(loss_mat=torch.ones(3, 5, dtype=torch.int64)), TypeError, "loss_mat must be a floating tensor"),
    ("lossagg token_mean over DP without batch_num_tokens", dict(loss_agg_mode="token_mean", dp_size=2), ValueError, "needs batch_num_tokens"),
    (
        "lossagg sample_mean with a global batch below the micro-batch's",
        dict(loss_agg_mode="sample_mean", global_batch_size=2),
        ValueError,
        "global_batch_size",
    ),
    (
        "lossagg max_length over DP (verl carries no L_max)",
        dict(loss_agg_mode="max_length", dp_size=2, global_batch_size=6),
        ValueError,
        "max_tokens",
    ),
    (
        "lossagg prompt_mean over DP (no group totals)",
        dict(loss_agg_mode="prompt_mean", dp_size=2, group_index=torch.tensor([0, 0, 1])),
        ValueError,
        "num_groups",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "kind", "names"), VERL_REFUSED, ids=[c[0] for c in VERL_REFUSED])
def test_verl_refuses(case, kwargs, kind, names):
    with pytest.raises(kind, match=names):
        verl(**kwargs)


VERL_ACCEPTED = [
    ("NumPy batch_num_tokens and dp_size", dict(batch_num_tokens=np.int64(22), dp_size=np.int64(2)), MASKED_SUM / 22 * 2),
    ("0-dim tensor batch_num_tokens", dict(batch_num_tokens=torch.tensor(22)), MASKED_SUM / 22),
    ("batch_num_tokens equal to the micro-batch's", dict(batch_num_tokens=11), MASKED_SUM / 11),
    ("global_batch_size as a 0-dim tensor", dict(loss_agg_mode="seq-mean-token-sum", global_batch_size=torch.tensor(6)), MASKED_SUM / 6),
    ("loss_scale_factor as NumPy", dict(loss_agg_mode="constant", loss_scale_factor=np.float64(4.0)), MASKED_SUM / (3 * 4.0)),
    (
        "lossagg sample_mean over DP: N = global_batch_size",
        dict(loss_agg_mode="sample_mean", dp_size=2, global_batch_size=np.int64(6)),
        sum(float((LOSS[i] * MASK[i]).sum()) / (6 * float(MASK[i].sum())) for i in range(3)) * 2,
    ),
    ("lossagg token_mean over DP: T = batch_num_tokens", dict(loss_agg_mode="token_mean", dp_size=2, batch_num_tokens=22), MASKED_SUM / 22 * 2),
    ("lossagg constant, one rank, global batch", dict(loss_agg_mode="constant", global_batch_size=6, loss_scale_factor=4), MASKED_SUM / (6 * 4.0)),
    ("lossagg max_length, the whole step", dict(loss_agg_mode="max_length"), MASKED_SUM / (3 * 4.0)),
]


@pytest.mark.parametrize(("case", "kwargs", "expected"), VERL_ACCEPTED, ids=[c[0] for c in VERL_ACCEPTED])
def test_verl_accepts(case, kwargs, expected):
    assert verl(**kwargs).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("mode", "kwargs", "named", "not_named"),
    [
        # the total verl cannot carry comes first: no argument would supply it
        ("max_length", dict(dp_size=2), "max_tokens", "global_batch_size"),
        ("max_length", dict(dp_size=2, global_batch_size=6), "max_tokens", "global_batch_size"),
        ("max_length", dict(batch_num_tokens=11), "max_tokens", "global_batch_size"),
        ("prompt_mean", dict(dp_size=2, group_index=torch.tensor([0, 0, 1])), "num_groups, group_token_sums", "global_batch_size"),
        # then the arguments verl does carry, every missing one at once
        ("sample_mean", dict(dp_size=2), "needs global_batch_size (the step's num_samples)", "batch_num_tokens"),
        ("token_mean", dict(dp_size=2, global_batch_size=6), "needs batch_num_tokens (the step's total_tokens)", "global_batch_size"),
    ],
)
def test_verl_lossagg_modes_name_what_is_missing_first(mode, kwargs, named, not_named):
    with pytest.raises(ValueError) as err:
        verl(loss_agg_mode=mode, **kwargs)
    assert named in str(err.value) and not_named not in str(err.value), str(err.value)


def test_verl_zero_tokens_everywhere_is_zero_not_nan():
    out = verl(loss_mask=torch.zeros_like(MASK), batch_num_tokens=0)
    assert out.item() == 0.0


@PROPERTY
@given(batch_num_tokens=numbers, dp_size=numbers)
def test_verl_token_mean_numbers(batch_num_tokens, dp_size):
    call = lambda: verl(batch_num_tokens=batch_num_tokens, dp_size=dp_size)  # noqa: E731
    dp = int_like(dp_size)
    if dp is None or dp < 1:
        return refused_naming(call, "dp_size")
    if batch_num_tokens is None:
        if dp > 1:
            return refused_naming(call, "batch_num_tokens")
        total = 11.0
    else:
        total = number_like(batch_num_tokens)
        if total is None or total < 11:  # the micro-batch holds 11 tokens
            return refused_naming(call, "batch_num_tokens")
    assert call().item() == pytest.approx(MASKED_SUM / total * dp, rel=1e-12)


@PROPERTY
@given(global_batch_size=numbers, loss_scale_factor=numbers, dp_size=st.sampled_from([1, 2, np.int64(4)]))
@example(global_batch_size=6, loss_scale_factor=1e308, dp_size=2)  # batch x factor beyond float64; verl's loss is finite
def test_verl_seq_mean_token_sum_norm_numbers(global_batch_size, loss_scale_factor, dp_size):
    call = lambda: verl(
        loss_agg_mode="seq-mean-token-sum-norm", global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor, dp_size=dp_size
    )  # noqa: E731
    dp = int(dp_size)
    if global_batch_size is None:
        if dp > 1:
            return refused_naming(call, "global_batch_size")
        batch = 3.0
    else:
        batch = int_like(global_batch_size)
        if batch is None or batch < 3:  # the micro-batch holds 3 non-empty sequences
            return refused_naming(call, "global_batch_size")
    if loss_scale_factor is None:
        scale = 5.0  # verl's default: the padded width
    else:
        scale = number_like(loss_scale_factor)
        if scale is None or scale <= 0:
            return refused_naming(call, "loss_scale_factor")
    # verl's order (core_algos.agg_loss): by the batch, times dp_size, then by the factor; finite for any factor
    assert call().item() == pytest.approx(MASKED_SUM / batch * dp / scale, rel=1e-12, abs=0.0)
