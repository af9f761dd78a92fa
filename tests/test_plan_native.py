"""The native route of a one-process plan (csrc/cpu/plan_totals.cpp, lossagg/step.py's _native_route) gives the
Python route's plan (lossagg/totals.py) bit for bit: the same totals, in the same order, of the same types, and the
same d[i], for every mode, both empty_samples conventions, a second term, any labels (dense, sparse, negative,
spanning more than the direct-address table, in runs or not, a label in several runs); where the native pass declines a step the Python route raises
its error or serves it, exactly as without the native route."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import lossagg
from lossagg import step as step_module

GROUP, SESSION = 4, 2


def python_route(monkeypatch):
    """A context in which StepPlan takes the Python route only."""
    monkeypatch.setattr(step_module, "_native_route", lambda *args: None)


def config_for(mode: str, empty: str, term: bool) -> lossagg.LossAggregationConfig:
    spec = lossagg.MODES[mode]
    n = GROUP // SESSION if (spec.needs_groups and spec.needs_sessions) else GROUP
    settings = {"mode": mode, "n_samples_per_prompt": n, "empty_samples": empty}
    if spec.needs_divisor:
        settings["divisor"] = 16.0
    if term:
        settings["terms"] = {"kl": {"coefficient": 0.1, "mode": "token_mean"}}
    return lossagg.LossAggregationConfig(**settings)


def step_of(n_groups: int, seed: int, labels: str, dtype, shuffled: bool = True):
    g = torch.Generator().manual_seed(seed)
    n = n_groups * GROUP
    counts = torch.randint(0, 50, (n,), generator=g)
    counts[torch.rand(n, generator=g) < 0.2] = 0
    group = torch.arange(n) // GROUP
    session = torch.arange(n) // SESSION
    if labels == "sparse":  # labels far apart: the hash map
        group, session = group * 1_000_003 - 7, session * 999_983 + 2**40
    elif labels == "negative":
        group, session = -group - 5, -session
    elif labels == "groups_relabelled":  # sessions rising run by run, the groups' labels in any order
        group = torch.randperm(n_groups, generator=g)[group]
    if not shuffled:  # each group's and session's samples side by side, as trainers give them: runs of one label
        return counts.to(dtype), group, session
    perm = torch.randperm(n, generator=g)  # samples in any order
    return counts[perm].to(dtype), group[perm], session[perm]


def plan(config, counts, group, session, every_label=False):
    """The plan of the step, given the labels its terms read (``every_label``: both, read or not, as a trainer
    that passes whatever it has, and lossagg.aggregate, do)."""
    spec_terms = config.loss_terms
    kwargs = {}
    if every_label or any(t.spec.needs_groups for t in spec_terms):
        kwargs["group_index"] = group
    if every_label or any(t.spec.needs_sessions for t in spec_terms):
        kwargs["session_index"] = session
    return lossagg.StepPlan(config, counts, **kwargs)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("mode", list(lossagg.MODES))
def test_the_native_route_gives_the_python_routes_plan(mode, monkeypatch):
    for empty in ("count", "skip"):
        for term in (False, True):
            for seed, labels, dtype, groups, shuffled in (
                (0, "dense", torch.int64, 3, True),
                (1, "sparse", torch.float64, 5, True),
                (2, "negative", torch.int64, 1, True),
                (3, "dense", torch.int64, 9, False),
                (4, "sparse", torch.float64, 6, False),
                (5, "negative", torch.int64, 4, False),
                (6, "groups_relabelled", torch.int64, 5, False),
            ):
                config = config_for(mode, empty, term)
                counts, group, session = step_of(groups, seed, labels, dtype, shuffled)
                every_label = seed % 2 == 1  # half the steps with labels the mode may not read
                fast = plan(config, counts, group, session, every_label)
                with monkeypatch.context() as m:
                    python_route(m)
                    slow = plan(config, counts, group, session, every_label)
                what = f"{mode} {empty} term={term} {labels} {dtype} every_label={every_label}"
                assert list(fast.totals) == list(slow.totals), what
                for name in slow.totals:
                    assert same(fast.totals[name], slow.totals[name]), f"{what}: {name} {fast.totals[name]!r} != {slow.totals[name]!r}"
                for name in slow.term_denoms:
                    assert same(fast.term_denoms[name], slow.term_denoms[name]), f"{what}: d of {name}"
                assert same(fast.token_counts, slow.token_counts) and fast.device == slow.device
                for name in ("group_index", "session_index"):
                    assert same(getattr(fast.samples, name), getattr(slow.samples, name)), f"{what}: {name} held"


def test_the_native_route_is_taken(monkeypatch):
    """Not a vacuous comparison: a plain one-process plan comes from the native pass."""
    calls = []
    real = step_module.native_plan_totals
    monkeypatch.setattr(step_module, "native_plan_totals", lambda *a: calls.append(1) or real(*a))
    lossagg.StepPlan(
        config_for("prompt_session_token_mean", "count", True),
        *step_of(2, 0, "dense", torch.int64)[:1],
        group_index=torch.arange(8) // 4,
        session_index=torch.arange(8) // 2,
    )
    assert calls == [1]
    # labels the mode does not read (lossagg.aggregate passes whatever the trainer gave): still the native pass
    unread = {"group_index": torch.arange(4) // 2, "session_index": torch.arange(4)}
    lossagg.StepPlan(config_for("sample_mean", "count", False), torch.tensor([3, 0, 5, 2]), **unread)
    assert calls == [1, 1]


BAD = {
    "a negative count": (torch.tensor([3, -1, 2, 2]), None, None, "sample_mean", "token_counts must be >= 0"),
    "a group of the wrong size": (torch.tensor([3, 1, 2, 2]), torch.tensor([0, 0, 0, 1]), None, "prompt_mean", "group 0 has 3 sample(s)"),
    "a session in two groups": (
        torch.tensor([3, 1, 2, 2, 1, 1, 1, 1]),
        torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        torch.tensor([0, 0, 1, 2, 2, 3, 3, 4]),
        "prompt_session_mean",
        "holds samples of more than one prompt group",
    ),
    "a session of two runs in two groups": (
        torch.tensor([3, 1, 2, 2, 1, 1, 1, 1]),
        torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        torch.tensor([0, 0, 1, 1, 2, 2, 0, 0]),
        "prompt_session_mean",
        "holds samples of more than one prompt group",
    ),
    "a group with the wrong number of sessions": (
        torch.tensor([3, 1, 2, 2, 1, 1, 1, 1]),
        torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        torch.tensor([0, 0, 0, 1, 2, 2, 3, 4]),
        "prompt_session_mean",
        "has 3 session(s)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_step_the_native_pass_declines_is_the_python_routes(case, monkeypatch):
    counts, group, session, mode, needle = BAD[case]
    config = config_for(mode, "count", False)
    kwargs = {k: v for k, v in (("group_index", group), ("session_index", session)) if v is not None}
    with pytest.raises(ValueError) as fast:
        lossagg.StepPlan(config, counts, **kwargs)
    with monkeypatch.context() as m:
        python_route(m)
        with pytest.raises(ValueError) as slow:
            lossagg.StepPlan(config, counts, **kwargs)
    assert str(fast.value) == str(slow.value) and needle in str(fast.value)


@pytest.mark.parametrize(
    "session",
    [[0, 0, 1, 2, 2, 3, 3, 4], [0, 0, 1, 1, 2, 2, 0, 0]],
    ids=["a session run across two groups", "a session of two runs in two groups"],
)
def test_a_session_in_two_groups_is_refused_without_a_group_size(session, monkeypatch):
    """Without n_samples_per_prompt no group's count of sessions is checked: the session check alone refuses it."""
    config = lossagg.LossAggregationConfig(mode="prompt_session_mean")
    kwargs = {"group_index": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), "session_index": torch.tensor(session)}
    counts = torch.tensor([3, 1, 2, 2, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="holds samples of more than one prompt group") as fast:
        lossagg.StepPlan(config, counts, **kwargs)
    with monkeypatch.context() as m:
        python_route(m)
        with pytest.raises(ValueError) as slow:
            lossagg.StepPlan(config, counts, **kwargs)
    assert str(fast.value) == str(slow.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_a_total_beyond_2_53_is_the_python_routes(dtype, monkeypatch):
    """The native pass adds the counts in lanes, exact only while the total stays below 2**53: beyond, it declines
    the step and the plan is the Python route's."""
    counts = torch.tensor([2**52 - 1, 2**52 - 3, 2**51 + 1, 5, 0, 2**50 + 7], dtype=dtype)
    calls = []
    real = step_module.native_plan_totals
    monkeypatch.setattr(step_module, "native_plan_totals", lambda *a: calls.append(real(*a)[0][0].item()) or real(*a))
    config = config_for("token_mean", "count", False)
    fast = lossagg.StepPlan(config, counts)
    assert calls == [8.0]  # declined: the total is not exact in any order
    with monkeypatch.context() as m:
        python_route(m)
        slow = lossagg.StepPlan(config, counts)
    assert same(fast.totals["total_tokens"], slow.totals["total_tokens"]) and same(fast.sample_denoms, slow.sample_denoms)
    below = torch.div(counts, 4, rounding_mode="floor")  # total < 2**53: served
    calls.clear()
    lossagg.StepPlan(config, below)
    assert calls and calls[0] in (0.0, 7.0)


def test_fractional_counts_are_served_by_the_python_route(monkeypatch):
    counts = torch.tensor([1.5, 0.0, 2.25, 3.0], dtype=torch.float64)
    fast = lossagg.StepPlan(config_for("token_mean", "count", False), counts)
    with monkeypatch.context() as m:
        python_route(m)
        slow = lossagg.StepPlan(config_for("token_mean", "count", False), counts)
    assert torch.equal(fast.sample_denoms, slow.sample_denoms) and fast.totals["total_tokens"] == 6.75


@pytest.mark.parametrize("divisor", [1e39, 1e-40, 1e308])
def test_denominators_beyond_float32_or_float64_as_the_python_route(divisor, monkeypatch):
    """d beyond float32 keeps a float64 table (the op then refuses it by value); beyond float64 the plan is refused naming it."""
    config = lossagg.LossAggregationConfig(mode="constant", divisor=divisor)
    counts = torch.tensor([3, 0, 5, 2])
    outcome = []
    for route in ("native", "python"):
        with monkeypatch.context() as m:
            if route == "python":
                python_route(m)
            try:
                p = lossagg.StepPlan(config, counts)
                outcome.append((p.sample_denoms, p._kernel_tables[torch.float32][0].dtype))
            except ValueError as exc:
                outcome.append(str(exc))
    if isinstance(outcome[0], str):
        assert outcome[0] == outcome[1] and "overflows float64" in outcome[0]
    else:
        assert torch.equal(outcome[0][0], outcome[1][0]) and outcome[0][1] == outcome[1][1] == torch.float64


def test_what_the_native_route_leaves_to_python(monkeypatch):
    """Weights, label bounds, int32 labels and a registered mode whose d[i] is a function take the Python route."""
    calls = []
    real = step_module.native_plan_totals
    monkeypatch.setattr(step_module, "native_plan_totals", lambda *a: calls.append(1) or real(*a))
    counts = torch.tensor([3, 0, 5, 2])
    weighted = lossagg.LossAggregationConfig(mode="sample_mean", weighting="mean")
    lossagg.StepPlan(weighted, counts, sample_weights=torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.float64))
    grouped = config_for("prompt_mean", "count", False)
    lossagg.StepPlan(grouped, counts, group_index=torch.tensor([0, 0, 0, 0], dtype=torch.int32))
    lossagg.StepPlan(grouped, counts, group_index=torch.tensor([0, 0, 0, 0]), num_group_labels=1)
    assert calls == []
    lossagg.StepPlan(grouped, counts, group_index=torch.tensor([0, 0, 0, 0]))
    assert calls == [1]


def closed_step(config, counts, group, session, before_close=None):
    """A one-process DeferredPlan over the step's samples in two micro-batches, closed: its DeferredStep
    (``before_close`` called first with the plan)."""
    n = counts.numel()
    labels = {}
    if any(t.spec.needs_groups for t in config.loss_terms):
        labels["group_index"] = group
    if any(t.spec.needs_sessions for t in config.loss_terms):
        labels["session_index"] = session
    deferred = lossagg.DeferredPlan(config, n, **labels)
    g = torch.Generator().manual_seed(n)
    for part in (slice(0, n // 2), slice(n // 2, n)):
        m = counts[part].long().clamp(min=1)  # every sample one segment, at least one token
        cu = torch.zeros(m.numel() + 1, dtype=torch.int64)
        torch.cumsum(m, 0, out=cu[1:])
        mask = torch.arange(int(cu[-1])) < 0  # then the sample's own count of kept tokens, from its start
        for i, c in enumerate(counts[part].long().tolist()):
            mask[int(cu[i]) : int(cu[i]) + c] = True
        values = torch.randn(mask.numel(), generator=g, dtype=torch.float64)
        terms = {t.name: values * (k + 1) for k, t in enumerate(config.loss_terms)}
        deferred.loss(terms if len(terms) > 1 else values, deferred.micro_batch(part, mask, cu))
    if before_close is not None:
        before_close(deferred)
    return deferred.close()


@pytest.mark.parametrize("mode", list(lossagg.MODES))
def test_a_deferred_plan_closes_through_the_native_route_as_through_pythons(mode, monkeypatch):
    """Without a process group a DeferredPlan's close takes the native route (its logged sums ride beside it): the
    same scale, loss, terms and plan as the Python route's, bit for bit."""
    calls = []
    real = step_module.native_plan_totals
    monkeypatch.setattr(step_module, "native_plan_totals", lambda *a: calls.append(1) or real(*a))
    for empty, term in (("count", False), ("skip", True)):
        config = config_for(mode, empty, False)
        if term:  # a DeferredPlan's terms divide by the PG term's step-level factors: a second term of its mode
            divisor = {"divisor": config.divisor} if lossagg.MODES[mode].needs_divisor else {}
            config = lossagg.LossAggregationConfig(
                **{**config.model_dump(exclude_unset=True), "terms": {"kl": {"coefficient": 0.1, "mode": mode, **divisor}}}
            )
        counts, group, session = step_of(4, 5, "dense", torch.int64, shuffled=False)  # halves of whole groups
        calls.clear()
        monkeypatch.setattr(step_module, "LAYOUT_FROM", 0)  # a layout made for these few samples too
        laid = []
        with monkeypatch.context() as m:  # the close reads the labels' layout the plan made, where the mode reads sessions
            m.setattr(step_module, "native_plan_totals", lambda *a, laid=laid: laid.append(a[10] is not None) or calls.append(1) or real(*a))
            fast = closed_step(config, counts, group, session)
        labelled = any(t.spec.needs_sessions for t in config.loss_terms)
        assert len(calls) == 1 and laid == [labelled], f"{mode}: the close did not take the native route, in one call, with the layout"
        with monkeypatch.context() as m:
            python_route(m)
            slow = closed_step(config, counts, group, session)
        what = f"{mode} {empty} term={term}"
        for field in ("scale", "metric_scale", "loss", "terms", "metrics"):
            assert same(getattr(fast, field), getattr(slow, field)), f"{what}: {field}"
        assert list(fast.plan.totals) == list(slow.plan.totals), what
        # the per-sample totals (a session's size for each sample, ...) are made by the pass again when first read
        per_sample = any(isinstance(step_module._NATIVE_TOTALS[name], tuple) for name in slow.plan.totals)
        for name in slow.plan.totals:
            assert same(fast.plan.totals[name], slow.plan.totals[name]), f"{what}: {name}"
        assert len(calls) == 1 + per_sample, what
        assert repr(fast.plan.totals) == repr(slow.plan.totals), what
        if per_sample:  # pickled and copied with every value made, as a plan built whole is
            before = len(calls)
            pickled = pickle.loads(pickle.dumps(closed_step(config, counts, group, session).plan.totals))
            assert len(calls) == before + 2, f"{what}: a second close and the pickle's read"
            del calls[before:]
            for kept in (pickled, copy.deepcopy(fast.plan.totals)):
                assert list(kept) == list(slow.plan.totals) and all(same(kept[k], slow.plan.totals[k]) for k in kept), what
        for name in slow.plan.term_denoms:
            assert same(fast.plan.term_denoms[name], slow.plan.term_denoms[name]), f"{what}: d of {name}"
        assert len(calls) == 2 + per_sample, f"{what}: the plan's d is made once, when first read"
        for dtype, (table, weights) in slow.plan._kernel_tables.items():
            assert same(fast.plan._kernel_tables[dtype][0], table) and fast.plan._kernel_tables[dtype][1] is weights is None, what
        assert same(fast.plan.sample_denoms, slow.plan.sample_denoms) and len(calls) == 2 + per_sample, what


@pytest.mark.parametrize("divisor", [1e39, 1e308])
@pytest.mark.parametrize("declined", [False, True])
def test_a_closed_plans_d_is_made_when_read_as_a_build_makes_it(divisor, declined, monkeypatch):
    """A one-process close gathers the totals only (the op given no term); the plan's d, first read after, is what
    a StepPlan of the final counts holds, or the same error: by the native pass, or by the Python route where the
    native pass declines the step."""
    config = lossagg.LossAggregationConfig(mode="constant", divisor=divisor)
    counts = torch.tensor([3, 0, 5, 2])
    programs = []
    real = step_module.native_plan_totals
    monkeypatch.setattr(step_module, "native_plan_totals", lambda *a: programs.append(a[8]) or real(*a))
    closed = closed_step(config, counts, None, None)
    assert programs == [[]]
    if declined:
        python_route(monkeypatch)
    try:
        built = lossagg.StepPlan(config, counts.double())
    except ValueError as exc:
        with pytest.raises(ValueError, match="overflows float64") as raised:
            closed.plan.sample_denoms  # noqa: B018 (the read makes d)
        assert str(raised.value) == str(exc)
        return
    assert torch.equal(closed.plan.sample_denoms, built.sample_denoms)
    assert closed.plan._kernel_tables[torch.float32][0].dtype == built._kernel_tables[torch.float32][0].dtype == torch.float64
    with pytest.raises(AttributeError, match="no attribute 'denoms'"):
        closed.plan.denoms  # noqa: B018


LAYOUT_ARGS = [  # (per_prompt, check_groups, sessions_in_groups), as the modes pass them
    (-1, False, False),
    (GROUP, True, False),
    (GROUP // SESSION, False, True),
    (3, True, True),  # groups of another size than per_prompt: declined, by the layout's status as by the pass
]


@pytest.mark.parametrize("labels", ["dense", "sparse", "negative", "groups_relabelled"])
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("given", ["both", "groups", "sessions"])
def test_a_layout_gives_the_passes_own_totals(labels, shuffled, given):
    """plan_totals given the layout plan_layout made of its labels (a closing DeferredPlan's) returns what it returns
    without one, bit for bit: every block and d, the status where it declines; read for the counts alone (no block,
    no d, P' and S' not read), the same scalars, P' and S' -1."""
    ops = torch.ops.lossagg
    # every block, and a d reading each (codes: lossagg/step.py's _factor_codes): P · Sp[g(i)] · K[s(i)] · c(M[i])
    program = [4, 5, 0, 0, 0, 13, 0, 0, 0, 10, 0, 0, 0, -2, 0, 1, 0]
    for seed in range(3):
        counts, group, session = step_of(5, seed, labels, torch.int64, shuffled=shuffled)
        g = group if given != "sessions" else None
        s = session if given != "groups" else None
        for per_prompt, check_groups, in_groups in LAYOUT_ARGS:
            in_groups = in_groups and given == "both"
            for nonempty in (False, True):
                laid = ops.plan_layout(g, s, per_prompt, check_groups, in_groups, nonempty)
                what = f"{labels} shuffled={shuffled} {given} {per_prompt, check_groups, in_groups} nonempty={nonempty} seed={seed}"
                for blocks, prog, divisors in (([0, 1, 2, 3, 4, 5], program, [0.0]), ([], [], [])):
                    for c in (counts, counts.double()):
                        args = (c, g, s, per_prompt, check_groups, in_groups, blocks, c.dtype is torch.int64, prog, divisors)
                        want, got = ops.plan_totals(*args), ops.plan_totals(*args, laid)
                        assert len(got) == len(want), what
                        lean = not blocks and not nonempty
                        if lean and want[0][0] in (0, 7):  # served: P' and S' not made from the counts
                            assert got[0][6] == got[0][8] == -1, what
                            got[0][6], got[0][8] = want[0][6], want[0][8]
                        for a, b in zip(want, got, strict=True):
                            assert a.dtype == b.dtype and a.shape == b.shape, what
                        assert want[0][0] == got[0][0], f"{what}: status {want[0][0]} {got[0][0]}"
                        if want[0][0] in (0, 7):  # served (else nothing but the status is read)
                            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"{what}: {want[0]} {got[0]}"
        declined = ops.plan_totals(counts, group, session, 3, True, True, [], True, [], [], ops.plan_layout(group, session, 3, True, True, False))
        assert declined[0][0] == 2, "groups of 4 samples with per_prompt 3: declined by the layout's status"
    # a session whose samples lie in two groups (its run crosses a group boundary; in two runs once shuffled)
    counts, group, session = step_of(5, 0, "dense", torch.int64, shuffled=False)
    crossing = (torch.arange(counts.numel()) + 1) // SESSION
    for perm in (torch.arange(counts.numel()), torch.randperm(counts.numel(), generator=torch.Generator().manual_seed(0))):
        c, g, s = counts[perm], group[perm], crossing[perm]
        laid = ops.plan_layout(g, s, GROUP // SESSION, False, True, False)
        for blocks, prog, divisors in (([4, 5], program, [0.0]), ([], [], [])):
            args = (c, g, s, GROUP // SESSION, False, True, blocks, True, prog, divisors)
            assert ops.plan_totals(*args)[0][0] == ops.plan_totals(*args, laid)[0][0] == 3, "a session in two groups: declined"


def test_a_layout_not_made_of_these_labels_and_arguments_is_refused():
    """A layout that does not fit the call (another step's size, other label sets or arguments, a table cut short or
    out of range) is refused naming it, never read past its end."""
    ops = lossagg.ops  # the wrappers: the op's errors as Python's
    counts, group, session = step_of(4, 0, "dense", torch.int64, shuffled=False)
    laid = ops.plan_layout(group, session, 2, False, True, False)
    every = ([0, 1, 2, 3, 4, 5], [4, 5, 0, 0, 0, 13, 0, 0, 0, 10, 0, 0, 0, -2, 0, 1, 0], [0.0])
    ok = ops.plan_totals(counts, group, session, 2, False, True, *every[:1], True, *every[1:], laid)
    assert ok[0][0] == 0

    def broken(at: int, value: int) -> torch.Tensor:
        t = laid.clone()
        t[at] = value
        return t

    head = 13
    bad = {
        "another step's size": (counts[:-2], group[:-2], session[:-2], laid),
        "other arguments": (counts, group, session, laid),  # called below with per_prompt 4
        "groups not given": (counts, None, session, laid),
        "cut short": (counts, group, session, laid[:-1]),
        "a run's start out of range": (counts, group, session, broken(head + 1, 10**6)),
        "runs not rising": (counts, group, session, broken(head + 2, 0)),
        "more runs than samples": (counts, group, session, broken(1, 10**6)),
        "a group's first session out of range": (counts, group, session, broken(-1, 10**6)),
        "int32": (counts, group, session, laid.int()),
        "a status unknown": (counts, group, session, broken(12, 99)),
    }
    tables = ("a run's start out of range", "runs not rising", "a group's first session out of range")
    for what, (c, g, s, layout) in bad.items():
        per_prompt = 4 if what == "other arguments" else 2
        for blocks, program, divisors in (every, ([], [], [])):
            if what in tables and not blocks:  # a call for the counts alone reads the layout's head only
                assert torch.equal(ops.plan_totals(c, g, s, per_prompt, False, True, [], True, [], [], layout)[0][:6], ok[0][:6]), what
                continue
            with pytest.raises(ValueError, match="layout must be the one lossagg.plan_layout made") as raised:
                ops.plan_totals(c, g, s, per_prompt, False, g is not None, blocks, True, program, divisors, layout)
            assert "lossagg.plan_totals" in str(raised.value), what
    with pytest.raises(ValueError, match="group_index or session_index must be given, got neither"):
        ops.plan_layout(None, None, 2, False, True, False)
    with pytest.raises(ValueError, match="contiguous int64 \\[N\\] tensor"):
        ops.plan_layout(group, session[:-1], 2, False, True, False)


def test_labels_written_after_the_layout_are_read_again(monkeypatch):
    """A DeferredPlan whose labels are written in place after it made their layout closes without it, from the
    labels as they are then (the layout is read only while the labels are the tensors it was made of, unwritten
    since); a plan of fewer samples than LAYOUT_FROM makes none."""
    config = config_for("prompt_session_mean", "count", False)
    counts, group, session = step_of(4, 1, "dense", torch.int64, shuffled=False)
    assert lossagg.DeferredPlan(config, counts.numel(), group_index=group, session_index=session)._layout is None, "too few to pay"
    monkeypatch.setattr(step_module, "LAYOUT_FROM", counts.numel())
    real = step_module.native_plan_totals
    laid = []
    monkeypatch.setattr(step_module, "native_plan_totals", lambda *a: laid.append(a[10] is not None) or real(*a))
    made = []
    fast = closed_step(config, counts, group, session, made.append)
    assert laid == [True] and made[0]._layout.reads(group, session)

    def write(deferred):  # the same labels, written in place: the layout is not read
        deferred.session_index.add_(0)
        assert not deferred._layout.reads(deferred.group_index, deferred.session_index)

    laid.clear()
    written = closed_step(config, counts, group.clone(), session.clone(), write)
    assert laid == [False]
    with monkeypatch.context() as m:
        python_route(m)
        slow = closed_step(config, counts, group, session)
    for step in (fast, written):
        assert step.scale == slow.scale and step.loss == slow.loss and list(step.plan.totals) == list(slow.plan.totals)
        assert all(same(step.plan.totals[k], slow.plan.totals[k]) for k in slow.plan.totals)
