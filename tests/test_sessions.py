"""Sessions (docs/modes.md, "Sessions"): multi-turn trajectories, each yielding several samples,
weighted "each session once", with or without prompt groups above them.

Every session mode x both ``empty_samples`` conventions x packed and padded layouts is compared,
value and gradient, with a float64 reference written here from docs/modes.md's formulas (a loop
over sessions, not lossagg's own reference), through the one call (``lossagg.aggregate``) and
through a plan's micro-batches; the plan is also checked under splits that cut sessions apart.
The multi-process checks are tests/test_sessions_distributed.py.
"""

from __future__ import annotations

import pytest
import torch

import lossagg
from lossagg.testing import check_split_invariance, reference_loss
from lossagg.totals import mode_totals

SESSION_MODES = [name for name, spec in lossagg.MODES.items() if spec.needs_sessions]


def test_the_session_modes_are_registered():
    assert SESSION_MODES == ["session_mean", "session_token_mean", "prompt_session_mean", "prompt_session_token_mean"]
    assert [lossagg.MODES[m].needs_groups for m in SESSION_MODES] == [False, False, True, True]


def c(x):
    return max(float(x), 1.0)


def formula(mode: str, numerators, counts, sessions, groups, empty_samples: str):
    """J of a session mode from docs/modes.md, in float64: the samples of each session, the sessions
    of each group; under skip the empty samples (no rollout token) are left out first."""
    keep = [i for i in range(len(counts)) if empty_samples == "count" or counts[i] > 0]
    if not keep:
        return sum(numerators) * 0.0
    by_session: dict[int, list[int]] = {}
    for i in keep:
        by_session.setdefault(sessions[i], []).append(i)

    def sample_mean(ids):  # (1/K_s) Σ_{i∈s} Σ_t m·l / c(M[i])
        return sum(numerators[i] / c(counts[i]) for i in ids) / len(ids)

    def token_mean(ids):  # Σ_{i∈s} Σ_t m·l / c(Ts[s])
        return sum(numerators[i] for i in ids) / c(sum(counts[i] for i in ids))

    inside = sample_mean if mode in ("session_mean", "prompt_session_mean") else token_mean
    if mode.startswith("session"):
        return sum(inside(ids) for ids in by_session.values()) / len(by_session)
    by_group: dict[int, list[list[int]]] = {}
    for ids in by_session.values():
        by_group.setdefault(groups[ids[0]], []).append(ids)
    return sum(sum(inside(ids) for ids in members) / len(members) for members in by_group.values()) / len(by_group)


def make_step(seed: int = 0):
    """12 samples of 3 prompt groups; 2 sessions per group, of 1 to 3 samples; an empty sample (2) in a
    session that has others, and a session (4, sample 9) whose only sample is empty."""
    g = torch.Generator().manual_seed(seed)
    sessions = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 4, 5, 5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2])
    lengths = torch.randint(1, 10, (12,), generator=g)
    lengths[2] = 0  # an empty sample in a session that has others
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    values = torch.randn(int(cu[-1]), generator=g, dtype=torch.float64)
    mask = torch.rand(int(cu[-1]), generator=g) < 0.8
    mask[cu[9] : cu[10]] = False  # session 4: all its tokens masked
    return values, mask, cu, groups, sessions


def counts_of(mask, cu):
    return [float(mask[cu[i] : cu[i + 1]].sum()) for i in range(cu.numel() - 1)]


def padded(values, mask, cu):
    lengths = (cu[1:] - cu[:-1]).tolist()
    width = max(lengths) + 2
    v = torch.zeros(len(lengths), width, dtype=values.dtype)
    m = torch.zeros(len(lengths), width, dtype=mask.dtype)
    for i, n in enumerate(lengths):
        v[i, :n] = values[cu[i] : cu[i] + n]
        m[i, :n] = mask[cu[i] : cu[i] + n]
    return v, m


def config(mode, empty):
    per_prompt = 2 if lossagg.MODES[mode].needs_groups else None  # sessions per group
    return lossagg.LossAggregationConfig(mode=mode, empty_samples=empty, n_samples_per_prompt=per_prompt)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("empty", ["count", "skip"])
@pytest.mark.parametrize("mode", SESSION_MODES)
def test_each_session_mode_is_its_formula_with_gradients(mode, empty, layout):
    values, mask, cu, groups, sessions = make_step()
    leaf = values.clone().requires_grad_(True)
    if layout == "packed":
        j = lossagg.aggregate(config(mode, empty), leaf, mask, cu_seqlens=cu, group_index=groups, session_index=sessions)
    else:
        v, m = padded(leaf, mask, cu)
        j = lossagg.aggregate(config(mode, empty), v, m, group_index=groups, session_index=sessions)
    j.backward()
    ref_leaf = values.clone().requires_grad_(True)
    nums = [(ref_leaf[cu[i] : cu[i + 1]] * mask[cu[i] : cu[i + 1]]).sum() for i in range(cu.numel() - 1)]
    ref = formula(mode, nums, counts_of(mask, cu), sessions.tolist(), groups.tolist(), empty)
    ref.backward()
    torch.testing.assert_close(j.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-12, atol=1e-12)
    # and the library's own reference (lossagg.testing) agrees with the formula written here
    torch.testing.assert_close(
        reference_loss(config(mode, empty), values, mask, cu, groups, session_index=sessions), ref.detach(), rtol=1e-12, atol=0
    )


def test_a_wrong_session_changes_j():
    """The formula test can fail: moving one sample to another session moves J."""
    values, mask, cu, groups, sessions = make_step()
    cfg = config("session_mean", "count")
    j = lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, session_index=sessions)
    moved = sessions.clone()
    moved[3] = 0
    assert abs(float(j) - float(lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, session_index=moved))) > 1e-3


@pytest.mark.parametrize("empty", ["count", "skip"])
def test_sessions_of_one_sample_are_todays_modes(empty):
    values, mask, cu, groups, _ = make_step()
    own = torch.arange(cu.numel() - 1)  # every sample its own session

    def j(mode, **kw):
        cfg = lossagg.LossAggregationConfig(mode=mode, empty_samples=empty, **kw)
        return float(lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, **kw_index(mode, groups, own)))

    def kw_index(mode, g, s):
        spec = lossagg.MODES[mode]
        return {**({"group_index": g} if spec.needs_groups else {}), **({"session_index": s} if spec.needs_sessions else {})}

    assert j("session_mean") == pytest.approx(j("sample_mean"), rel=1e-14)
    assert j("session_token_mean") == pytest.approx(j("sample_mean"), rel=1e-14)
    if empty == "count":  # equal groups of samples: a group's sessions are its samples
        equal = torch.arange(12) // 4
        a = lossagg.aggregate(
            lossagg.LossAggregationConfig(mode="prompt_session_mean", empty_samples=empty, n_samples_per_prompt=4),
            values,
            mask,
            cu_seqlens=cu,
            group_index=equal,
            session_index=own,
        )
        assert float(a) == pytest.approx(j("sample_mean"), rel=1e-14)
    # a session that is a whole prompt group: session_token_mean is prompt_mean
    cfg = lossagg.LossAggregationConfig(mode="prompt_mean", empty_samples=empty)
    by_groups = float(lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, group_index=groups))
    cfg = lossagg.LossAggregationConfig(mode="session_token_mean", empty_samples=empty)
    assert float(lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, session_index=groups)) == pytest.approx(by_groups, rel=1e-14)


@pytest.mark.parametrize("empty", ["count", "skip"])
@pytest.mark.parametrize("mode", SESSION_MODES)
def test_splits_that_cut_sessions_apart(mode, empty):
    """Micro-batches x DP x CP that cut sessions (and groups) across micro-batches and ranks: the
    plan's composed loss and gradient equal the unsplit reference."""
    values, mask, cu, groups, sessions = make_step(seed=3)
    for micro_batches, dp, cp in ((3, 2, 1), (2, 2, 2), (5, 1, 3)):
        report = check_split_invariance(
            config(mode, empty), values, mask, cu, group_index=groups, session_index=sessions, micro_batches=micro_batches, dp_size=dp, cp_size=cp
        )
        assert report.ok, (micro_batches, dp, cp, str(report))


def test_missing_or_bad_session_index_is_named():
    values, mask, cu, groups, sessions = make_step()
    cfg = config("session_mean", "count")
    with pytest.raises(ValueError, match="session_index is required under mode=session_mean"):
        lossagg.aggregate(cfg, values, mask, cu_seqlens=cu)
    with pytest.raises(TypeError, match="session_index must hold integers"):
        lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, session_index=sessions.double())
    with pytest.raises(ValueError, match=r"session_index must be a 1-D tensor with one entry per sample \(N = 12\)"):
        lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, session_index=sessions[:5])
    # a session over two prompt groups
    cfg = lossagg.LossAggregationConfig(mode="prompt_session_token_mean")
    with pytest.raises(ValueError, match="session 0 holds samples of more than one prompt group"):
        bad = groups.clone()
        bad[1] = 2
        lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, group_index=bad, session_index=sessions)
    # n_samples_per_prompt counts sessions under prompt_session_*
    cfg = lossagg.LossAggregationConfig(mode="prompt_session_mean", n_samples_per_prompt=3)
    with pytest.raises(ValueError, match=r"n_samples_per_prompt \(3\) counts the sessions of each prompt group .* group 0 has 2 session"):
        lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, group_index=groups, session_index=sessions)
    # with a process group the labels must lie in [0, num_session_labels)
    from lossagg.samples import RankSamples
    from lossagg.totals import rank_share

    counts = torch.ones(12, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"session_index must lie in \[0, 4\)"):
        rank_share(
            ("num_sessions",), RankSamples(12, counts, session_index=sessions, num_session_labels=4), mode="session_mean", process_group=object()
        )
    with pytest.raises(ValueError, match="needs the number of session labels in the step: set global_batch_size"):
        rank_share(("num_sessions",), RankSamples(12, counts, session_index=sessions), mode="session_mean", process_group=object())


def test_config_n_samples_per_prompt_has_one_meaning():
    # under prompt_session_* a group holds any number of samples: global_batch_size need not be a multiple
    lossagg.LossAggregationConfig(mode="prompt_session_mean", n_samples_per_prompt=4, global_batch_size=18)
    with pytest.raises(ValueError, match="global_batch_size"):
        lossagg.LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=4, global_batch_size=18)
    with pytest.raises(
        ValueError, match="counts the samples of a prompt group under mode=prompt_mean and its sessions under mode=prompt_session_mean"
    ):
        lossagg.LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=4, terms={"kl": {"coefficient": 0.1, "mode": "prompt_session_mean"}})
    schema = lossagg.LossAggregationConfig.model_json_schema()
    assert set(SESSION_MODES) <= set(schema["properties"]["mode"]["enum"])


@pytest.mark.parametrize("empty", ["count", "skip"])
@pytest.mark.parametrize("mode", SESSION_MODES)
def test_from_totals_takes_the_session_totals(mode, empty):
    values, mask, cu, groups, sessions = make_step()
    cfg = config(mode, empty)
    counts = lossagg.token_counts(mask, cu)
    own = torch.tensor([1, 4, 5, 9, 11])
    totals = lossagg.testing.rank_totals(cfg, counts, own, groups, sessions)
    plan = lossagg.StepPlan.from_totals(cfg, counts[own], **totals)
    whole = lossagg.StepPlan(cfg, counts, group_index=groups, session_index=sessions)
    torch.testing.assert_close(plan.sample_denoms, whole.sample_denoms[own], rtol=0, atol=0)
    missing = dict(totals)
    read = mode_totals(lossagg.MODES[mode].totals, empty)  # what the mode reads under the convention
    name = next(k for k in read if lossagg.TOTALS[k].per_session and lossagg.TOTALS[k].per_sample)
    del missing[name]
    with pytest.raises(ValueError, match=f"needs the step total\\(s\\) {name}"):
        lossagg.StepPlan.from_totals(cfg, counts[own], **missing)
    short = {**totals, name: totals[name] * 0}
    with pytest.raises(ValueError, match=f"{name}\\[0\\]"):
        lossagg.StepPlan.from_totals(cfg, counts[own], **short)


@pytest.mark.parametrize("empty", ["count", "skip"])
@pytest.mark.parametrize("mode", SESSION_MODES)
def test_deferred_plan_with_a_filter_inside_the_loss(mode, empty):
    """The loss drops tokens (and a whole sample) as it runs: each session whole in one micro-batch,
    the step's J and gradient after close() equal the reference of the final masks."""
    values, mask, cu, groups, sessions = make_step(seed=5)
    cfg = config(mode, empty)
    final = mask & (values > -0.8)
    final[cu[5] : cu[6]] = False  # the filter empties sample 5
    micro_batches = [[0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]  # whole groups, so whole sessions
    leaf = values.clone().requires_grad_(True)
    plan = lossagg.DeferredPlan(cfg, 12, group_index=groups, session_index=sessions)
    lengths = cu[1:] - cu[:-1]
    total = 0.0
    for mb in micro_batches:
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in mb])
        total = total + plan.loss(leaf[idx], final[idx], torch.tensor(mb), lossagg.cu_seqlens_from_lengths(lengths[mb]))
    total.backward()
    step = plan.close()
    step.apply_([leaf])
    ref_leaf = values.clone().requires_grad_(True)
    ref = reference_loss(cfg, ref_leaf, final, cu, groups, session_index=sessions)
    ref.backward()
    assert step.loss == pytest.approx(float(ref.detach()), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-10, atol=1e-13)
    # the reference of the rollout masks is another number: the filter is felt
    assert abs(float(reference_loss(cfg, values, mask, cu, groups, session_index=sessions)) - float(ref.detach())) > 1e-4


def test_deferred_plan_refuses_a_session_cut_across_micro_batches():
    values, mask, cu, groups, sessions = make_step()
    plan = lossagg.DeferredPlan(config("session_token_mean", "count"), 12, session_index=sessions)
    lengths = cu[1:] - cu[:-1]
    mb = [0, 1]  # session 0 is samples 0, 1, 2
    idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in mb])
    with pytest.raises(ValueError, match="session 0 has 2 of this rank's 3 samples of it in this micro-batch"):
        plan.loss(values[idx], mask[idx], torch.tensor(mb), lossagg.cu_seqlens_from_lengths(lengths[mb]))
    # nothing was recorded: the whole session goes through
    mb = [0, 1, 2]
    idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in mb])
    plan.loss(values[idx], mask[idx], torch.tensor(mb), lossagg.cu_seqlens_from_lengths(lengths[mb]))


def test_deferred_plan_names_the_first_label_not_whole_and_forgets_a_failed_micro_batchs_labels():
    """The ledger's checks of whole labels, as tensors: a prompt group of fixed size cut short, a label whose
    samples came whole in an earlier micro-batch, the first failing label in sorted order named; a micro-batch
    whose loss fails leaves no label recorded."""
    g = torch.Generator().manual_seed(3)
    groups = torch.tensor([5, 5, 1, 1, 7, 7, 5, 5])  # group 5: samples 0, 1 and 6, 7 (two whole groups of 2 under one label)
    lengths = torch.randint(1, 6, (8,), generator=g)
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    values, mask = torch.randn(int(cu[-1]), generator=g, dtype=torch.float64), torch.ones(int(cu[-1]), dtype=torch.bool)
    cfg = lossagg.LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2)

    def run(plan, mb, short=0):
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in mb])
        return plan.loss(values[idx][short:], mask[idx], torch.tensor(mb), lossagg.cu_seqlens_from_lengths(lengths[mb]))

    plan = lossagg.DeferredPlan(cfg, 8, group_index=groups)
    with pytest.raises(ValueError, match="prompt group 1 has 1 of its 2 samples in this micro-batch: "):
        run(plan, [0, 1, 2, 4, 5])  # groups 1 (cut short) and 7 (whole): 1 is named, the first in sorted order
    run(plan, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="prompt group 5 has 2 of its 2 samples in this micro-batch and more in an earlier one"):
        run(plan, [6, 7])
    with pytest.raises(ValueError, match="values"):
        run(plan, [4, 5], short=1)  # the loss fails after the micro-batch was recorded
    run(plan, [4, 5])  # group 7 was forgotten with its samples (else: "... and more in an earlier one")


def test_lossagg_check_names_the_session_index(tmp_path, capsys):
    from lossagg.cli import main as cli_main

    path = tmp_path / "train.yaml"
    path.write_text("loss_aggregation:\n  mode: prompt_session_token_mean\n  n_samples_per_prompt: 4\n")
    assert cli_main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "each sample needs: group_index (its prompt group), session_index (its session, the trajectory it belongs to)" in out
    path.write_text(
        "loss_aggregation:\n  mode: prompt_session_mean\n  n_samples_per_prompt: 4\n  global_batch_size: 18\n"
        "  terms:\n    kl: {coefficient: 0.1, mode: prompt_mean}\n"
    )
    assert cli_main(["check", str(path)]) == 1
    assert "n_samples_per_prompt" in capsys.readouterr().err


def test_the_engine_worlds_meet_every_session_factor():
    from batches import ENGINE_SESSION_MODES, engine_modes

    factors = {f for m in SESSION_MODES for f in lossagg.MODES[m].denoms.factors if lossagg.denom_program.FACTORS[f].reads != "token_counts"}
    met = {f for m in ENGINE_SESSION_MODES for f in lossagg.MODES[m].denoms.factors}
    assert factors <= met, factors - met
    assert set(ENGINE_SESSION_MODES) <= set(engine_modes())


def test_from_totals_refuses_session_counts_that_contradict_the_others():
    counts = torch.tensor([3.0, 0.0, 2.0])
    cfg = lossagg.LossAggregationConfig(mode="session_mean")
    sizes = torch.ones(3)
    with pytest.raises(ValueError, match=r"num_sessions \(S, 5\) cannot exceed num_samples \(N, 4\)"):
        lossagg.StepPlan.from_totals(cfg, counts, num_sessions=5, session_sizes=sizes, num_samples=4)
    skip = lossagg.LossAggregationConfig(mode="session_mean", empty_samples="skip")
    with pytest.raises(ValueError, match=r"num_nonempty_sessions \(S', 3\) cannot exceed num_sessions \(S, 2\)"):
        lossagg.StepPlan.from_totals(skip, counts, num_nonempty_sessions=3, num_sessions=2, nonempty_session_sizes=sizes)
    plan = lossagg.StepPlan.from_totals(cfg, counts, num_sessions=2, session_sizes=torch.tensor([2.0, 2.0, 1.0]), num_samples=3)
    assert plan.sample_denoms.tolist() == [2 * 2 * 3.0, 2 * 2 * 1.0, 2 * 1 * 2.0]


def test_the_sessions_group_check_is_exact_for_any_labels():
    """Group labels as trainers hand them (large, sparse, negative) and sessions of many samples: the
    check that a session lies in one prompt group reads dense labels, so it is exact."""
    n = 64
    counts = torch.ones(2 * n)
    groups = torch.tensor([2**40 + 7] * n + [-(2**35)] * n)  # two prompts, labels far apart
    sessions = torch.tensor([5] * n + [9] * n)  # one session of 64 samples each
    plan = lossagg.StepPlan(
        lossagg.LossAggregationConfig(mode="prompt_session_mean", n_samples_per_prompt=1), counts, group_index=groups, session_index=sessions
    )
    assert plan.sample_denoms.tolist() == [2 * 1 * n * 1.0] * (2 * n)
    moved = groups.clone()
    moved[3] = -(2**35)  # one sample of session 5 in the other group
    with pytest.raises(ValueError, match="session 5 holds samples of more than one prompt group"):
        lossagg.StepPlan(lossagg.LossAggregationConfig(mode="prompt_session_mean"), counts, group_index=moved, session_index=sessions)
    with pytest.raises(ValueError, match=r"n_samples_per_prompt \(2\) counts the sessions .* group -34359738368 has 1 session"):
        lossagg.StepPlan(
            lossagg.LossAggregationConfig(mode="prompt_session_mean", n_samples_per_prompt=2), counts, group_index=groups, session_index=sessions
        )
