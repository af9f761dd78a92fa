"""The peers' session conventions (docs/modes.md, "Sessions") against lossagg's session modes.

Only the arithmetic of each peer is transcribed here, in float64, from the code cited on each
function (read through the public code index: both pull requests were open and not in a release
when read, so they are not installable); slime's own training step runs in
tests/test_slime_train.py.
"""

from __future__ import annotations

import pytest
import torch

import lossagg


def make_step(seed=0):
    """Rows (samples) of trajectories of 1 to 4 rows; an empty row, and a trajectory whose rows are all empty."""
    g = torch.Generator().manual_seed(seed)
    sessions = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 4, 5, 5])
    lengths = torch.randint(1, 12, (sessions.numel(),), generator=g)
    lengths[5] = 0  # an empty row in trajectory 2
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    values = torch.randn(int(cu[-1]), generator=g, dtype=torch.float64)
    mask = torch.rand(int(cu[-1]), generator=g) < 0.8
    mask[cu[10] : cu[11]] = False  # trajectory 4: its only row has no loss token
    return values, mask, cu, sessions


def rows(values, mask, cu):
    """Each row's masked token sum and its mask count."""
    n = cu.numel() - 1
    sums = torch.stack([(values[cu[i] : cu[i + 1]] * mask[cu[i] : cu[i + 1]]).sum() for i in range(n)])
    counts = torch.tensor([float(mask[cu[i] : cu[i + 1]].sum()) for i in range(n)], dtype=torch.float64)
    return sums, counts


def verl_7580(values, mask, cu, sessions, global_batch_size):
    """verl PR #7580 (verl/utils/trajectory.py at 2cb92cc038a770ca1c0111f93b74f7e3e2651225, with
    verl/trainer/ppo/core_algos.py agg_loss at 1dda039b9c63): each row's weight is 1/N, N the rows of
    its trajectory, rescaled to mean 1 over the batch's valid rows; the weight multiplies the row's
    per-token loss; seq-mean-token-mean then takes each row's token mean (mask count + 1e-8), keeps
    the rows with a mask token, sums and divides by global_batch_size."""
    sums, counts = rows(values, mask, cu)
    per_trajectory = torch.bincount(sessions).to(torch.float64)
    w = 1.0 / per_trajectory[sessions]
    w = w * w.numel() / w.sum()  # mean 1 over the valid rows (here all rows are valid)
    token_mean = (w * sums) / (counts + 1e-8)
    return token_mean[counts > 0].sum() / global_batch_size


def cosmos_episode(values, mask, cu, sessions):
    """cosmos-rl PR #758, objective_weighting="episode" (cosmos_rl/policy/trainer/objectives.py at
    6b4826a1b35c47e26287bff66b9c687407347f35 of shuangwu/cosmos-rl): a sample's loss is its masked
    mean, samples without a valid token are dropped; each episode's retained samples are averaged,
    and the episodes that retain one are averaged (max(E, 1): a window without one gives 0)."""
    sums, counts = rows(values, mask, cu)
    kept = counts > 0
    per_episode: dict[int, list[torch.Tensor]] = {}
    for i in torch.nonzero(kept).flatten().tolist():
        per_episode.setdefault(int(sessions[i]), []).append(sums[i] / counts[i])
    total = sum((sum(v) / len(v) for v in per_episode.values()), torch.zeros((), dtype=torch.float64))
    return total / max(len(per_episode), 1)


def cosmos_sample(values, mask, cu):
    """The same file's objective_weighting="sample": every retained sample once."""
    sums, counts = rows(values, mask, cu)
    kept = counts > 0
    return (sums[kept] / counts[kept]).sum() / max(int(kept.sum()), 1)


def slime_per_rollout(values, mask, cu, sessions):
    """slime 624b824's default reducer (slime/backends/megatron_utils/cp_utils.py get_sum_of_sample_mean
    with rollout_mask_sums from slime/ray/rollout.py): each training sample's token sum over its
    rollout's mask total (at least 1), summed, over the step's rollouts (its global_batch_size)."""
    sums, counts = rows(values, mask, cu)
    rollout_totals = torch.zeros(int(sessions.max()) + 1, dtype=torch.float64).index_add_(0, sessions, counts)
    return (sums / rollout_totals[sessions].clamp(min=1)).sum() / torch.unique(sessions).numel()


def lossagg_j(mode, values, mask, cu, sessions, empty="count"):
    cfg = lossagg.LossAggregationConfig(mode=mode, empty_samples=empty)
    return lossagg.aggregate(cfg, values, mask, cu_seqlens=cu, session_index=sessions)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verl_7580_per_row_weights_are_session_mean_times_b_over_g(seed):
    values, mask, cu, sessions = make_step(seed)
    b = sessions.numel()
    j = lossagg_j("session_mean", values, mask, cu, sessions)
    assert float(verl_7580(values, mask, cu, sessions, global_batch_size=b)) == pytest.approx(float(j), rel=1e-7)  # G = B
    assert float(verl_7580(values, mask, cu, sessions, global_batch_size=2 * b)) == pytest.approx(float(j) / 2, rel=1e-7)
    # and not the row mean verl takes without the weights
    assert float(lossagg_j("sample_mean", values, mask, cu, sessions)) != pytest.approx(float(j), rel=1e-3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cosmos_episode_weighting_is_session_mean_with_skip(seed):
    values, mask, cu, sessions = make_step(seed)
    assert float(cosmos_episode(values, mask, cu, sessions)) == pytest.approx(
        float(lossagg_j("session_mean", values, mask, cu, sessions, "skip")), rel=1e-12
    )
    assert float(cosmos_sample(values, mask, cu)) == pytest.approx(float(lossagg_j("sample_mean", values, mask, cu, sessions, "skip")), rel=1e-12)
    # under count the empty trajectory would count: another number
    assert float(cosmos_episode(values, mask, cu, sessions)) != pytest.approx(float(lossagg_j("session_mean", values, mask, cu, sessions)), rel=1e-6)
    # a window without a valid token: 0, and the plan says the step is empty
    nothing = torch.zeros_like(mask)
    assert float(cosmos_episode(values, nothing, cu, sessions)) == 0.0 == float(lossagg_j("session_mean", values, nothing, cu, sessions, "skip"))
    plan = lossagg.StepPlan(
        lossagg.LossAggregationConfig(mode="session_mean", empty_samples="skip"), torch.zeros(sessions.numel()), session_index=sessions
    )
    assert plan.empty


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slime_per_rollout_divisor_is_session_token_mean(seed):
    values, mask, cu, sessions = make_step(seed)
    assert float(slime_per_rollout(values, mask, cu, sessions)) == pytest.approx(
        float(lossagg_j("session_token_mean", values, mask, cu, sessions)), rel=1e-12
    )
    assert float(slime_per_rollout(values, mask, cu, sessions)) != pytest.approx(
        float(lossagg_j("session_mean", values, mask, cu, sessions)), rel=1e-3
    )
