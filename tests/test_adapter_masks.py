"""Masks as weights: the peer adapters on masks that are not 0/1.

verl, TRL (and OpenRLHF, AReaL) multiply each token's loss by its mask entry and divide by
sums of the mask, so a fractional float mask is a weight there. Each drop-in must give the
peer's number for every mask the peer accepts, or refuse it naming the argument:

* verl (``lossagg.integrations.verl.agg_loss``): run side by side with the real verl 0.9.1
  ``agg_loss`` (``verl/trainer/ppo/core_algos.py``) on fractional, integer and bool masks,
  every verl mode, with and without the global-batch arguments; values and gradients to
  1e-12 relative in float64, and a hypothesis property over random fractional masks.
  Negative and non-finite entries are refused; lossagg's own modes (which count tokens)
  refuse a mask that is not 0/1.
* TRL (``lossagg.integrations.trl.GRPOTrainer``): the step denominators against TRL 1.16's
  normalisation formulas written from its source, and real trainer steps of ours and of
  TRL's on a fractional ``tool_mask``.
* Megatron (``lossagg.integrations.megatron.make_loss_func``): the plan counts tokens, so a
  mask that is not 0/1 is refused by name.
"""

from __future__ import annotations

import math
import os
import types
import warnings

import pytest
import torch
from batches import loss_like
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import grid

import lossagg
from lossagg.integrations.megatron import make_loss_func
from lossagg.integrations.verl import VERL_MODES, agg_loss
from lossagg.modes import MODES

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not importable (scripts/install_peers.sh installs it)")

RTOL = 1e-12

# ----------------------------------------------------------------------------- verl
# Rows mix weights 0.5, 2.0, 0.25, 1.0 and 0; row 1 is all zero (verl leaves it out of the
# sequence count), row 3 sums to 0.5 (< 1: verl divides by it, it is no count of tokens),
# row 4 holds one tiny weight (it counts as a whole sequence).
WEIGHTS = torch.tensor(
    [
        [0.5, 2.0, 0.25, 1.0, 0.0, 0.5],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 2.0, 0.0, 0.25, 0.0],
        [0.25, 0.0, 0.25, 0.0, 0.0, 0.0],
        [1e-3, 0.0, 0.0, 0.0, 0.0, 0.0],
    ],
    dtype=torch.float64,
)
ZERO_ONE = (WEIGHTS != 0).to(torch.float64)
MASKS = {
    "fractional float64": WEIGHTS,
    "fractional float32": WEIGHTS.float(),
    "fractional bfloat16": WEIGHTS.bfloat16(),
    "integer weights int64": torch.tensor([[0, 2, 1, 3, 0, 1], [0] * 6, [1, 1, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]]),
    "0/1 int64": ZERO_ONE.long(),
    "0/1 uint8": ZERO_ONE.to(torch.uint8),
    "0/1 bool": ZERO_ONE.bool(),
    "0/1 float32": ZERO_ONE.float(),
    # the whole micro-batch weighs 0.75 in all: token-mean divides by 0.75
    "small total": torch.tensor([[0.25, 0.0, 0.25, 0.0, 0.0, 0.0], [0.0, 0.25, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64),
}


def global_arguments(mask, dp_size):
    """verl's global-batch arguments of a step that holds this micro-batch and others."""
    weight = float(mask.double().sum())
    return {"dp_size": dp_size, "batch_num_tokens": weight * dp_size + 1.5, "global_batch_size": mask.shape[0] * dp_size + 1}


ARGUMENTS = {
    "defaults": lambda mask: {},
    "loss_scale_factor": lambda mask: {"loss_scale_factor": 7},
    "dp_size=2 and the global batch": lambda mask: {**global_arguments(mask, 2), "loss_scale_factor": 4.5},
    "dp_size=3 and the global batch": lambda mask: global_arguments(mask, 3),
    # a step that is this micro-batch: the totals equal its own (the mask's sum, its non-empty rows)
    "the micro-batch's own totals": lambda mask: {
        "batch_num_tokens": float(mask.double().sum()),
        "global_batch_size": int((mask.double().sum(-1) > 0).sum()),
    },
}


def side_by_side(loss, mask, mode, **kwargs):
    """(ours, verl's) values and gradients w.r.t. loss_mat."""
    ours_in = loss.clone().requires_grad_(True)
    theirs_in = loss.clone().requires_grad_(True)
    ours = agg_loss(ours_in, mask, mode, **kwargs)
    theirs = core_algos.agg_loss(theirs_in, mask, mode, **kwargs)
    ours.backward()
    theirs.backward()
    return ours, theirs, ours_in.grad, theirs_in.grad


def rounding_scale(loss, mask, mode, **kwargs) -> float:
    """The size of J's terms: a sum that cancels to near 0 is compared to this, not to itself."""
    return float(agg_loss(loss.abs(), mask, mode, **kwargs))


def assert_same_as_verl(loss, mask, mode, **kwargs):
    ours, theirs, g_ours, g_theirs = side_by_side(loss, mask, mode, **kwargs)
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=RTOL * rounding_scale(loss, mask, mode, **kwargs))
    torch.testing.assert_close(g_ours, g_theirs, rtol=RTOL, atol=1e-300)


# every pair of values in the default tier, the product in the full one (tests/tiers.py)
@pytest.mark.parametrize("mode,mask_name,arguments", grid(VERL_MODES, list(MASKS), list(ARGUMENTS)))
def test_verl_weighs_by_the_mask_like_verl(mode, mask_name, arguments):
    mask = MASKS[mask_name]
    assert_same_as_verl(loss_like(mask), mask, mode, **ARGUMENTS[arguments](mask))


def test_the_issue_example():
    ones = torch.ones(1, 3)
    mask = torch.tensor([[0.5, 2.0, 1.0]])
    assert agg_loss(ones, mask, "token-mean").item() == pytest.approx(1.0)  # 3.5 / 3.5, as verl; it was 3.5 / 3
    assert core_algos.agg_loss(ones, mask, "token-mean").item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", VERL_MODES)
def test_verl_with_zero_weights_everywhere_is_zero(mode):
    """Where verl divides 0 by 0 (it counts the weights itself), the adapter gives 0."""
    mask = torch.zeros(3, 4, dtype=torch.float64)
    loss = loss_like(mask)
    ours = agg_loss(loss, mask, mode)
    assert ours.item() == 0.0
    assert mode == "token-sum" or torch.isnan(core_algos.agg_loss(loss, mask, mode))


def test_batch_num_tokens_is_checked_against_the_mask_sum_not_the_count():
    """The micro-batch's own total is what verl divides by: the sum of the weights."""
    quarter = torch.full((1, 4), 0.25, dtype=torch.float64)  # 4 tokens, weight 1
    assert_same_as_verl(loss_like(quarter), quarter, "token-mean", batch_num_tokens=2)  # a step weighing 2 >= 1
    doubled = torch.full((1, 2), 2.0, dtype=torch.float64)  # 2 tokens, weight 4
    with pytest.raises(ValueError, match=r"batch_num_tokens .* must be >= this micro-batch's 4"):
        agg_loss(loss_like(doubled), doubled, "token-mean", batch_num_tokens=3)


def test_batch_num_tokens_summed_in_float32_is_taken_for_the_micro_batch():
    """A trainer that sums a float32 mask over the step gets its rounding; that is not refused."""
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(64, 300, generator=g)
    total = mask.sum()  # float32, as a trainer sums it
    loss = torch.randn(64, 300, generator=g, dtype=torch.float64)
    for shift in (0, -1, 1):
        bnt = torch.nextafter(total, total + shift) if shift else total
        assert_same_as_verl(loss, mask, "token-mean", batch_num_tokens=bnt)


@pytest.mark.parametrize("global_batch_size", [4, 7, 2**40])
@pytest.mark.parametrize("dp_size", [1, 4])
@pytest.mark.parametrize("loss_scale_factor", [1e308, 1e300, float(2**1023)])
def test_seq_mean_token_sum_norm_with_a_huge_loss_scale_factor(global_batch_size, dp_size, loss_scale_factor):
    """verl divides by the batch, then by loss_scale_factor: finite where one product would overflow."""
    mask = MASKS["fractional float64"]
    kw = dict(dp_size=dp_size, global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)
    ours, theirs, g_ours, g_theirs = side_by_side(loss_like(mask), mask, "seq-mean-token-sum-norm", **kw)
    assert math.isfinite(theirs.item()) and theirs.item() != 0.0
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0.0)
    torch.testing.assert_close(g_ours, g_theirs, rtol=RTOL, atol=0.0)


def test_seq_mean_token_sum_norm_keeps_one_division_where_nothing_overflows():
    """The two-step division is only for an overflowing product: a moderate factor is
    divided once, inside the op (its bits are recorded in tests/golden/step_plan.json)."""
    mask = MASKS["0/1 float32"]
    loss = loss_like(mask)
    d = torch.full((mask.shape[0],), 4 * 7.0, dtype=torch.float64)  # 4 non-empty rows, factor 7
    expected = lossagg.reduce(loss, mask, sample_denoms=d)
    assert torch.equal(agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=7), expected)


VERL_BAD_MASKS = [
    ("a negative weight", torch.tensor([[1.0, -0.5, 1.0]]), ValueError, r"loss_mask must hold finite weights >= 0.*-0\.5 at loss_mask\[0, 1\]"),
    ("a negative integer", torch.tensor([[1, 0], [2, -1]]), ValueError, r"loss_mask.*-1 at loss_mask\[1, 1\]"),
    ("a row summing to 0 with a negative entry", torch.tensor([[1.0, -1.0]]), ValueError, r"loss_mask.*-1\.0"),
    ("NaN", torch.tensor([[1.0, float("nan")]]), ValueError, r"loss_mask.*nan at loss_mask\[0, 1\]"),
    ("inf", torch.tensor([[float("inf"), 1.0]]), ValueError, r"loss_mask.*inf at loss_mask\[0, 0\]"),
    ("complex", torch.ones(1, 2, dtype=torch.complex64), TypeError, r"loss_mask must be a bool, integer .* got dtype torch.complex64"),
    ("uint32", torch.ones(1, 2, dtype=torch.uint32), TypeError, r"loss_mask must be .* got dtype torch.uint32"),
]


@pytest.mark.parametrize(("case", "mask", "kind", "message"), VERL_BAD_MASKS, ids=[c[0] for c in VERL_BAD_MASKS])
@pytest.mark.parametrize("mode", VERL_MODES)
def test_verl_refuses_masks_that_are_no_weights(mode, case, mask, kind, message):
    with pytest.raises(kind, match=message):
        agg_loss(torch.ones(mask.shape, dtype=torch.float64), mask, mode)


def test_verl_refuses_a_half_precision_divisor_that_overflows():
    """verl sums a float16 mask in float16: past 65504 it divides by inf. Refused where the
    sum is a divisor; where verl only asks whether a row's sum is > 0, it is verl's number."""
    mask = torch.full((2, 40000), 2.0, dtype=torch.float16)
    loss = loss_like(mask)
    for mode in ("token-mean", "seq-mean-token-mean"):
        with pytest.raises(ValueError, match=r"loss_mask's sum (over a row )?overflows its dtype torch.float16"):
            agg_loss(loss, mask, mode)
    for mode in ("token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert_same_as_verl(loss, mask, mode)
    assert_same_as_verl(loss, mask, "token-mean", batch_num_tokens=160000)


@pytest.mark.parametrize("mode", VERL_MODES)
def test_verl_reads_broadcast_tensors_and_names_a_sparse_mask(mode):
    """A broadcast loss_mat or loss_mask (an expanded view, as verl's callers make when they
    broadcast advantages) gives verl's number; a sparse mask is refused naming loss_mask."""
    loss = loss_like(WEIGHTS)[:1].expand(5, -1)
    mask = WEIGHTS[:1].expand(5, -1)
    assert_same_as_verl(loss, mask, mode)  # the mask as given; loss_mat as a leaf (a clone is dense)
    torch.testing.assert_close(agg_loss(loss, mask, mode), core_algos.agg_loss(loss, mask, mode), rtol=RTOL, atol=1e-15)
    with pytest.raises(TypeError, match=r"loss_mask must be a dense \(strided\) tensor"):
        agg_loss(loss.contiguous(), WEIGHTS.to_sparse(), mode)


LOSSAGG_MODE_ARGUMENTS = {
    "sample_mean": {},
    "token_mean": {},
    "constant": {"loss_scale_factor": 4},
    "max_length": {},
    "prompt_mean": {"group_index": torch.tensor([0, 0, 1, 1, 2])},
    # sessions (docs/modes.md, "Sessions"): rows 0 and 1 one trajectory, nested in the prompt groups
    "session_mean": {"session_index": torch.tensor([0, 0, 1, 2, 3])},
    "session_token_mean": {"session_index": torch.tensor([0, 0, 1, 2, 3])},
    "prompt_session_mean": {"group_index": torch.tensor([0, 0, 1, 1, 2]), "session_index": torch.tensor([0, 0, 1, 2, 3])},
    "prompt_session_token_mean": {"group_index": torch.tensor([0, 0, 1, 1, 2]), "session_index": torch.tensor([0, 0, 1, 2, 3])},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_lossagg_modes_through_verl_refuse_a_fractional_mask(mode):
    """lossagg's modes build d[i] from token counts: a weight would count as one token."""
    kwargs = LOSSAGG_MODE_ARGUMENTS.get(mode, {})
    with pytest.raises(ValueError, match=rf"loss_agg_mode={mode} needs a 0/1 loss_mask, got 0\.5 at loss_mask\[0, 0\]: lossagg's modes count tokens"):
        agg_loss(loss_like(WEIGHTS), WEIGHTS, mode, **kwargs)
    with pytest.raises(ValueError, match="0/1 loss_mask, got -1"):
        agg_loss(loss_like(WEIGHTS), -ZERO_ONE, mode, **kwargs)
    with pytest.raises(TypeError, match="loss_mask must be"):
        agg_loss(loss_like(WEIGHTS), ZERO_ONE.to(torch.complex128), mode, **kwargs)


@pytest.mark.parametrize("mode", list(MODES))
def test_lossagg_modes_through_verl_take_any_0_1_dtype(mode):
    kwargs = LOSSAGG_MODE_ARGUMENTS.get(mode, {})
    loss = loss_like(ZERO_ONE)
    expected = agg_loss(loss, ZERO_ONE.bool(), mode, **kwargs)
    for dtype in (torch.float64, torch.float32, torch.int64, torch.uint8):
        torch.testing.assert_close(agg_loss(loss, ZERO_ONE.to(dtype), mode, **kwargs), expected, rtol=RTOL, atol=0.0)


# A hypothesis property: random fractional masks, every verl mode, random global arguments.
PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
weights = st.one_of(st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 2.0]), st.floats(0.0, 3.0), st.floats(1e-6, 1e-3))


@st.composite
def fractional_batches(draw):
    bs, width = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    mask = torch.tensor(draw(st.lists(weights, min_size=bs * width, max_size=bs * width)), dtype=torch.float64).reshape(bs, width)
    mask_dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    return mask.to(mask_dtype)


@PROPERTY
@given(
    mask=fractional_batches(),
    mode=st.sampled_from(VERL_MODES),
    dp_size=st.integers(1, 4),
    extra_tokens=st.one_of(st.none(), st.floats(0.0, 50.0)),
    extra_sequences=st.one_of(st.none(), st.integers(0, 20)),
    loss_scale_factor=st.one_of(st.none(), st.floats(1e-3, 1e3), st.integers(1, 64)),
    seed=st.integers(0, 2**16),
)
def test_verl_property_fractional_masks(mask, mode, dp_size, extra_tokens, extra_sequences, loss_scale_factor, seed):
    kwargs = {"dp_size": dp_size, "loss_scale_factor": loss_scale_factor}
    if dp_size > 1 or extra_tokens is not None:
        kwargs["batch_num_tokens"] = float(mask.double().sum()) + (extra_tokens or 0.0)
    if dp_size > 1 or extra_sequences is not None:
        kwargs["global_batch_size"] = int((mask.sum(-1) > 0).sum()) + (extra_sequences or 0)
    loss = loss_like(mask, seed)
    ours, theirs, g_ours, g_theirs = side_by_side(loss, mask, mode, **kwargs)
    if torch.isnan(theirs):  # verl's 0/0 when every weight is 0 and it counts them itself
        assert float(mask.sum()) == 0.0 and ours.item() == 0.0 and not g_ours.any()
        return
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=RTOL * rounding_scale(loss, mask, mode, **kwargs))
    torch.testing.assert_close(g_ours, g_theirs, rtol=RTOL, atol=1e-300)


# ------------------------------------------------------------------------- Megatron
def megatron_plan():
    cu = torch.tensor([0, 4, 9])
    mask = torch.ones(9, dtype=torch.bool)
    return lossagg.StepPlan.from_mask(lossagg.LossAggregationConfig(mode="sample_mean"), mask, cu), cu


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("argument", ["loss_mask", "rollout_mask"])
def test_megatron_refuses_a_mask_that_is_not_0_1(argument, per_token):
    plan, cu = megatron_plan()
    ones = torch.ones(9, dtype=torch.float32)
    weighted = ones.clone()
    weighted[5] = 0.5
    masks = {"loss_mask": ones, "rollout_mask": ones} | {argument: weighted}
    with pytest.raises(ValueError, match=rf"{argument} must hold 0s and 1s, got 0\.5 at {argument}\[5\]: the plan's d\[i\] .* token counts"):
        make_loss_func(
            plan, [0, 1], cu, masks["loss_mask"], rollout_mask=masks["rollout_mask"], num_micro_batches=1, calculate_per_token_loss=per_token
        )
    with pytest.raises(TypeError, match=rf"{argument} must be a bool, integer or floating tensor"):
        make_loss_func(
            plan,
            [0, 1],
            cu,
            masks["loss_mask"].to(torch.complex64) if argument == "loss_mask" else ones,
            rollout_mask=masks["rollout_mask"].to(torch.complex64) if argument == "rollout_mask" else None,
            num_micro_batches=1,
        )


@pytest.mark.parametrize("per_token", [False, True])
def test_megatron_takes_a_0_1_mask_of_any_dtype(per_token):
    plan, cu = megatron_plan()
    mask = torch.ones(9, dtype=torch.bool)
    mask[[2, 7]] = False
    out = torch.linspace(-1, 1, 9, dtype=torch.float64)
    expected = make_loss_func(plan, [0, 1], cu, mask, num_micro_batches=2, calculate_per_token_loss=per_token)(out)
    for dtype in (torch.float32, torch.float64, torch.int64, torch.uint8):
        got = make_loss_func(plan, [0, 1], cu, mask.to(dtype), num_micro_batches=2, calculate_per_token_loss=per_token)(out)
        torch.testing.assert_close(got[0], expected[0], rtol=RTOL, atol=0.0)
        if per_token:
            assert got[1].item() == expected[1].item() == 7


# ------------------------------------------------------------------------------ TRL
def trl_adapter():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    pytest.importorskip("trl", reason="TRL is not importable (scripts/install_peers.sh installs it)")
    from lossagg.integrations import trl as adapter

    return adapter


def trl_step_denoms(adapter, loss_type, batch, max_completion_length):
    """The adapter's d[i] for a generation batch that is one optimizer step of one micro-batch, on one process."""
    fake = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(gather=lambda t: t, process_index=0, num_processes=1),
        loss_aggregation=adapter.config_for_loss_type(loss_type, num_generations=2, max_completion_length=max_completion_length),
        model=types.SimpleNamespace(training=True),
        num_generations=2,
        num_generations_eval=2,
    )
    fake._loss_mask = types.MethodType(adapter.GRPOTrainer._loss_mask, fake)
    mask = fake._loss_mask(batch)
    batch = {**batch, adapter.GROUP_KEY: torch.arange(mask.shape[0]) // 2}  # the completions' prompt groups, as tagged
    adapter.GRPOTrainer._plan_step(fake, [batch], 2)  # one micro-batch, the whole step
    return batch[adapter.PLAN_KEY].sample_denoms[batch[adapter.SAMPLES_KEY]]


def trl_normalised_loss(loss_type, per_token_loss, mask, max_completion_length, micro_batches):
    """TRL 1.16's loss of a generation batch split into micro-batches (one process, one
    optimizer step), written from ``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``
    (which needs a model forward, so it is not callable on a given per-token loss):

    * grpo: ``((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()`` divided
      by ``current_gradient_accumulation_steps``;
    * dapo: ``(per_token_loss * mask).sum() / normalizer`` with ``normalizer =
      num_items_in_batch.clamp(min=1.0) / num_processes``, ``num_items_in_batch`` being the
      gathered ``loss_mask.sum()`` of the generation batch (``_generate_and_score_completions``);
    * dr_grpo: ``(per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)``
      divided by ``current_gradient_accumulation_steps``.

    ``mask`` is TRL's loss mask, ``completion_mask * tool_mask``.
    """
    num_items_in_batch = mask.sum()
    total = 0.0
    for rows in torch.tensor_split(torch.arange(mask.shape[0]), micro_batches):
        x, m = per_token_loss[rows], mask[rows]
        if loss_type == "grpo":
            total = total + ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / micro_batches
        elif loss_type == "dapo":
            total = total + (x * m).sum() / num_items_in_batch.clamp(min=1.0)
        elif loss_type == "dr_grpo":
            total = total + (x * m).sum() / (x.size(0) * max_completion_length) / micro_batches
    return total


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("with_tool_mask", [False, True])
def test_trl_denominators_weigh_by_the_mask_like_trl(loss_type, with_tool_mask):
    adapter = trl_adapter()
    completion_mask = (WEIGHTS != 0).long()
    batch = {"completion_mask": completion_mask if with_tool_mask else WEIGHTS.clone()}
    if with_tool_mask:
        batch["tool_mask"] = WEIGHTS.clone()
    mask = WEIGHTS  # TRL's loss mask either way
    d = trl_step_denoms(adapter, loss_type, batch, max_completion_length=6)
    per_token_loss = loss_like(mask)
    ours = lossagg.reduce(per_token_loss, mask, sample_denoms=d)
    for micro_batches in (1, 5):
        theirs = trl_normalised_loss(loss_type, per_token_loss, mask, 6, micro_batches)
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=0.0)


def test_trl_refuses_a_negative_or_nan_weight():
    adapter = trl_adapter()
    mask = WEIGHTS.clone()
    mask[2, 1] = -0.5  # its row still sums to more than 0
    with pytest.raises(ValueError, match=r"the loss mask \(completion_mask\) must hold finite weights >= 0, got -0\.5 at \[2, 1\]"):
        trl_step_denoms(adapter, "grpo", {"completion_mask": mask}, 6)
    tool = WEIGHTS.clone()
    tool[0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"\(completion_mask \* tool_mask\) must hold finite weights >= 0, got nan at \[0, 3\]"):
        trl_step_denoms(adapter, "dapo", {"completion_mask": (WEIGHTS != 0).long(), "tool_mask": tool}, 6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_trl_trainer_with_a_fractional_tool_mask_matches_trl(loss_type, tmp_path):
    """Real GRPOTrainer steps, ours and TRL's, whose loss mask carries weights: TRL's
    ``tool_mask`` (an ``env_mask`` of a rollout function) set to a fractional pattern, and
    ``num_items_in_batch`` recomputed from it as TRL computes it."""
    trl_adapter()
    import test_trl_trainer as trl_tests

    from lossagg.integrations.trl import GRPOTrainer

    class Weighted(trl_tests.TRLGRPOTrainer):
        """Puts weights into TRL's loss mask right after TRL builds the batch, before our adapter reads it."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            mask = out["completion_mask"]
            rows, cols = torch.meshgrid(torch.arange(mask.shape[0]), torch.arange(mask.shape[1]), indexing="ij")
            pattern = torch.tensor([0.5, 2.0, 0.25, 1.0, 0.0], dtype=torch.float64)
            weights = pattern[(rows + cols) % pattern.numel()]
            weights[1] = 0.05  # a completion whose weights sum to less than 1
            out["tool_mask"] = weights.to(mask.device)
            loss_mask = mask * out["tool_mask"]
            out["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
            return out

    class OursWeighted(GRPOTrainer, Weighted):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer, dataset = trl_tests.make_tokenizer(), trl_tests.make_dataset()
        _, ours = trl_tests.run(OursWeighted, loss_type, 2, tmp_path, tokenizer, dataset)
        _, theirs = trl_tests.run(Weighted, loss_type, 2, tmp_path, tokenizer, dataset)
        _, unweighted = trl_tests.run(trl_tests.TRLGRPOTrainer, loss_type, 2, tmp_path, tokenizer, dataset)
    assert trl_tests.relative_difference(theirs, ours) < 1e-9
    assert trl_tests.relative_difference(theirs, unweighted) > 1e-3  # the weights do change TRL's gradient
