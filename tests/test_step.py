"""The planner, StepPlan: the contributions of any split sum to J, gradients match; known
values; the one all-reduce (and a max only when a mode needs it); the samples a micro-batch
selects; the arguments it refuses, named. ``StepPlan.from_totals`` is in test_step_from_totals.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
from batches import per_prompt, random_step, sessions_in
from hypothesis import given, settings
from hypothesis import strategies as st

import lossagg
from lossagg import LossAggregationConfig, StepPlan, gradient_scale
from lossagg.testing import check_split_invariance, reference_loss

# every registered mode, with the extra settings it needs (a fifth mode is tested with no edit here)
MODES = {name: dict(spec.example_settings) for name, spec in lossagg.MODES.items()}
COUNTS = torch.tensor([3, 0, 5, 4])  # this rank: 4 samples, 12 tokens, longest 5
PROMPT_MEAN_PAIRS = LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("split", [(1, 1, 1), (3, 1, 1), (2, 2, 1), (1, 2, 2), (2, 3, 3)])
def test_split_invariance(mode, split):
    micro_batches, dp, cp = split
    values, mask, cu, groups = random_step(seed=hash((mode, split)) % 1000)
    config = LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, 4), **MODES[mode])
    report = check_split_invariance(
        config, values, mask, cu, group_index=groups, session_index=sessions_in(groups), micro_batches=micro_batches, dp_size=dp, cp_size=cp
    )
    assert report.ok, str(report)


@pytest.mark.parametrize("mode", list(MODES))
def test_rollout_mask_sets_denominators_only(mode):
    values, mask, cu, groups = random_step(seed=5)
    rollout = mask.clone()
    mask = mask & (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) < 0.5)  # rejection after rollout
    config = LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, 4), **MODES[mode])
    sessions = sessions_in(groups)
    report = check_split_invariance(config, values, mask, cu, group_index=groups, session_index=sessions, rollout_mask=rollout)
    assert report.ok, str(report)
    full = lossagg.aggregate(config, values, mask, cu_seqlens=cu, group_index=groups, session_index=sessions, rollout_mask=rollout)
    expected = reference_loss(config, values, mask, cu, groups, rollout, sessions)
    torch.testing.assert_close(full.double(), expected, rtol=1e-5, atol=1e-6)


def test_prompt_mean_known_value():
    # two groups of two samples; token means 0.5 and 1.0 -> 0.75
    values = torch.tensor([0.0, 1.0, 0.5, 0.5, 1.0, 1.0, 1.0])
    cu = torch.tensor([0, 2, 4, 6, 7])
    mask = torch.ones(7, dtype=torch.bool)
    config = LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2)
    j = lossagg.aggregate(config, values, mask, cu_seqlens=cu, group_index=torch.tensor([0, 0, 1, 1]))
    assert j.item() == pytest.approx(0.75)


def hand_example():
    # sample 0: losses [1, 2, 3] (3 tokens); sample 1: [4] (1 token); same group (n=2)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    cu = torch.tensor([0, 3, 4])
    mask = torch.ones(4, dtype=torch.bool)
    return values, mask, cu, torch.tensor([7, 7])


@pytest.mark.parametrize(
    "mode,extra,expected",
    [
        ("sample_mean", {}, (6 / 3 + 4 / 1) / 2),  # 3.0
        ("prompt_mean", {}, (6 + 4) / 4 / 1),  # 2.5
        ("token_mean", {}, (6 + 4) / 4),  # 2.5
        ("constant", {"divisor": 5.0}, (6 + 4) / (2 * 5)),  # 1.0
        ("max_length", {}, (6 + 4) / (2 * 3)),  # L_max = 3: 1.666...
        ("seq-mean-token-sum-norm", {}, (6 + 4) / (2 * 3)),  # verl's name without a divisor: max_length
        ("seq-mean-token-sum-norm", {"divisor": 5.0}, (6 + 4) / (2 * 5)),  # with one (its loss_scale_factor): constant
    ],
)
def test_hand_worked_examples(mode, extra, expected):
    values, mask, cu, groups = hand_example()
    config = LossAggregationConfig(mode=mode, n_samples_per_prompt=2, **extra)
    j = lossagg.aggregate(config, values, mask, cu_seqlens=cu, group_index=groups)
    assert j.item() == pytest.approx(expected)


def test_zero_token_step_gives_zero_and_finite_gradients():
    values = torch.randn(5, requires_grad=True)
    mask = torch.zeros(5, dtype=torch.bool)
    cu = torch.tensor([0, 2, 5])
    for mode, extra in MODES.items():
        config = LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, 2), **extra)
        values.grad = None
        j = lossagg.aggregate(config, values, mask, cu_seqlens=cu, group_index=torch.tensor([0, 0]), session_index=torch.tensor([0, 0]))
        j.backward()
        assert j.item() == 0.0
        assert torch.isfinite(values.grad).all() and (values.grad == 0).all()


def test_incomplete_group_is_named():
    config = LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=4)
    with pytest.raises(ValueError, match="group 11 has 3 sample"):
        StepPlan(config, torch.tensor([3, 4, 5, 6, 1, 2, 3]), group_index=torch.tensor([10, 10, 10, 10, 11, 11, 11]))


def test_missing_group_index_is_an_error():
    config = LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="group_index is required under mode=prompt_mean"):
        StepPlan(config, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="group_index is required"):
        lossagg.aggregate(config, torch.ones(3), torch.ones(3, dtype=torch.bool), cu_seqlens=torch.tensor([0, 1, 3]))


def test_denominators_from_another_step_are_rejected():
    config = LossAggregationConfig()
    plan = StepPlan(config, torch.tensor([3, 4, 5]))
    values, mask, cu = torch.ones(4), torch.ones(4, dtype=torch.bool), torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="sample_denoms must be a 1-D tensor of length B = 2"):
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=plan.sample_denoms_for(slice(0, 3)))


def test_plan_denominators_per_mode():
    counts = torch.tensor([2, 0, 6, 4])
    groups = torch.tensor([0, 0, 1, 1])
    sessions = sessions_in(groups)  # [0, 0, 1, 1]: one session of two samples per group
    d = {
        m: StepPlan(
            LossAggregationConfig(mode=m, n_samples_per_prompt=per_prompt(m, 2), **MODES[m]), counts, group_index=groups, session_index=sessions
        ).sample_denoms
        for m in MODES
    }
    assert d["sample_mean"].tolist() == [8.0, 4.0, 24.0, 16.0]  # N * max(M, 1)
    assert d["prompt_mean"].tolist() == [4.0, 4.0, 20.0, 20.0]  # P * Sg
    assert d["token_mean"].tolist() == [12.0] * 4  # T
    assert d["constant"].tolist() == [256.0] * 4  # N * L
    assert d["session_mean"].tolist() == [8.0, 4.0, 24.0, 16.0]  # S * K * max(M, 1)
    assert d["session_token_mean"].tolist() == [4.0, 4.0, 20.0, 20.0]  # S * Ts
    assert d["prompt_session_mean"].tolist() == [8.0, 4.0, 24.0, 16.0]  # P * Sp * K * max(M, 1)
    assert d["prompt_session_token_mean"].tolist() == [4.0, 4.0, 20.0, 20.0]  # P * Sp * Ts


def test_group_token_sums_are_one_vectorised_sum():
    labels, dense = torch.unique(torch.tensor([5, 9, 5, 9]), return_inverse=True)
    sums = lossagg.totals.group_sums(torch.tensor([1.0, 2, 3, 4]), dense, labels.numel())[dense]
    assert sums.tolist() == [4.0, 6.0, 4.0, 6.0]


def test_metrics_use_default_reducer():
    # the default reducer of docs/terms.md: sample_mean, or token_mean when the step itself is token-level
    values, mask, cu, groups = random_step(seed=2)
    entropy = torch.rand(values.shape)
    kl = torch.rand(values.shape)
    for mode in MODES:
        plan = StepPlan(
            LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, 4), **MODES[mode]),
            lossagg.token_counts(mask, cu),
            group_index=groups,
            session_index=sessions_in(groups),
        )
        got = plan.metrics({"entropy": entropy, "kl": kl}, mask, slice(None), cu)
        reducer = "token_mean" if mode == "token_mean" else "sample_mean"
        for name, metric in (("entropy", entropy), ("kl", kl)):
            expected = reference_loss(LossAggregationConfig(mode=reducer), metric, mask, cu)
            torch.testing.assert_close(got[name], expected, rtol=1e-6, atol=1e-7, msg=f"{name} under {mode}: reduced by {reducer}")


def test_gradient_scale():
    assert gradient_scale("sum", dp_size=4, cp_size=2, num_micro_batches=8) == 1.0
    assert gradient_scale("mean", dp_size=4, cp_size=2) == 8.0
    assert gradient_scale("micro_batch_mean", num_micro_batches=8) == 8.0
    # Megatron's schedule multiplies by CP and its DDP averages over DP x CP: CP cancels
    assert gradient_scale("megatron", dp_size=4, cp_size=2, num_micro_batches=8) == 32.0
    assert gradient_scale("megatron", dp_size=4, cp_size=1, num_micro_batches=8) == 32.0
    with pytest.raises(ValueError, match="convention must be one of"):
        gradient_scale("avg")
    with pytest.raises(ValueError, match="dp_size must be an integer >= 1"):
        gradient_scale("mean", dp_size=0)
    assert gradient_scale("mean", dp_size=np.int64(2), cp_size=torch.tensor(2)) == 4.0  # NumPy and 0-dim tensor sizes
    with pytest.raises(ValueError, match="num_micro_batches must be an integer >= 1, got 2.0"):
        gradient_scale("micro_batch_mean", num_micro_batches=2.0)


def test_zigzag_layout():
    cu = torch.tensor([0, 5, 13])  # lengths 5 and 8, cp=2 -> chunks of 2 and 2
    assert lossagg.zigzag_local_cu_seqlens(cu, 2).tolist() == [0, 4, 8]
    # rank 0: chunks 0 and 3 of each padded sequence; rank 1: chunks 1 and 2
    assert lossagg.zigzag_positions(cu, 2, 0).tolist() == [0, 1, -1, -1, 5, 6, 11, 12]
    assert lossagg.zigzag_positions(cu, 2, 1).tolist() == [2, 3, 4, -1, 7, 8, 9, 10]
    x = torch.arange(13.0)
    both = torch.cat([lossagg.zigzag_shard(x, cu, 2, r, pad_value=-1) for r in range(2)])
    assert sorted(v for v in both.tolist() if v >= 0) == list(range(13))


def test_prompt_mean_groups_of_unequal_size_unless_a_size_is_promised():
    counts = torch.tensor([2, 4, 6, 1, 3])  # group 0 lost a sample to filtering
    groups = torch.tensor([0, 0, 1, 1, 1])
    plan = StepPlan(LossAggregationConfig(mode="prompt_mean"), counts, group_index=groups)
    assert plan.totals.num_groups == 2
    assert plan.sample_denoms.tolist() == [12.0, 12.0, 20.0, 20.0, 20.0]  # P * Sg
    with pytest.raises(ValueError, match="group 0 has 2 sample"):
        StepPlan(LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=3), counts, group_index=groups)


def test_an_empty_micro_batch_contributes_zero():
    plan = StepPlan(LossAggregationConfig(mode="token_mean"), COUNTS)
    v = torch.randn(4, 6, requires_grad=True)
    m = torch.ones(4, 6, dtype=torch.bool)
    j = plan.loss(v[:0], m[:0], [])
    j.backward()
    assert j.item() == 0.0 and torch.equal(v.grad, torch.zeros_like(v))
    packed = torch.randn(12)
    assert plan.loss(packed[:0], torch.ones(0, dtype=torch.bool), [], torch.tensor([0])).item() == 0.0
    assert plan.metrics({"entropy": v[:0]}, m[:0], [])["entropy"].item() == 0.0


# ------------------------------------------------------ the collectives of a plan
class _FakeGroup:
    """Stands for a process group of one rank; all_reduce is patched to the identity, and the plan's
    check of its type (lossagg.validate.check_process_group) lets it through (with_fake_group)."""


def with_fake_group(monkeypatch) -> _FakeGroup:
    monkeypatch.setattr(lossagg.step, "check_process_group", lambda group, *_: group)
    return _FakeGroup()


@pytest.mark.parametrize(
    ("mode", "collectives"),
    [("sample_mean", ["sum"]), ("token_mean", ["sum"]), ("constant", ["sum"]), ("prompt_mean", ["sum"]), ("max_length", ["sum", "max"])],
)
def test_the_planner_gathers_sums_in_one_all_reduce_and_a_max_only_when_needed(mode, collectives, monkeypatch):
    calls = []

    def fake_all_reduce(buf, op=None, group=None):
        calls.append(("sum" if op == dist.ReduceOp.SUM else "max", buf.dtype, buf.numel()))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    config = LossAggregationConfig(mode=mode, n_samples_per_prompt=2, global_batch_size=8, **lossagg.MODES[mode].example_settings)
    StepPlan(config, COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=with_fake_group(monkeypatch))
    assert [c[0] for c in calls] == collectives and all(c[1] == torch.float64 for c in calls)
    if mode == "prompt_mean":  # the head that carries every rank's failure, N, T, then sizes and token sums of the 4 labels
        assert calls[0][2] == lossagg.totals._HEAD + 2 + 2 * 4


# ------------------------------------------------------ the arguments of a plan
STEP_PLAN_REFUSED = [
    ("num_group_labels 10**12", dict(num_group_labels=10**12), ValueError, r"num_group_labels must be <= 16777216 .* got 1000000000000"),
    ("num_group_labels 0", dict(num_group_labels=0), ValueError, r"num_group_labels must be an integer >= 1, got 0"),
    ("num_group_labels a float", dict(num_group_labels=2.0), ValueError, r"num_group_labels must be an integer >= 1, got 2.0"),
    ("num_groups (the pre-release name)", dict(num_groups=2), TypeError, r"num_groups"),
    ("num_group_labels a string", dict(num_group_labels="2"), ValueError, r"num_group_labels must be an integer >= 1, got '2'"),
]


@pytest.mark.parametrize(("case", "kwargs", "kind", "message"), STEP_PLAN_REFUSED, ids=[c[0] for c in STEP_PLAN_REFUSED])
def test_step_plan_refuses(case, kwargs, kind, message, monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no collective before the arguments are checked"))
    with pytest.raises(kind, match=message):
        StepPlan(PROMPT_MEAN_PAIRS, COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=with_fake_group(monkeypatch), **kwargs)


def test_a_label_outside_the_bounds_travels_in_the_one_all_reduce_and_is_raised_after_it(monkeypatch):
    # a check that can fail on one rank only: the rank still joins the collective (with the same layout) and raises
    # after it, so that the others, told by the flag in the buffer's head, raise too instead of waiting
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda buf, **k: calls.append(buf.numel()))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match=r"group_index must lie in \[0, 1\).*every rank of the process group raises with this one"):
        StepPlan(PROMPT_MEAN_PAIRS, COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=with_fake_group(monkeypatch), num_group_labels=1)
    assert len(calls) == 1


def test_group_labels_from_the_config_are_bounded_and_named(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no collective before the arguments are checked"))
    config = LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2, global_batch_size=2**40)
    with pytest.raises(ValueError, match=re.escape("num_group_labels (global_batch_size // n_samples_per_prompt of the config) must be <= 16777216")):
        StepPlan(config, COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=with_fake_group(monkeypatch))


def test_step_plan_accepts_numpy_label_counts(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    plan = StepPlan(
        PROMPT_MEAN_PAIRS, COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=with_fake_group(monkeypatch), num_group_labels=np.int64(3)
    )
    assert plan.totals.num_groups == 2 and plan.sample_denoms.tolist() == [2 * 3.0, 2 * 3.0, 2 * 9.0, 2 * 9.0]


def test_helpers_name_bad_arguments():
    counts = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="group_index must be a 1-D tensor of integer prompt-group indices"):
        StepPlan(LossAggregationConfig(mode="prompt_mean"), counts, group_index=["p1", "p2"])
    assert StepPlan({"mode": "token_mean"}, counts).config.mode == "token_mean"
    with pytest.raises(TypeError, match="config must be a LossAggregationConfig"):
        StepPlan("token_mean", counts)
    with pytest.raises(lossagg.ConfigError, match="unknown mode"):
        StepPlan({"mode": "nope"}, counts)
    with pytest.raises(TypeError, match="token_counts must hold real numbers"):
        StepPlan(LossAggregationConfig(), torch.tensor([1 + 1j]))
    with pytest.raises(TypeError, match="token_counts must be"):
        StepPlan(LossAggregationConfig(), ["a", "b"])
    with pytest.raises(ValueError, match="num_group_labels must be an integer >= 1"):
        StepPlan(LossAggregationConfig(mode="prompt_mean"), counts, group_index=[0, 0], num_group_labels=0)
    plan = StepPlan(LossAggregationConfig(), counts)
    with pytest.raises(ValueError, match=r"metrics\['kl'\] must have the token shape of mask"):
        plan.metrics({"kl": torch.ones(2)}, torch.ones(3, dtype=torch.bool), [0, 1], torch.tensor([0, 1, 3]))
    cu = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="cp_size must be an integer >= 1"):
        lossagg.zigzag_local_cu_seqlens(cu, "2")
    with pytest.raises(ValueError, match="cp_rank must be an integer"):
        lossagg.zigzag_positions(cu, 2, 1.0)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the number of tokens T = 4"):
        lossagg.zigzag_shard(torch.ones(4), cu, 2, 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        lossagg.zigzag_positions(torch.tensor([0, 3, 2]), 2, 0)
    with pytest.raises(ValueError, match="num_micro_batches must be an integer"):
        lossagg.gradient_scale("megatron", num_micro_batches=True)


# ------------------------------------------------- the plan checks the d[i] it builds
D_OVERFLOW = [
    ("constant_divisor", lambda: StepPlan({"mode": "constant", "divisor": 1e308}, torch.tensor([3.0, 5.0])), ["mode=constant", "divisor=1e+308"]),
    ("constant_from_totals", lambda: StepPlan.from_totals({"mode": "constant", "divisor": 1e300}, torch.tensor([3.0]), num_samples=2**53),
     ["mode=constant", "divisor=1e+300", "num_samples=9007199254740992"]),
    ("max_length", lambda: StepPlan.from_totals({"mode": "max_length"}, torch.tensor([3.0, 5.0]), num_samples=2**53, max_tokens=1e300),
     ["mode=max_length", "max_tokens=1e+300", "num_samples=9007199254740992"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "build", "fragments"), D_OVERFLOW, ids=[c[0] for c in D_OVERFLOW])
def test_denominators_that_overflow_float64_name_the_mode_and_the_setting(case, build, fragments):
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert "overflows float64" in message and "sample_denoms" not in message, message
    for fragment in fragments:
        assert fragment in message, message


@given(divisor=st.floats(min_value=1e-300, max_value=1e308), n=st.integers(min_value=1, max_value=2**53))
@settings(max_examples=150, deadline=None)
def test_a_plan_either_holds_positive_finite_denominators_or_refuses_by_name(divisor, n):
    """Over the whole range of divisor and N: never an inf or a 0 d[i] handed to the op."""
    try:
        plan = StepPlan.from_totals({"mode": "constant", "divisor": divisor}, torch.tensor([1.0]), num_samples=n)
    except ValueError as exc:
        assert "mode=constant" in str(exc) and "divisor=" in str(exc), str(exc)
    else:
        d = plan.sample_denoms
        assert bool(torch.isfinite(d).all()) and bool((d > 0).all()), d


# ------------------------------------------------ the samples of a micro-batch
@pytest.fixture
def plan():
    return StepPlan(LossAggregationConfig(), torch.tensor([2, 3, 4, 5]))


def test_samples_accepts_positions_slices_and_bool_selections(plan):
    full = plan.sample_denoms.float()
    assert torch.equal(plan.sample_denoms_for([1, 3]), full[[1, 3]])
    assert torch.equal(plan.sample_denoms_for(slice(1, 3)), full[1:3])
    assert torch.equal(plan.sample_denoms_for(torch.tensor([False, True, False, True])), full[[1, 3]])


@pytest.mark.parametrize(
    ("samples", "kind", "message"),
    [
        ([-1], ValueError, r"samples must be positions in \[0, 4\)"),
        ([4], ValueError, r"samples must be positions in \[0, 4\)"),
        ([0.5, 1.5], TypeError, "samples must hold integer positions"),
        (torch.tensor([True, False]), ValueError, "bool selection must have one entry per sample"),
        (3, TypeError, "samples must be a 1-D selection"),
        ("ab", TypeError, "samples must be integer positions"),
    ],
)
def test_bad_samples_are_named(plan, samples, kind, message):
    with pytest.raises(kind, match=message):
        plan.sample_denoms_for(samples)


def test_sample_count_mismatch_blames_samples(plan):
    values = torch.randn(5)
    mask = torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"samples selects 3 sample\(s\) but cu_seqlens has 2"):
        plan.loss(values, mask, [0, 1, 2], torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="samples selects 1"):
        plan.metrics({"kl": values}, mask, [0], torch.tensor([0, 2, 5]))


MICRO_BATCH_POSITIONS_REFUSED = [
    ("same_sample_twice", [1, 1], "position 1 2 times"),
    ("three_times", [0, 2, 2, 2], "position 2 3 times"),
    ("tensor", torch.tensor([0, 0]), "position 0 2 times"),
    ("numpy", np.array([3, 1, 3]), "position 3 2 times"),
]


@pytest.mark.parametrize(("case", "samples", "message"), MICRO_BATCH_POSITIONS_REFUSED, ids=[c[0] for c in MICRO_BATCH_POSITIONS_REFUSED])
def test_a_micro_batch_naming_a_sample_twice_is_refused(case, samples, message):
    """A sample counted twice would weigh twice in J: loss, metrics and sample_denoms_for refuse it."""
    plan = StepPlan({"mode": "sample_mean"}, torch.tensor([2.0, 2.0, 2.0, 2.0]))
    b = len(samples)
    values, mask = torch.ones(2 * b), torch.ones(2 * b, dtype=torch.bool)
    cu = torch.arange(0, 2 * b + 1, 2)
    for call in (
        lambda: plan.loss(values, mask, samples, cu),
        lambda: plan.metrics({"x": values}, mask, samples, cu),
        lambda: plan.sample_denoms_for(samples),
    ):
        with pytest.raises(ValueError, match=r"samples must name each sample of the micro-batch once, got " + message):
            call()


PLAN_TENSORS_REFUSED = [
    ("meta_group_index", dict(group_index=torch.zeros(2, dtype=torch.long, device="meta")), ValueError, "group_index must hold data"),
    ("sparse_group_index", dict(group_index=torch.zeros(2, dtype=torch.long).to_sparse()), TypeError, "group_index must be a dense (strided) tensor"),
    ("meta_counts", dict(token_counts=torch.ones(2, device="meta")), ValueError, "token_counts must hold data"),
    ("sparse_counts", dict(token_counts=torch.ones(2).to_sparse()), TypeError, "token_counts must be a dense (strided) tensor"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "changes", "kind", "message"), PLAN_TENSORS_REFUSED, ids=[c[0] for c in PLAN_TENSORS_REFUSED])
def test_plan_tensors_without_data_are_named(case, changes, kind, message):
    kwargs = dict(token_counts=torch.tensor([3.0, 4.0]), group_index=torch.tensor([0, 0]))
    kwargs.update(changes)
    with pytest.raises(kind, match=re.escape(message)):
        StepPlan({"mode": "prompt_mean"}, kwargs.pop("token_counts"), **kwargs)


def test_from_denoms_carries_a_plan_of_every_term_and_names_what_does_not_fit():
    """A plan's d_k[i] (and w_i) carried elsewhere (verl's driver -> its micro-batches) reduce as the plan itself does,
    split or not; a mapping that misses a term, one tensor for several terms, or weights that do not match are named."""
    config = lossagg.LossAggregationConfig.from_dict(
        {"mode": "prompt_mean", "weighting": "multiply", "terms": {"kl": {"mode": "session_token_mean", "coefficient": 0.1}}}
    )
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(6, 7, generator=g) > 0.3
    groups, sessions = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 0, 1, 2, 3, 3])
    weights = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    plan = lossagg.StepPlan.from_mask(config, mask, group_index=groups, session_index=sessions, sample_weights=weights)
    carried = lossagg.StepPlan.from_denoms(plan.term_denoms, config=config, sample_weights=weights)
    values = {"pg": torch.randn(6, 7, generator=g, dtype=torch.float64), "kl": torch.randn(6, 7, generator=g, dtype=torch.float64)}
    want = plan.loss(values, plan.micro_batch(slice(None), mask))
    halves = sum(carried.loss({k: v[rows] for k, v in values.items()}, carried.micro_batch(rows, mask[rows])) for rows in ([0, 4], [1, 2, 3, 5]))
    torch.testing.assert_close(halves, want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"must map each of the loss's terms \(pg, kl\)"):
        lossagg.StepPlan.from_denoms({"pg": plan.sample_denoms}, config=config, sample_weights=weights)
    with pytest.raises(ValueError, match="the config has the terms pg, kl"):
        lossagg.StepPlan.from_denoms(plan.sample_denoms, config=config, sample_weights=weights)
    with pytest.raises(ValueError, match="weigh their samples: pass sample_weights"):
        lossagg.StepPlan.from_denoms(plan.term_denoms, config=config)
    with pytest.raises(ValueError, match="no term of the config weighs"):
        lossagg.StepPlan.from_denoms(plan.sample_denoms, sample_weights=weights)
    with pytest.raises(ValueError, match=r"sample_denoms\['kl'\]"):
        lossagg.StepPlan.from_denoms({"pg": plan.sample_denoms, "kl": plan.sample_denoms[:3]}, config=config, sample_weights=weights)
