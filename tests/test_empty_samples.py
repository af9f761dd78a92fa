"""``empty_samples``: how samples with no rollout token count (docs/modes.md, "Empty samples").

Under ``skip`` every mode that reads ``N`` reads ``c(N')`` (``N'``: samples with at least one
rollout token), ``prompt_mean`` reads ``c(P')`` for ``P`` (groups with at least one rollout
token), and so does the metrics reducer. Checked here:

* against the other trainers' formulas, written below in float64 from their definitions (NeMo-RL's
  sequence-level loss, AReaL PR #1546's ``seq_mean`` / ``constant`` / ``prompt_mean``, verl's and
  OpenRLHF's fallbacks), on batches with empty samples, groups of empty samples and steps whose
  samples are all empty;
* split invariance: micro-batches, DP and CP through the harness, and a real gloo DP world whose
  ``N'`` travels in the plan's one sum all-reduce;
* what each mode that reads ``N`` (and the metrics reducer, and a registered mode) means under
  ``skip``, and that ``count`` (the default) keeps every number it had;
* ``StepPlan.from_totals`` with a trainer's ``N'`` / ``P'``, the config, its JSON Schema, the
  flag and ``lossagg check``, and the verl and Megatron adapters (TRL's: tests/test_trl_trainer.py).
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
from batches import function_mode, per_prompt, sessions_in
from worlds import report, run_world

import lossagg
from lossagg import LossAggregationConfig, StepPlan
from lossagg.cli import main as cli_main
from lossagg.integrations.megatron import make_loss_func
from lossagg.integrations.verl import agg_loss
from lossagg.testing import check_split_invariance, rank_totals, reference_loss
from lossagg.totals import EMPTY_SAMPLES

F64 = torch.float64


# ------------------------------------------------------------------ batches
def padded_batch(seed: int, bs: int = 10, width: int = 9, empty_rows=(1, 6)):
    """A padded [bs, width] float64 loss and a right-padded 0/1 mask; ``empty_rows`` have no token."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(bs, width, generator=g, dtype=F64)
    lengths = torch.randint(1, width + 1, (bs,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(F64)
    mask = mask * (torch.rand(bs, width, generator=g) < 0.8)  # some tokens dropped inside a response
    mask[:, 0] = 1.0  # every response has a token ...
    mask[list(empty_rows)] = 0.0  # ... but these
    return loss, mask


def packed_step(seed: int = 0, n_groups: int = 4, n: int = 4, max_len: int = 12):
    """A packed float64 step of ``n_groups`` groups of ``n``: sample 5 has no token at all, sample 2
    is fully masked, and the last group is made of empty samples only. (values, mask, cu, groups)"""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n_groups * n,), generator=g)
    lengths[5] = 0
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    values = torch.randn(int(cu[-1]), generator=g, dtype=F64)
    mask = torch.rand(int(cu[-1]), generator=g) < 0.75
    for i in [2, *range((n_groups - 1) * n, n_groups * n)]:
        mask[cu[i] : cu[i + 1]] = False
    for i in range(n_groups * n):  # the others keep a token
        if i not in (2, 5) and i < (n_groups - 1) * n:
            mask[cu[i]] = True
    return values, mask, cu, torch.arange(n_groups).repeat_interleave(n)


def plan_j(config, loss, mask, group_index=None) -> torch.Tensor:
    """J of a padded batch that is the whole step, through a StepPlan."""
    plan = StepPlan.from_mask(config, mask, group_index=group_index)
    return plan.loss(loss, mask, slice(None))


def skip(**settings) -> LossAggregationConfig:
    return LossAggregationConfig(empty_samples="skip", **settings)


# ------------------------------------------------- the other trainers' formulas
def nemo_rl_sequence_level(loss, token_mask, sample_mask):
    """NeMo-RL's sequence-level policy loss (nemo_rl/algorithms/loss/loss_functions.py, ClippedPGLossFn):
    ``masked_mean(masked_mean(loss, token_mask, dim=-1), sample_mask, global_normalization_factor=global_valid_seqs)``
    with ``masked_mean(v, m, f) = Σ v·m / (f + 1e-8)`` (f = Σ m when not given; nemo_rl/algorithms/utils.py) and
    ``global_valid_seqs`` the sum of ``sample_mask`` over the DP group (nemo_rl/models/megatron/data.py).
    ``sample_mask`` is NeMo-RL's per-sample flag (0 for a sample its GRPO filters out, e.g. an overlong one)."""
    per_sequence = (loss * token_mask).sum(-1) / (token_mask.sum(-1) + 1e-8)
    global_valid_seqs = sample_mask.sum()
    return (per_sequence * sample_mask).sum() / (global_valid_seqs + 1e-8)


def areal_unit_mean(numerators, denominators):
    """AReaL PR #1546 (areal/utils/functional/loss_aggregation.py, _reduce_unit_means): a unit (a response, or
    a prompt group) is active when its denominator (mask count) is > 0; J = Σ_active num/den / max(#active, 1)."""
    active = denominators > 0
    means = torch.where(active, numerators / denominators.clamp(min=1), torch.zeros_like(numerators))
    return means.sum() / active.sum().clamp(min=1)


def areal_seq_mean(loss, mask):
    """AReaL PR #1546's ``seq_mean`` (SequenceMean): the mean of per-response token means over active responses."""
    return areal_unit_mean((loss * mask).sum(-1), (mask != 0).sum(-1).to(F64))


def areal_prompt_mean(loss, mask, group_sizes):
    """AReaL PR #1546's ``prompt_mean`` (PromptMean): groups of ``group_sizes`` consecutive responses; the
    mean over active groups (with at least one loss token) of each group's token mean."""
    ids = torch.arange(len(group_sizes)).repeat_interleave(torch.tensor(group_sizes))
    num = torch.zeros(len(group_sizes), dtype=F64).index_add_(0, ids, (loss * mask).sum(-1))
    den = torch.zeros(len(group_sizes), dtype=F64).index_add_(0, ids, (mask != 0).sum(-1).to(F64))
    return areal_unit_mean(num, den)


def areal_constant(loss, mask, divisor):
    """AReaL PR #1546's ``constant`` (ConstantLength): the masked loss sum over (max(active responses, 1) × L)."""
    active = ((mask != 0).sum(-1) > 0).sum()
    return (loss * mask).sum() / (active.clamp(min=1) * divisor)


def areal_engine(reduction, micro_batches, weight):
    """AReaL's engine combines micro-batches as Σ local_mean·local_weight / Σ local_weight, the weight being
    the reduction's normalizer (its active units) of that micro-batch (PR #1546, PolicyGradientReduction)."""
    means = [reduction(*mb) for mb in micro_batches]
    weights = [weight(*mb) for mb in micro_batches]
    return sum(m * w for m, w in zip(means, weights, strict=True)) / sum(weights)


def openrlhf_sample_level(loss, mask):
    """OpenRLHF's ``aggregate_loss(token_level_loss=False)`` without a global batch size (openrlhf/models/loss.py):
    per-sequence token means ``Σ l·m / (Σ m + 1e-8)``, averaged over the sequences whose mask sums to > 0
    (``masked_mean(seq_loss, seq_mask)``; its get_loss_batch_info counts the same sequences over DP ranks)."""
    counts = mask.sum(-1)
    seq_loss = (loss * mask).sum(-1) / (counts + 1e-8)
    seq_mask = (counts > 0).to(F64)
    return (seq_loss * seq_mask).sum() / seq_mask.sum()


# -------------------------------------------------------------- NeMo-RL
def test_sample_mean_skip_is_nemo_rls_sequence_level_loss():
    loss, token_mask = padded_batch(0, empty_rows=())
    sample_mask = torch.ones(token_mask.shape[0], dtype=F64)
    sample_mask[[2, 7]] = 0.0  # filtered by NeMo-RL's GRPO: their tokens leave its loss mask
    mask = token_mask * sample_mask[:, None]  # NeMo-RL's `mask`, the loss (and rollout) mask lossagg reads
    expected = nemo_rl_sequence_level(loss, token_mask, sample_mask)
    got = plan_j(skip(mode="sample_mean"), loss, mask)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=0)
    # counting every sample (the default) gives another number on this batch
    counted = plan_j(LossAggregationConfig(mode="sample_mean"), loss, mask)
    assert abs(float(counted) - float(expected)) > 1e-3 * abs(float(expected))


def test_nemo_rls_global_valid_seqs_given_to_from_totals_on_dp_ranks():
    """Two DP ranks of two micro-batches each: each rank's plan from the trainer's global_valid_seqs."""
    loss, token_mask = padded_batch(1, bs=12, empty_rows=())
    sample_mask = (torch.arange(12) % 5 != 3).to(F64)
    mask = token_mask * sample_mask[:, None]
    global_valid_seqs = int(sample_mask.sum())
    config = skip(mode="sample_mean")
    total = torch.zeros((), dtype=F64)
    for rank_rows in torch.arange(12).tensor_split(2):
        counts = lossagg.token_counts(mask[rank_rows])
        plan = StepPlan.from_totals(config, counts, num_nonempty_samples=global_valid_seqs)
        for mb in torch.arange(rank_rows.numel()).tensor_split(2):
            total = total + plan.loss(loss[rank_rows][mb], mask[rank_rows][mb], mb)
    torch.testing.assert_close(total, nemo_rl_sequence_level(loss, token_mask, sample_mask), rtol=1e-7, atol=0)


def test_nemo_rl_counts_a_kept_sample_without_a_loss_token():
    """The difference docs/modes.md names: NeMo-RL counts a sample whose sample_mask is 1 even when its
    token mask is all 0; skip does not. With one such sample, NeMo-RL's J is skip's J × N'/(N'+1)."""
    loss, token_mask = padded_batch(2, empty_rows=(4,))
    sample_mask = torch.ones(token_mask.shape[0], dtype=F64)
    n_prime = int((token_mask.sum(-1) > 0).sum())
    got = plan_j(skip(mode="sample_mean"), loss, token_mask)
    torch.testing.assert_close(nemo_rl_sequence_level(loss, token_mask, sample_mask), got * n_prime / (n_prime + 1), rtol=1e-7, atol=0)


# ---------------------------------------------------------- AReaL #1546
GROUP_SIZES = [3, 3, 4]  # ragged prompt groups, consecutive responses


def areal_batch(seed):
    """Group 1 is all empty (rows 3-5); row 8 of group 2 is empty."""
    return padded_batch(seed, bs=sum(GROUP_SIZES), empty_rows=(3, 4, 5, 8))


def group_index():
    return torch.arange(len(GROUP_SIZES)).repeat_interleave(torch.tensor(GROUP_SIZES))


@pytest.mark.parametrize("seed", [3, 4])
def test_skip_is_areal_1546_for_its_three_sample_modes(seed):
    loss, mask = areal_batch(seed)
    torch.testing.assert_close(plan_j(skip(mode="sample_mean"), loss, mask), areal_seq_mean(loss, mask), rtol=1e-12, atol=0)
    torch.testing.assert_close(plan_j(skip(mode="constant", divisor=6.0), loss, mask), areal_constant(loss, mask, 6.0), rtol=1e-12, atol=0)
    got = plan_j(skip(mode="prompt_mean"), loss, mask, group_index())
    torch.testing.assert_close(got, areal_prompt_mean(loss, mask, GROUP_SIZES), rtol=1e-12, atol=0)
    # with every sample counted, the empty group and samples lower each number
    for mode in ("sample_mean", "prompt_mean"):
        counted = plan_j(LossAggregationConfig(mode=mode), loss, mask, group_index())
        assert abs(float(counted)) < abs(float(plan_j(skip(mode=mode), loss, mask, group_index())))


def test_areal_engines_micro_batch_combination_is_lossaggs_sum_of_contributions():
    """AReaL weighs each micro-batch's local mean by its active units; lossagg adds contributions
    over d[i] from the step's plan. Same J, micro-batches holding whole groups (as AReaL needs)."""
    loss, mask = areal_batch(5)
    bounds = [(0, 3), (3, 6), (6, 10)]  # one group each
    micro_batches = [(loss[a:b], mask[a:b]) for a, b in bounds]
    n_active = lambda lo, m: ((m != 0).sum(-1) > 0).sum().to(F64)  # noqa: E731
    expected = areal_engine(areal_seq_mean, micro_batches, n_active)
    plan = StepPlan.from_mask(skip(mode="sample_mean"), mask)
    got = sum(plan.loss(loss[a:b], mask[a:b], slice(a, b)) for a, b in bounds)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["sample_mean", "prompt_mean", "constant", "max_length", "token_mean"])
def test_a_step_of_empty_samples_gives_zero_and_zero_gradients(mode):
    """c(N') = max(N', 1), as AReaL's clamp_min(1) (NeMo-RL adds 1e-8): no 0/0, J = 0."""
    loss = torch.randn(4, 5, dtype=F64, requires_grad=True)
    mask = torch.zeros(4, 5, dtype=F64)
    config = skip(mode=mode, **lossagg.MODES[mode].example_settings)
    plan = StepPlan.from_mask(config, mask, group_index=torch.tensor([0, 0, 1, 1]))
    assert torch.isfinite(plan.sample_denoms).all() and (plan.sample_denoms > 0).all()
    j = plan.loss(loss, mask, slice(None))
    j.backward()
    assert j.item() == 0.0 and torch.equal(loss.grad, torch.zeros_like(loss))
    if mode == "sample_mean":
        assert areal_seq_mean(loss.detach(), mask).item() == 0.0 and areal_constant(loss.detach(), mask, 2.0).item() == 0.0
    cu = torch.arange(0, 21, 5)
    assert reference_loss(config, loss.detach().reshape(-1), mask.reshape(-1) != 0, cu, torch.tensor([0, 0, 1, 1])).item() == 0.0


# ------------------------------------------------------- verl and OpenRLHF
def test_skip_is_verls_fallback_and_count_its_trainer_path():
    """verl 0.9.1's agg_loss counts the sequences whose mask sums to > 0 when no global_batch_size is
    given (its fallback) and divides by global_batch_size (every sample of the mini-batch, from its
    trainer) otherwise: the first is skip's number, the second count's."""
    verl = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not importable (scripts/install_peers.sh installs it)")
    loss, mask = padded_batch(6)
    bs = mask.shape[0]
    fallback = verl.agg_loss(loss, mask, "seq-mean-token-mean")
    torch.testing.assert_close(agg_loss(loss, mask, "sample_mean", empty_samples="skip"), fallback, rtol=1e-7, atol=0)
    torch.testing.assert_close(plan_j(skip(mode="sample_mean"), loss, mask), fallback, rtol=1e-7, atol=0)
    norm = verl.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=7)
    torch.testing.assert_close(agg_loss(loss, mask, "constant", loss_scale_factor=7, empty_samples="skip"), norm, rtol=1e-12, atol=0)
    trainer_path = verl.agg_loss(loss, mask, "seq-mean-token-mean", global_batch_size=bs)
    torch.testing.assert_close(agg_loss(loss, mask, "sample_mean"), trainer_path, rtol=1e-7, atol=0)
    torch.testing.assert_close(agg_loss(loss, mask, "sample_mean", empty_samples="count"), trainer_path, rtol=1e-7, atol=0)


def test_skip_is_openrlhfs_sample_level_loss():
    loss, mask = padded_batch(7)
    torch.testing.assert_close(plan_j(skip(mode="sample_mean"), loss, mask), openrlhf_sample_level(loss, mask), rtol=1e-7, atol=0)


# ------------------------------------------------ every mode that reads N
def test_max_length_and_constant_read_c_of_n_prime():
    values, mask, cu, groups = packed_step(8)
    counts = lossagg.token_counts(mask, cu).to(F64)
    sums = torch.stack([values[cu[i] : cu[i + 1]][mask[cu[i] : cu[i + 1]]].sum() for i in range(counts.numel())])
    n_prime = int((counts > 0).sum())
    assert 0 < n_prime < counts.numel()
    expected = {"max_length": sums.sum() / (n_prime * counts.max()), "constant": sums.sum() / (n_prime * 5.0)}
    for mode, settings in (("max_length", {}), ("constant", {"divisor": 5.0})):
        j = lossagg.aggregate(skip(mode=mode, **settings), values, mask, cu_seqlens=cu)
        torch.testing.assert_close(j, expected[mode], rtol=1e-12, atol=0)
        counted = lossagg.aggregate(LossAggregationConfig(mode=mode, **settings), values, mask, cu_seqlens=cu)
        torch.testing.assert_close(counted, expected[mode] * n_prime / counts.numel(), rtol=1e-12, atol=0)


def test_token_mean_reads_no_n_and_keeps_its_number():
    values, mask, cu, _ = packed_step(9)
    same = [lossagg.aggregate(LossAggregationConfig(mode="token_mean", empty_samples=e), values, mask, cu_seqlens=cu) for e in EMPTY_SAMPLES]
    assert torch.equal(same[0], same[1])


@pytest.mark.parametrize("mode", list(lossagg.MODES))
def test_the_metrics_reducer_follows_the_setting(mode):
    """plan.metrics is the mean over samples of each sample's token mean: over the non-empty samples under skip
    (the default reducer, sample_mean; under token_mean the step's token mean, which holds no empty sample)."""
    values, mask, cu, groups = packed_step(10)
    entropy = torch.rand(values.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    counts = lossagg.token_counts(mask, cu)
    means = [entropy[cu[i] : cu[i + 1]][mask[cu[i] : cu[i + 1]]].mean() for i in range(counts.numel()) if counts[i] > 0]
    for empty, n in (("count", counts.numel()), ("skip", len(means))):
        config = LossAggregationConfig(mode=mode, empty_samples=empty, **lossagg.MODES[mode].example_settings)
        plan = StepPlan(config, counts, group_index=groups, session_index=sessions_in(groups))
        got = plan.metrics({"entropy": entropy}, mask, slice(None), cu)["entropy"]
        want = entropy[mask].mean() if mode == "token_mean" else sum(means) / n
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_a_registered_mode_that_reads_n_follows_the_setting():
    spec = function_mode(
        "sample_sq_empty",
        "N · c(M[i])²",
        lambda x: x.totals.num_samples * x.token_counts.clamp(min=1.0) ** 2,
        lambda r: sum(s / max(m, 1.0) ** 2 for s, m in zip(r.numerators, r.token_counts, strict=True)) / len(r.numerators),
    )
    lossagg.register_mode(spec)
    try:
        counts = torch.tensor([3.0, 0.0, 2.0, 0.0, 1.0])
        plan = StepPlan(skip(mode="sample_sq_empty"), counts)
        assert plan.sample_denoms.tolist() == [3 * 9.0, 3 * 1.0, 3 * 4.0, 3 * 1.0, 3 * 1.0]
        values, mask, cu, _ = packed_step(11)
        report_ = check_split_invariance(skip(mode="sample_sq_empty"), values, mask, cu, micro_batches=3, dp_size=2)
        assert report_.ok, str(report_)
    finally:
        lossagg.unregister_mode("sample_sq_empty")


# ------------------------------------------------------------ split invariance
@pytest.mark.parametrize("mode", list(lossagg.MODES))
@pytest.mark.parametrize("split", [(1, 1, 1), (3, 1, 1), (2, 2, 1), (1, 2, 2), (2, 3, 3), (4, 4, 1)])
def test_split_invariance_of_skip(mode, split):
    micro_batches, dp, cp = split
    values, mask, cu, groups = packed_step(12 + split[0])
    config = skip(mode=mode, n_samples_per_prompt=per_prompt(mode, 4), **lossagg.MODES[mode].example_settings)
    result = check_split_invariance(
        config, values, mask, cu, group_index=groups, session_index=sessions_in(groups), micro_batches=micro_batches, dp_size=dp, cp_size=cp
    )
    assert result.ok, str(result)


class _FakeGroup:
    """Stands for a process group of one rank; all_reduce is patched to record the call, and the
    plan's check of its type (lossagg.validate.check_process_group) lets it through (with_fake_group)."""


def with_fake_group(monkeypatch) -> _FakeGroup:
    monkeypatch.setattr(lossagg.step, "check_process_group", lambda group, *_: group)
    return _FakeGroup()


@pytest.mark.parametrize("mode", list(lossagg.MODES))
def test_n_prime_travels_in_the_one_sum_all_reduce(mode, monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda buf, op=None, group=None: calls.append((op, buf.numel())))
    counts = torch.tensor([3, 0, 5, 4])
    seen = {}
    for empty in EMPTY_SAMPLES:
        calls.clear()
        config = LossAggregationConfig(
            mode=mode, empty_samples=empty, n_samples_per_prompt=per_prompt(mode, 2), global_batch_size=8, **lossagg.MODES[mode].example_settings
        )
        groups = torch.tensor([0, 0, 1, 1])
        StepPlan(config, counts, group_index=groups, session_index=sessions_in(groups), process_group=with_fake_group(monkeypatch))
        seen[empty] = list(calls)
    assert [op for op, _ in seen["skip"]] == [op for op, _ in seen["count"]]  # the same collectives
    if lossagg.MODES[mode].needs_sessions:  # S', K', Sp' ride in it too (their sizes: tests/test_sessions_distributed.py counts the collectives)
        assert len(seen["skip"]) == 1 and seen["skip"][0][1] > seen["count"][0][1] + 1
        return
    labels = 8 // 2 if lossagg.MODES[mode].needs_groups else 0  # P' is one more float64 per group label
    assert seen["skip"][0][1] == seen["count"][0][1] + 1 + labels  # N' rides in the sum all-reduce


# a real DP world: every rank's plan gathers N' (and P') in its sum all-reduce
DP, MICRO_BATCHES, N_PER_PROMPT = 2, 2, 4


def dp_worker(rank, world, init_file, results_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    failures, ran = [], 0
    real_all_reduce = dist.all_reduce
    collectives = []

    def counting(buf, op=dist.ReduceOp.SUM, group=None, **kwargs):
        collectives.append((str(op), buf.numel()))
        return real_all_reduce(buf, op=op, group=group, **kwargs)

    dist.all_reduce = counting
    try:
        values, mask, cu, groups = packed_step(20)
        sessions = sessions_in(groups)
        n = groups.numel()
        counts = lossagg.token_counts(mask, cu)
        lengths = cu[1:] - cu[:-1]
        own = torch.arange(n).tensor_split(world)[rank]
        for mode, spec in lossagg.MODES.items():
            gathered = {}
            for empty in EMPTY_SAMPLES:
                config = LossAggregationConfig(
                    mode=mode, empty_samples=empty, n_samples_per_prompt=per_prompt(mode, N_PER_PROMPT), global_batch_size=n, **spec.example_settings
                )
                collectives.clear()
                plan = StepPlan(config, counts[own], group_index=groups[own], session_index=sessions[own], process_group=dist.group.WORLD)
                gathered[empty] = list(collectives)
                leaf = values.clone().requires_grad_(True)
                contribution = torch.zeros((), dtype=F64)
                metric = torch.zeros((), dtype=F64)
                for mb_local in torch.arange(own.numel()).tensor_split(MICRO_BATCHES):
                    mb = own[mb_local]
                    idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in mb.tolist()])
                    mb_cu = lossagg.cu_seqlens_from_lengths(lengths[mb], dtype=torch.int64)
                    contribution = contribution + plan.loss(leaf[idx], mask[idx], mb_local, mb_cu)
                    metric = metric + plan.metrics({"v": values[idx]}, mask[idx], mb_local, mb_cu)["v"]
                contribution.backward()
                j, grad = contribution.detach().clone(), leaf.grad.clone()
                for t in (j, grad, metric):
                    real_all_reduce(t)
                ref_leaf = values.clone().requires_grad_(True)
                ref = reference_loss(config, ref_leaf, mask, cu, groups, session_index=sessions)
                ref.backward()
                ran += 1
                if not torch.allclose(j, ref, rtol=1e-10, atol=1e-14) or not torch.allclose(grad, ref_leaf.grad, rtol=1e-10, atol=1e-14):
                    failures.append(f"rank {rank} mode {mode} {empty}: J {float(j)!r} vs {float(ref)!r}")
                kept = [i for i in range(n) if counts[i] > 0] if empty == "skip" else list(range(n))
                means = [values[cu[i] : cu[i + 1]][mask[cu[i] : cu[i + 1]]].sum() / max(int(counts[i]), 1) for i in kept]
                # the default reducer: the step's token mean under a token-level step, else the mean of the samples' means
                want_metric = values[mask].sum() / max(int(counts.sum()), 1) if mode == "token_mean" else sum(means) / len(kept)
                if not torch.allclose(metric, want_metric, rtol=1e-10, atol=1e-14):
                    failures.append(f"rank {rank} mode {mode} {empty}: metric {float(metric)!r}")
                if empty == "skip":
                    if plan.totals["num_nonempty_samples"] != int((counts > 0).sum()) or plan.totals["num_samples"] != n:
                        failures.append(f"rank {rank} mode {mode}: totals {plan.totals}")
                    if spec.needs_groups and plan.totals["num_nonempty_groups"] != 3:  # the last of 4 groups is all empty
                        failures.append(f"rank {rank} mode {mode}: P' {plan.totals['num_nonempty_groups']}")
            if [op for op, _ in gathered["skip"]] != [op for op, _ in gathered["count"]]:
                failures.append(f"rank {rank} mode {mode}: collectives {gathered}")
    except Exception as exc:
        import traceback

        failures.append(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        dist.all_reduce = real_all_reduce
    report(results_dir, rank, ran, failures)
    dist.destroy_process_group()


@pytest.mark.xdist_group("engines")  # the multi-process tests share one xdist worker (scripts/test.sh runs pytest -n 2)
def test_a_gloo_dp_world_gives_the_single_process_j_under_both_conventions(tmp_path):
    failures, runs = run_world(dp_worker, DP, (), tmp_path)
    assert not failures, "\n".join(failures)[:6000]
    assert runs == DP * len(lossagg.MODES) * len(EMPTY_SAMPLES)


# ------------------------------------------------------------ from_totals
def test_from_totals_with_a_trainers_n_prime_agrees_with_the_all_reduce():
    values, mask, cu, groups = packed_step(21)
    counts = lossagg.token_counts(mask, cu)
    own = torch.arange(8, 16)
    for mode, spec in lossagg.MODES.items():
        config = skip(mode=mode, n_samples_per_prompt=per_prompt(mode, 4), **spec.example_settings)
        whole = StepPlan(config, counts, group_index=groups, session_index=sessions_in(groups))
        totals = rank_totals(config, counts, own, groups, sessions_in(groups))
        assert totals["num_nonempty_samples"] == int((counts > 0).sum())
        rank = StepPlan.from_totals(config, counts[own], **totals)
        assert torch.equal(rank.sample_denoms, whole.sample_denoms[own]), mode


def test_from_totals_of_a_rank_whose_samples_are_all_empty():
    counts = torch.zeros(3)
    plan = StepPlan.from_totals(skip(mode="sample_mean"), counts, num_nonempty_samples=5, total_tokens=20)
    assert plan.sample_denoms.tolist() == [5.0] * 3
    plan = StepPlan.from_totals(skip(mode="sample_mean"), counts, num_nonempty_samples=0)
    assert plan.sample_denoms.tolist() == [1.0] * 3  # c(0): the step is empty, J = 0
    with pytest.raises(ValueError, match=r"num_nonempty_samples \(N', 0\) and total_tokens \(T, 20\) disagree"):
        StepPlan.from_totals(skip(mode="sample_mean"), counts, num_nonempty_samples=0, total_tokens=20)


# ------------------------------------------------------------ Megatron
def test_megatron_loss_func_with_a_skip_plan_gives_nemo_rls_number():
    """Megatron's schedule divides each returned loss by the micro-batches and its DDP averages over DP:
    the returned losses, so treated and summed, are J of the plan's config (here skip, NeMo-RL's N)."""
    loss, token_mask = padded_batch(22, bs=8, empty_rows=(0, 5))
    config = skip(mode="sample_mean")
    total = torch.zeros((), dtype=F64)
    for rank_rows in torch.arange(8).tensor_split(DP):
        plan = StepPlan.from_totals(config, lossagg.token_counts(token_mask[rank_rows]), num_nonempty_samples=6)
        for mb in torch.arange(rank_rows.numel()).tensor_split(MICRO_BATCHES):
            rows = rank_rows[mb]
            loss_func = make_loss_func(plan, mb, None, token_mask[rows], num_micro_batches=MICRO_BATCHES, dp_size=DP)
            returned, _report = loss_func(loss[rows])
            total = total + returned / MICRO_BATCHES / DP
    ones = (token_mask.sum(-1) > 0).to(F64)  # NeMo-RL's sample_mask for the same convention
    torch.testing.assert_close(total, nemo_rl_sequence_level(loss, token_mask, ones), rtol=1e-7, atol=0)
    assert plan.config.empty_samples == "skip"


# ------------------------------------------------------------ verl's refusals
def test_verl_adapter_names_what_it_cannot_do_under_skip():
    loss, mask = padded_batch(23)
    with pytest.raises(ValueError, match=r"empty_samples must be one of 'count', 'skip', got 'Skip'"):
        agg_loss(loss, mask, "sample_mean", empty_samples="Skip")
    with pytest.raises(ValueError, match=r"empty_samples must be one of 'count', 'skip', got \['skip'\]"):
        agg_loss(loss, mask, "sample_mean", empty_samples=["skip"])
    with pytest.raises(
        ValueError, match=r"empty_samples applies to lossagg's modes, got empty_samples='skip' with verl's loss_agg_mode='token-mean'"
    ):
        agg_loss(loss, mask, "token-mean", empty_samples="skip")
    with pytest.raises(ValueError, match=r"loss_agg_mode=sample_mean \(with empty_samples=skip\) needs the step total\(s\) num_nonempty_samples"):
        agg_loss(loss, mask, "sample_mean", dp_size=2, global_batch_size=20, empty_samples="skip")
    with pytest.raises(ValueError, match=r"loss_agg_mode=constant \(with empty_samples=skip\) needs the step total\(s\) num_nonempty_samples"):
        agg_loss(loss, mask, "constant", global_batch_size=20, loss_scale_factor=4, empty_samples="skip")
    # token_mean reads no N: verl's batch_num_tokens carries all it needs, under either convention
    both = [agg_loss(loss, mask, "token_mean", dp_size=2, batch_num_tokens=200, empty_samples=e) for e in EMPTY_SAMPLES]
    assert torch.equal(both[0], both[1])


# ------------------------------------------------------ config, schema, flags, check
def test_the_setting_defaults_to_count_and_takes_the_conventions():
    assert LossAggregationConfig().empty_samples == "count"
    assert tuple(EMPTY_SAMPLES) == ("count", "skip")
    for empty in EMPTY_SAMPLES:
        config = LossAggregationConfig.from_dict({"mode": "constant", "divisor": 2.0, "empty_samples": empty})
        assert config.empty_samples == empty and config.summary()["empty_samples"] == empty


@pytest.mark.parametrize("bad", ["Skip", "skipped", "", "none", None, 1, True, ["skip"], {"skip": 1}])
def test_a_bad_value_is_named_with_what_is_expected(bad):
    with pytest.raises(lossagg.ConfigError) as err:
        LossAggregationConfig.from_dict({"mode": "sample_mean", "empty_samples": bad})
    assert err.value.issues[0][0] == "empty_samples"
    assert re.search(r"'count' or 'skip', got ", err.value.issues[0][1]), err.value.issues


def test_a_bad_value_is_reported_with_the_other_errors():
    with pytest.raises(lossagg.ConfigError) as err:
        LossAggregationConfig.from_dict({"mode": "constant", "empty_samples": "skp"})
    assert {path for path, _ in err.value.issues} == {"empty_samples", "divisor"}


def test_the_json_schema_lists_the_conventions():
    prop = LossAggregationConfig.model_json_schema()["properties"]["empty_samples"]
    assert prop["enum"] == list(EMPTY_SAMPLES) and prop["default"] == "count" and "docs/modes.md" in prop["description"]


def test_the_flag():
    parser = lossagg.add_loss_aggregation_args(argparse.ArgumentParser())
    args = parser.parse_args(["--loss-aggregation", "max_length", "--loss-aggregation-empty-samples", "skip"])
    assert lossagg.config_from_args(args).empty_samples == "skip"
    assert lossagg.config_from_args(parser.parse_args([])).empty_samples == "count"
    with pytest.raises(lossagg.ConfigError, match=r"--loss-aggregation-empty-samples: Input should be 'count' or 'skip', got 'drop'"):
        lossagg.config_from_args(parser.parse_args(["--loss-aggregation-empty-samples", "drop"]))


def test_lossagg_check(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("loss_aggregation: {mode: prompt_mean, empty_samples: skip}\n")
    assert cli_main(["check", str(good)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{") :])["empty_samples"] == "skip"
    bad = tmp_path / "bad.toml"
    bad.write_text('[loss_aggregation]\nempty_samples = "drop"\n')
    assert cli_main(["check", str(bad)]) == 1
    assert "empty_samples: Input should be 'count' or 'skip', got 'drop'" in capsys.readouterr().err


def test_reference_loss_under_skip_refuses_loss_tokens_without_a_rollout_token():
    values = torch.ones(4, dtype=F64)
    cu = torch.tensor([0, 2, 4])
    rollout = torch.tensor([True, True, False, False])
    mask = torch.tensor([True, False, True, False])  # sample 1 has a loss token but no rollout token
    with pytest.raises(ValueError, match=r"empty_samples=skip: sample 1 has loss tokens \(mask\) but no rollout token"):
        reference_loss(skip(), values, mask, cu, rollout_mask=rollout)


def test_numpy_and_tensor_counts_are_taken():
    counts = torch.tensor([3, 0, 5, 4])
    for n in (np.int64(6), torch.tensor(6), 6):
        assert StepPlan.from_totals(skip(), counts, num_nonempty_samples=n).sample_denoms.tolist() == [18.0, 6.0, 30.0, 24.0]
