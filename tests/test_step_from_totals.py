"""``StepPlan.from_totals``: a rank's plan from the step totals its trainer already holds (no
collective). Each hostile case is an input and its verdict: refused with a message naming the
total the user passed, or accepted with d[i] checked against a float64 formula; a property over
numbers of every kind; the same d[i] as the all-reduce for every mode."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hostile_numbers import PROPERTY, int_like, number_like, numbers, refused_naming
from hypothesis import given

import lossagg
from lossagg import LossAggregationConfig, StepPlan
from lossagg.testing import rank_totals

COUNTS = torch.tensor([3, 0, 5, 4])  # this rank: 4 samples, 12 tokens, longest 5
GROUP_SUMS = torch.tensor([3.0, 7.0, 9.0, 4.0])  # Sg[g(i)] of each local sample (its own count at least)
CFG = {
    "sample_mean": LossAggregationConfig(mode="sample_mean"),
    "token_mean": LossAggregationConfig(mode="token_mean"),
    "prompt_mean": LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2),
    "prompt_mean_any": LossAggregationConfig(mode="prompt_mean"),
    "max_length": LossAggregationConfig(mode="max_length"),
    "constant": LossAggregationConfig(mode="constant", divisor=8.0),
    # empty_samples=skip: N and P are read from N' and P' (this rank: 3 non-empty samples)
    "sample_mean_skip": LossAggregationConfig(mode="sample_mean", empty_samples="skip"),
    "prompt_mean_skip": LossAggregationConfig(mode="prompt_mean", empty_samples="skip"),
    "constant_skip": LossAggregationConfig(mode="constant", divisor=8.0, empty_samples="skip"),
    "max_length_skip": LossAggregationConfig(mode="max_length", empty_samples="skip"),
}

# (case, config, keywords, error type, the message, as a regex)
FROM_TOTALS_REFUSED = [
    (
        "a mode name instead of a config",
        "the string",
        dict(num_samples=4),
        TypeError,
        r"config must be a LossAggregationConfig .* got the string 'token_mean'",
    ),
    ("num_samples missing", "sample_mean", dict(), ValueError, r"mode=sample_mean needs the step total\(s\) num_samples \(N"),
    ("total_tokens missing under token_mean", "token_mean", dict(num_samples=8), ValueError, r"needs the step total\(s\) total_tokens \(T"),
    (
        "max_tokens missing under max_length",
        "max_length",
        dict(num_samples=8, total_tokens=40),
        ValueError,
        r"needs the step total\(s\) max_tokens \(L_max",
    ),
    ("group totals missing under prompt_mean", "prompt_mean", dict(num_samples=8), ValueError, r"num_groups \(P.*group_token_sums \(Sg"),
    ("an unknown total", "sample_mean", dict(num_samples=8, num_tokens=3), TypeError, r"unknown step total 'num_tokens'"),
    ("num_samples below the rank's", "sample_mean", dict(num_samples=3), ValueError, r"num_samples .* >= this rank's 4 sample\(s\), got 3"),
    ("num_samples a float", "sample_mean", dict(num_samples=8.5), ValueError, r"num_samples must be an integer >= 0, got 8.5"),
    ("num_samples a string", "sample_mean", dict(num_samples="8"), ValueError, r"num_samples must be an integer >= 0, got '8'"),
    ("num_samples a bool", "sample_mean", dict(num_samples=True), ValueError, r"num_samples must be an integer"),
    (
        "total_tokens below the rank's",
        "token_mean",
        dict(num_samples=8, total_tokens=11),
        ValueError,
        r"total_tokens .* >= this rank's own 12, got 11",
    ),
    (
        "total_tokens 0 while tokens exist",
        "token_mean",
        dict(num_samples=8, total_tokens=0),
        ValueError,
        r"total_tokens .* >= this rank's own 12, got 0",
    ),
    (
        "total_tokens nan",
        "token_mean",
        dict(num_samples=8, total_tokens=float("nan")),
        ValueError,
        r"total_tokens must be a finite number >= 0, got nan",
    ),
    ("total_tokens inf", "token_mean", dict(num_samples=8, total_tokens=float("inf")), ValueError, r"total_tokens must be a finite number"),
    (
        "max_tokens below the rank's longest",
        "max_length",
        dict(num_samples=8, max_tokens=4),
        ValueError,
        r"max_tokens .* >= this rank's own 5, got 4",
    ),
    (
        "max_tokens above total_tokens",
        "max_length",
        dict(num_samples=8, max_tokens=50, total_tokens=40),
        ValueError,
        r"max_tokens \(L_max, 50\) cannot exceed",
    ),
    (
        "more groups than samples",
        "prompt_mean_any",
        dict(num_samples=4, num_groups=5, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_groups \(P, 5\) cannot exceed num_samples \(N, 4\)",
    ),
    (
        "N != n x P when promised",
        "prompt_mean",
        dict(num_samples=8, num_groups=3, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_samples \(N, 8\) must equal n_samples_per_prompt \(2\) × num_groups \(P, 3\) = 6",
    ),
    (
        "num_groups 0 with samples",
        "prompt_mean",
        dict(num_samples=4, num_groups=0, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_groups must be an integer >= 1, got 0",
    ),
    (
        "a group sum below its sample's count",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=torch.tensor([3.0, 7.0, 4.0, 4.0])),
        ValueError,
        r"group_token_sums\[2\] .* >= the sample's own 5 tokens, got 4",
    ),
    (
        "a negative group sum",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=[4, -4, 9, 4]),
        ValueError,
        r"group_token_sums must be >= 0",
    ),
    (
        "group sums of the wrong length",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=torch.tensor([9.0, 9.0])),
        ValueError,
        r"group_token_sums must have one entry per local sample \(4\)",
    ),
    ("group sums a string", "prompt_mean", dict(num_samples=4, num_groups=2, group_token_sums="9"), TypeError, r"group_token_sums must be a 1-D"),
    (
        "total_tokens below the rank's, beside group sums",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=GROUP_SUMS, total_tokens=8),
        ValueError,
        r"total_tokens .* >= this rank's own 12",
    ),
    (
        "a group sum above the step's tokens",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=[3, 7, 20, 4], total_tokens=12),
        ValueError,
        r"group_token_sums holds 20, more than total_tokens \(T, 12\)",
    ),
    (
        "N' missing under skip",
        "sample_mean_skip",
        dict(num_samples=8),
        ValueError,
        r"mode=sample_mean with empty_samples=skip needs the step total\(s\) num_nonempty_samples \(N', samples in the step with at least",
    ),
    (
        "N' below the rank's non-empty samples",
        "sample_mean_skip",
        dict(num_nonempty_samples=2),
        ValueError,
        r"num_nonempty_samples \(N', the step's samples with at least one rollout token\) must be >= this rank's 3 such sample\(s\), got 2",
    ),
    ("N' a float", "sample_mean_skip", dict(num_nonempty_samples=5.5), ValueError, r"num_nonempty_samples must be an integer >= 0, got 5.5"),
    ("N' a bool", "constant_skip", dict(num_nonempty_samples=True), ValueError, r"num_nonempty_samples must be an integer"),
    ("N' a string", "max_length_skip", dict(num_nonempty_samples="6", max_tokens=5), ValueError, r"num_nonempty_samples must be an integer"),
    (
        "N' above N",
        "sample_mean_skip",
        dict(num_nonempty_samples=9, num_samples=8),
        ValueError,
        r"num_nonempty_samples \(N', 9\) cannot exceed num_samples \(N, 8\)",
    ),
    (
        "N' given under count is checked too",
        "sample_mean",
        dict(num_samples=8, num_nonempty_samples=2),
        ValueError,
        r"num_nonempty_samples .* >= this rank's 3 such sample\(s\), got 2",
    ),
    (
        "P' missing under skip",
        "prompt_mean_skip",
        dict(num_samples=4, num_groups=2, group_token_sums=GROUP_SUMS),
        ValueError,
        r"mode=prompt_mean with empty_samples=skip needs the step total\(s\) num_nonempty_groups \(P', prompt groups in the step with",
    ),
    (
        "P' 0 with a non-empty sample",
        "prompt_mean_skip",
        dict(num_nonempty_groups=0, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_nonempty_groups must be an integer >= 1, got 0",
    ),
    (
        "P' above P",
        "prompt_mean_skip",
        dict(num_groups=2, num_nonempty_groups=3, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_nonempty_groups \(P', 3\) cannot exceed num_groups \(P, 2\)",
    ),
    (
        "P' above N'",
        "prompt_mean_skip",
        dict(num_nonempty_groups=4, num_nonempty_samples=3, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_nonempty_groups \(P', 4\) cannot exceed num_nonempty_samples \(N', 3\)",
    ),
]


@pytest.mark.parametrize(("case", "cfg", "kwargs", "kind", "message"), FROM_TOTALS_REFUSED, ids=[c[0] for c in FROM_TOTALS_REFUSED])
def test_from_totals_refuses(case, cfg, kwargs, kind, message):
    config = "token_mean" if cfg == "the string" else CFG[cfg]
    with pytest.raises(kind, match=message):
        StepPlan.from_totals(config, COUNTS, **kwargs)


# (case, config, keywords, expected d[i] as a float64 formula)
FROM_TOTALS_ACCEPTED = [
    ("NumPy num_samples", "sample_mean", dict(num_samples=np.int64(8)), [8 * 3, 8 * 1, 8 * 5, 8 * 4]),
    ("0-dim tensor num_samples", "sample_mean", dict(num_samples=torch.tensor(8)), [8 * 3, 8 * 1, 8 * 5, 8 * 4]),
    ("total_tokens as a NumPy int", "token_mean", dict(num_samples=8, total_tokens=np.int64(40)), [40.0] * 4),
    ("total_tokens equal to the rank's", "token_mean", dict(num_samples=4, total_tokens=12), [12.0] * 4),
    ("max_tokens from another rank", "max_length", dict(num_samples=8, max_tokens=np.int32(9)), [8 * 9.0] * 4),
    (
        "prompt groups, NumPy P",
        "prompt_mean",
        dict(num_samples=4, num_groups=np.int64(2), group_token_sums=GROUP_SUMS),
        [2 * 3.0, 2 * 7.0, 2 * 9.0, 2 * 4.0],
    ),
    (
        "group sums as a list",
        "prompt_mean_any",
        dict(num_samples=4, num_groups=3, group_token_sums=[3, 7, 9, 4]),
        [3 * 3.0, 3 * 7.0, 3 * 9.0, 3 * 4.0],
    ),
    ("totals not needed are checked and kept", "sample_mean", dict(num_samples=8, total_tokens=40, max_tokens=5), [8 * 3, 8 * 1, 8 * 5, 8 * 4]),
    ("N' under skip", "sample_mean_skip", dict(num_nonempty_samples=6), [6 * 3, 6 * 1, 6 * 5, 6 * 4]),
    ("N' as a NumPy int, beside N", "constant_skip", dict(num_nonempty_samples=np.int64(6), num_samples=8), [6 * 8.0] * 4),
    ("N' with L_max under skip", "max_length_skip", dict(num_nonempty_samples=torch.tensor(6), max_tokens=9), [6 * 9.0] * 4),
    ("P' under skip", "prompt_mean_skip", dict(num_nonempty_groups=2, group_token_sums=GROUP_SUMS), [2 * 3.0, 2 * 7.0, 2 * 9.0, 2 * 4.0]),
    ("N' given under count is kept, N used", "sample_mean", dict(num_samples=8, num_nonempty_samples=6), [8 * 3, 8 * 1, 8 * 5, 8 * 4]),
]


@pytest.mark.parametrize(("case", "cfg", "kwargs", "expected"), FROM_TOTALS_ACCEPTED, ids=[c[0] for c in FROM_TOTALS_ACCEPTED])
def test_from_totals_accepts(case, cfg, kwargs, expected):
    plan = StepPlan.from_totals(CFG[cfg], COUNTS, **kwargs)
    assert plan.sample_denoms.dtype == torch.float64
    assert plan.sample_denoms.tolist() == [float(x) for x in expected]
    for name in kwargs:
        assert name in plan.totals


def test_from_totals_refuses_an_integral_float_count():
    with pytest.raises(ValueError, match=re.escape("num_samples must be an integer >= 0, got np.float64(8.0)")):
        StepPlan.from_totals(CFG["constant"], COUNTS, num_samples=np.float64(8.0))


@pytest.mark.parametrize("empty_samples", ["count", "skip"])
def test_from_totals_and_the_all_reduce_agree_for_every_mode(empty_samples):
    """The same numbers by both paths (the step is this rank's samples)."""
    groups = torch.tensor([0, 0, 1, 1])
    sessions = torch.tensor([0, 1, 2, 2])  # group 0: two sessions of one sample; group 1: one of two
    for name, spec in lossagg.MODES.items():
        per_prompt = None if "group_sessions" in spec.totals else 2  # groups of 1 and 2 sessions: no one size
        config = LossAggregationConfig(mode=name, n_samples_per_prompt=per_prompt, empty_samples=empty_samples, **spec.example_settings)
        gathered = StepPlan(config, COUNTS, group_index=groups, session_index=sessions)
        from_totals = StepPlan.from_totals(config, COUNTS, **rank_totals(config, COUNTS, torch.arange(4), groups, sessions))
        assert torch.equal(gathered.sample_denoms, from_totals.sample_denoms), name
        assert torch.equal(gathered.metric_denoms, from_totals.metric_denoms), name


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
@given(num_nonempty_samples=numbers, num_samples=numbers, total_tokens=numbers)
def test_from_totals_non_empty_numbers(num_nonempty_samples, num_samples, total_tokens):
    counts = torch.tensor([3, 0, 5, 4])  # 4 samples, 3 of them non-empty, 12 tokens
    config = lossagg.LossAggregationConfig(mode="sample_mean", empty_samples="skip")
    call = lambda: lossagg.StepPlan.from_totals(  # noqa: E731
        config, counts, num_nonempty_samples=num_nonempty_samples, num_samples=num_samples, total_tokens=total_tokens
    )
    k, n, t = int_like(num_nonempty_samples), int_like(num_samples), number_like(total_tokens)
    if num_nonempty_samples is None:
        return refused_naming(call, "num_nonempty_samples")
    bad = []
    if k is None or k < 3:
        bad.append("num_nonempty_samples")
    if num_samples is not None and (n is None or n < 4):
        bad.append("num_samples")
    if total_tokens is not None and (t is None or t < 12):
        bad.append("total_tokens")
    if not bad and n is not None and k > n:
        bad.append("num_nonempty_samples")
    if bad:
        return refused_naming(call, *bad)
    assert call().sample_denoms.tolist() == [k * 3.0, k * 1.0, k * 5.0, k * 4.0]


# ------------------------------------------------------------------ session totals against the others
SIX = torch.tensor([3, 2, 4, 1, 2, 3])  # six samples, 15 tokens
SESSION_CFG = {
    "session_mean": LossAggregationConfig(mode="session_mean"),
    "session_token_mean": LossAggregationConfig(mode="session_token_mean"),
    "prompt_session_mean": LossAggregationConfig(mode="prompt_session_mean", n_samples_per_prompt=2),
    "prompt_session_mean_any": LossAggregationConfig(mode="prompt_session_mean"),
}
ONES = torch.ones(6)
SESSION_TOTALS_REFUSED = [
    (
        "K larger than N",
        "session_mean",
        dict(num_samples=6, num_sessions=4, session_sizes=torch.tensor([200.0, 2, 1, 2, 2, 1])),
        r"session_sizes .* 200.*num_samples \(N\) 6",
    ),
    (
        "K not whole",
        "session_mean",
        dict(num_samples=6, num_sessions=4, session_sizes=torch.tensor([1.5, 2, 1, 2, 2, 1])),
        r"session_sizes\[0\] .* whole number, got 1.5",
    ),
    (
        "Ts above T",
        "session_token_mean",
        dict(num_sessions=4, session_token_sums=torch.tensor([1e9, 3, 4, 5, 6, 7]), total_tokens=15),
        r"session_token_sums .* 1e\+09, more than total_tokens \(T\) 15",
    ),
    (
        "K' above K",
        "session_mean",
        dict(num_samples=6, num_sessions=4, session_sizes=ONES, nonempty_session_sizes=ONES * 2),
        r"nonempty_session_sizes\[0\] \(K', 2\) cannot exceed session_sizes\[0\] \(K, 1\)",
    ),
    (
        "sum of 1/K above S",
        "session_mean",
        dict(num_samples=6, num_sessions=1, session_sizes=ONES * 2),
        r"session_sizes hold 3 sessions' worth .* num_sessions \(S, 1\)",
    ),
    (
        "Sp above S",
        "prompt_session_mean_any",
        dict(num_groups=1, num_sessions=4, group_sessions=ONES * 50, session_sizes=ONES * 2),
        r"group_sessions .* 50, more than num_sessions \(S\) 4",
    ),
    (
        "Sp not n",
        "prompt_session_mean",
        dict(num_groups=2, num_sessions=4, group_sessions=ONES * 3, session_sizes=ONES * 2),
        r"group_sessions\[0\] \(Sp, 3\) must equal n_samples_per_prompt \(2\)",
    ),
    (
        "P above S",
        "prompt_session_mean_any",
        dict(num_groups=5, num_sessions=4, group_sessions=ONES, session_sizes=ONES * 2),
        r"num_groups \(P, 5\) cannot exceed num_sessions \(S, 4\)",
    ),
    (
        "S not n·P",
        "prompt_session_mean",
        dict(num_groups=3, num_sessions=4, group_sessions=ONES * 2, session_sizes=ONES * 2),
        r"num_sessions \(S, 4\) must equal n_samples_per_prompt \(2\) × num_groups \(P, 3\) = 6",
    ),
]


@pytest.mark.parametrize(("case", "cfg", "kwargs", "message"), SESSION_TOTALS_REFUSED, ids=[c[0] for c in SESSION_TOTALS_REFUSED])
def test_from_totals_refuses_session_totals_that_contradict_the_others(case, cfg, kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepPlan.from_totals(SESSION_CFG[cfg], SIX, **kwargs)


def test_from_totals_takes_consistent_session_totals():
    plan = StepPlan.from_totals(SESSION_CFG["session_mean"], SIX, num_samples=6, num_sessions=3, session_sizes=ONES * 2)
    assert plan.sample_denoms.tolist() == [3 * 2 * float(c) for c in SIX]  # S · K · c(M)
