"""Hostile and careless inputs to the adapters and the flags (part of the second hardening
round): each case is an input and its verdict, refused with a message naming the argument
the user typed, or accepted with a value checked against a float64 formula."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

import lossagg
from lossagg.integrations.megatron import make_loss_func
from lossagg.integrations.verl import agg_loss

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


# ---------------------------------------------------------------------- Megatron
def megatron_plan():
    cu = torch.tensor([0, 4, 9])
    mask = torch.ones(9, dtype=torch.bool)
    return lossagg.StepPlan.from_mask(lossagg.LossAggregationConfig(mode="token_mean"), mask, cu), cu, mask


MEGATRON_REFUSED = [
    ("num_micro_batches=0, per-token loss on", dict(num_micro_batches=0, calculate_per_token_loss=True), "num_micro_batches"),
    ("num_micro_batches=0, per-token loss off", dict(num_micro_batches=0), "num_micro_batches"),
    ("dp_size=0", dict(num_micro_batches=1, dp_size=0), "dp_size"),
    ("cp_size=-1", dict(num_micro_batches=1, cp_size=-1, calculate_per_token_loss=True), "cp_size"),
    (
        "rollout_mask of another length",
        dict(num_micro_batches=1, calculate_per_token_loss=True, rollout_mask=torch.ones(8, dtype=torch.bool)),
        "rollout_mask",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "names"), MEGATRON_REFUSED, ids=[c[0] for c in MEGATRON_REFUSED])
def test_megatron_refuses(case, kwargs, names):
    plan, cu, mask = megatron_plan()
    with pytest.raises(ValueError, match=names):
        make_loss_func(plan, [0, 1], cu, mask, **kwargs)


def test_megatron_accepts_numpy_sizes():
    plan, cu, mask = megatron_plan()
    f = make_loss_func(plan, [0, 1], cu, mask, num_micro_batches=np.int64(2), dp_size=np.int32(2), cp_size=torch.tensor(2))
    loss, _ = f(torch.full((9,), 3.0, dtype=torch.float64))
    assert loss.item() == pytest.approx(3.0 * 2 * 2)  # J = 3, times micro-batches x DP (CP cancels)


# ------------------------------------------------------------------------ flags
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--loss-aggregation", "constant", "--loss-aggregation-divisor", "0"], "--loss-aggregation-divisor"),
        (["--loss-aggregation", "prompt_mean", "--n-samples-per-prompt", "0"], "--n-samples-per-prompt"),
        (["--global-batch-size", "0"], "--global-batch-size"),
    ],
)
def test_zero_is_a_value_not_unset(argv, flag):
    parser = argparse.ArgumentParser()
    lossagg.add_loss_aggregation_args(parser)
    with pytest.raises(lossagg.ConfigError, match=flag):
        lossagg.config_from_args(parser.parse_args(argv))


# --------------------------------------------------------------------------- TRL
def test_trl_config_for_loss_type_checks_its_numbers():
    trl_adapter = pytest.importorskip("lossagg.integrations.trl", reason="TRL is not importable (scripts/install_peers.sh installs it)")
    for bad in (0, -2, "4", 2.5, True):
        with pytest.raises(ValueError, match="num_generations"):
            trl_adapter.config_for_loss_type("prompt_mean", num_generations=bad, max_completion_length=8)
    with pytest.raises(ValueError, match="max_completion_length"):
        trl_adapter.config_for_loss_type("dr_grpo", num_generations=4, max_completion_length=0)
    config = trl_adapter.config_for_loss_type("prompt_mean", num_generations=np.int64(4), max_completion_length=8)
    assert config.n_samples_per_prompt == 4 and type(config.n_samples_per_prompt) is int


def test_trl_loss_type_spelling_is_normalised_like_the_config():
    trl_adapter = pytest.importorskip("lossagg.integrations.trl", reason="TRL is not importable (scripts/install_peers.sh installs it)")
    for spelling in ("Dr_GRPO", " dr_grpo ", "DR_GRPO"):
        config = trl_adapter.config_for_loss_type(spelling, num_generations=4, max_completion_length=16)
        assert (config.mode, config.divisor) == ("constant", 16.0)
    assert trl_adapter.config_for_loss_type(" DAPO", num_generations=4, max_completion_length=None).mode == "token_mean"
    with pytest.raises(ValueError, match="loss_type='Token-Sum': mode 'token-sum' is not supported"):
        trl_adapter.config_for_loss_type("Token-Sum", num_generations=4, max_completion_length=16)


# ------------------------------------------------- hypothesis: the numeric arguments
# Each property draws numbers of every kind a caller might hand over (Python, NumPy, 0-dim
# tensors, bools, strings, NaN/inf, huge) and checks the verdict against an oracle written
# here: accepted with the float64 formula's value, or refused naming the argument.
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

numbers = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-5, 40),
    st.integers(-3, 40).map(np.int64),
    st.integers(-3, 40).map(np.int32),
    st.floats(-5, 40).map(np.float64),
    st.integers(-3, 40).map(torch.tensor),
    st.floats(-5, 40).map(lambda x: torch.tensor(x, dtype=torch.float64)),
    st.just(torch.tensor([2, 3])),
    st.just(torch.tensor(True)),
    st.text(max_size=4),
    st.just([2]),
)


def int_like(v):
    """The integer a count argument stands for, or None (floats, bools, strings, beyond 2**53... are not counts)."""
    if isinstance(v, bool) or isinstance(v, np.bool_):
        return None
    if isinstance(v, (int, np.integer)):
        n = int(v)
    elif isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point() and v.dtype != torch.bool:
        n = int(v.item())
    else:
        return None
    return n if n <= 2**53 else None


def number_like(v):
    """The finite float a number argument stands for, or None."""
    n = int_like(v)
    if n is not None:
        return float(n)
    if isinstance(v, (float, np.floating)) and not isinstance(v, bool):
        return float(v) if np.isfinite(v) else None
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
        return float(v.item()) if torch.isfinite(v) else None
    return None


def refused_naming(call, *names):
    with pytest.raises((ValueError, TypeError)) as err:
        call()
    assert any(n in str(err.value) for n in names), f"{err.value!r} names none of {names}"


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


@PROPERTY
@given(num_micro_batches=numbers, dp_size=numbers, cp_size=numbers, per_token=st.booleans())
def test_megatron_sizes(num_micro_batches, dp_size, cp_size, per_token):
    plan, cu, mask = megatron_plan()
    call = lambda: make_loss_func(  # noqa: E731
        plan, [0, 1], cu, mask, num_micro_batches=num_micro_batches, dp_size=dp_size, cp_size=cp_size, calculate_per_token_loss=per_token
    )
    sizes = {"num_micro_batches": int_like(num_micro_batches), "dp_size": int_like(dp_size), "cp_size": int_like(cp_size)}
    bad = [name for name, v in sizes.items() if v is None or v < 1]
    if bad:
        return refused_naming(call, *bad)
    out = call()(torch.full((9,), 3.0, dtype=torch.float64))
    scale = 9.0 if per_token else sizes["num_micro_batches"] * sizes["dp_size"]  # T, or micro-batches x DP
    assert out[0].item() == pytest.approx(3.0 * scale, rel=1e-12)


@PROPERTY
@given(num_samples=numbers, total_tokens=numbers, max_tokens=numbers)
def test_from_totals_numbers(num_samples, total_tokens, max_tokens):
    counts = torch.tensor([3, 0, 5, 4])  # 4 samples, 12 tokens, longest 5
    config = lossagg.LossAggregationConfig(mode="max_length")
    call = lambda: lossagg.StepPlan.from_totals(config, counts, num_samples=num_samples, total_tokens=total_tokens, max_tokens=max_tokens)  # noqa: E731
    n, t, lmax = int_like(num_samples), number_like(total_tokens), number_like(max_tokens)
    if num_samples is None:
        return refused_naming(call, "num_samples")
    if max_tokens is None:
        return refused_naming(call, "max_tokens")
    bad = []
    if n is None or n < 4:
        bad.append("num_samples")
    if total_tokens is not None and (t is None or t < 12):
        bad.append("total_tokens")
    if lmax is None or lmax < 5:
        bad.append("max_tokens")
    if not bad and t is not None and lmax > t:
        bad.append("max_tokens")
    if bad:
        return refused_naming(call, *bad)
    assert call().sample_denoms.tolist() == [n * max(lmax, 1.0)] * 4


@PROPERTY
@given(num_generations=numbers, max_completion_length=numbers, loss_type=st.sampled_from(["grpo", "dr_grpo", "prompt_mean", "max_length"]))
def test_trl_numbers(num_generations, max_completion_length, loss_type):
    trl_adapter = pytest.importorskip("lossagg.integrations.trl", reason="TRL is not importable (scripts/install_peers.sh installs it)")
    call = lambda: trl_adapter.config_for_loss_type(loss_type, num_generations=num_generations, max_completion_length=max_completion_length)  # noqa: E731
    g, m = int_like(num_generations), int_like(max_completion_length)
    if g is None or g < 1:
        return refused_naming(call, "num_generations")
    if max_completion_length is not None and (m is None or m < 1):
        return refused_naming(call, "max_completion_length")
    if loss_type == "dr_grpo" and m is None:
        return refused_naming(call, "max_completion_length")
    config = call()
    assert config.divisor == (float(m) if loss_type == "dr_grpo" else None)
    assert config.n_samples_per_prompt == (g if loss_type == "prompt_mean" else None)
