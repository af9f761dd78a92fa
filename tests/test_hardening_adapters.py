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
]


@pytest.mark.parametrize(("case", "kwargs", "expected"), VERL_ACCEPTED, ids=[c[0] for c in VERL_ACCEPTED])
def test_verl_accepts(case, kwargs, expected):
    assert verl(**kwargs).item() == pytest.approx(expected, rel=1e-12)


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
