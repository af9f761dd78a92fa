"""StepPlan.token_weights side by side with SkyRL 0.4.0, which folds the loss reduction into the
advantages of each mini-batch (``apply_loss_reduction_to_advantages_minibatch`` in
``skyrl/backends/skyrl_train/utils/ppo_utils.py``) and sums the masked per-token loss:

* the same scaled advantages as SkyRL's function for each of its split-invariant reductions
  (``token_mean``, ``sequence_mean``, ``seq_mean_token_sum_norm`` with its ``max_seq_len``,
  ``prompt_mean``), computed per micro-batch and packed too, to float64 rounding;
* SkyRL's own PPO loss (``ppo_policy_loss``, regular and dual clip) on advantages scaled by
  lossagg's weights, summed over micro-batches, is the plan's J of the unscaled loss;
* ``token_mean_legacy``, which lossagg refuses, changes with SkyRL's micro-batch size.

Skipped, with the reason, when SkyRL is not importable (scripts/install_peers.sh installs it;
tests/skyrl_peer.py imports its module).
"""

from __future__ import annotations

import pytest
import torch

import lossagg
from lossagg import LossAggregationConfig, StepPlan

pytest.importorskip("skyrl", reason="SkyRL is not importable (scripts/install_peers.sh installs it)")

import skyrl_peer  # noqa: E402

B, T, N_PER_PROMPT, MAX_SEQ_LEN = 8, 10, 2, 16  # one mini-batch: 4 prompts × 2 responses, padded to 10
MICRO = 2  # SkyRL's micro_train_batch_size_per_gpu
# SkyRL's loss_reduction -> the config settings lossagg needs for the same numbers
REDUCTIONS = {
    "token_mean": {},
    "sequence_mean": {},
    "seq_mean_token_sum_norm": {"divisor": MAX_SEQ_LEN},  # SkyRL's max_seq_len is the constant divisor
    "prompt_mean": {"n_samples_per_prompt": N_PER_PROMPT},
}


def ppo_utils():
    try:
        return skyrl_peer.ppo_utils()
    except ImportError as exc:
        pytest.skip(f"SkyRL's {skyrl_peer.PPO_UTILS} is not importable ({type(exc).__name__}: {exc}); scripts/install_peers.sh installs its needs")


def mini_batch(seed=0):
    """SkyRL's inputs: float64 advantages [B, T], a right-padded 0/1 loss mask (response 2 empty),
    the prompt of each response and SkyRL's prompt boundaries."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0
    loss_mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64) * loss_mask
    group_index = torch.arange(B // N_PER_PROMPT).repeat_interleave(N_PER_PROMPT)
    boundaries = [(p, p + N_PER_PROMPT) for p in range(0, B, N_PER_PROMPT)]
    return advantages, loss_mask, lengths, group_index, boundaries


def skyrl_scaled(advantages, loss_mask, reduction, boundaries, micro_batch_size=MICRO):
    return ppo_utils().apply_loss_reduction_to_advantages_minibatch(
        advantages=advantages,
        loss_mask=loss_mask,
        loss_reduction=reduction,
        micro_batch_size=micro_batch_size,
        max_seq_len=MAX_SEQ_LEN,
        prompt_boundaries=boundaries if reduction == "prompt_mean" else None,
    )


def plan_of(reduction, loss_mask, group_index):
    config = LossAggregationConfig.from_dict({"mode": reduction, **REDUCTIONS[reduction]})
    return StepPlan.from_mask(config, loss_mask, group_index=group_index)


ROUNDING = dict(rtol=1e-15, atol=0.0)  # a*(1/d) against a/d: a few float64 roundings


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_same_scaled_advantages_as_skyrl(reduction):
    advantages, loss_mask, lengths, group_index, boundaries = mini_batch()
    theirs = skyrl_scaled(advantages, loss_mask, reduction, boundaries)
    plan = plan_of(reduction, loss_mask, group_index)
    whole = advantages * plan.token_weights(loss_mask, slice(None), convention="sum", dtype=torch.float64)
    torch.testing.assert_close(whole, theirs, **ROUNDING)
    # SkyRL scales the mini-batch, then its workers cut it into micro-batches; the plan gives each its part
    for start in range(0, B, MICRO):
        rows = slice(start, start + MICRO)
        part = advantages[rows] * plan.token_weights(loss_mask[rows], rows, convention="sum", dtype=torch.float64)
        torch.testing.assert_close(part, theirs[rows], **ROUNDING)
    # packed: each response's tokens, one after the other
    cu = lossagg.cu_seqlens_from_lengths(lengths)
    packed_mask = torch.cat([loss_mask[i, :n] for i, n in enumerate(lengths.tolist())])
    packed = torch.cat([advantages[i, :n] for i, n in enumerate(lengths.tolist())])
    packed_theirs = torch.cat([theirs[i, :n] for i, n in enumerate(lengths.tolist())])
    weights = plan.token_weights(packed_mask, slice(None), cu, convention="sum", dtype=torch.float64)
    torch.testing.assert_close(packed * weights, packed_theirs, **ROUNDING)


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
@pytest.mark.parametrize("policy_loss_type", ["regular", "dual_clip"])
def test_skyrls_ppo_loss_on_scaled_advantages_is_the_plans_j(reduction, policy_loss_type):
    from skyrl.train.config import AlgorithmConfig

    advantages, loss_mask, lengths, group_index, boundaries = mini_batch(seed=1)
    g = torch.Generator().manual_seed(2)
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp = old + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some ratios past the clip range
    algorithm = AlgorithmConfig(policy_loss_type=policy_loss_type, loss_reduction=reduction, max_seq_len=MAX_SEQ_LEN)
    plan = plan_of(reduction, loss_mask, group_index)

    # SkyRL's route: the worker's masked sum of its PPO loss on the scaled advantages, per micro-batch
    by_advantages = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, B, MICRO):
        rows = slice(start, start + MICRO)
        scaled = advantages[rows] * plan.token_weights(loss_mask[rows], rows, convention="sum", dtype=torch.float64)
        loss, _ = ppo_utils().ppo_policy_loss(by_advantages[rows], old[rows], scaled, algorithm, loss_mask[rows])
        total = total + loss
    total.backward()

    # the loss route: the same per-token PPO loss with the unscaled advantages, reduced by the plan
    by_plan = logp.clone().requires_grad_(True)
    ratio = torch.exp((by_plan - old).float()).to(torch.float64)  # SkyRL exponentiates the log-ratio in float32
    eps_low, eps_high = algorithm.eps_clip_low, algorithm.eps_clip_high
    per_token = -torch.min(ratio * advantages, ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    if policy_loss_type == "dual_clip":
        per_token = torch.where(advantages < 0, torch.min(per_token, -advantages * algorithm.clip_ratio_c), per_token)
    j = plan.loss(per_token, loss_mask, slice(None))
    j.backward()

    torch.testing.assert_close(total, j, rtol=1e-13, atol=1e-15)
    # the gradients pass through SkyRL's float32 exp: equal to float32 rounding
    torch.testing.assert_close(by_advantages.grad, by_plan.grad, rtol=1e-6, atol=1e-9)


def test_skyrls_legacy_token_mean_changes_with_its_micro_batch_size_and_is_refused():
    advantages, loss_mask, lengths, group_index, boundaries = mini_batch(seed=3)
    by_two = skyrl_scaled(advantages, loss_mask, "token_mean_legacy", boundaries, micro_batch_size=2)
    by_four = skyrl_scaled(advantages, loss_mask, "token_mean_legacy", boundaries, micro_batch_size=4)
    assert not torch.allclose(by_two, by_four)
    with pytest.raises(lossagg.ConfigError, match="SkyRL's 'token_mean_legacy' divides each micro-batch by its own tokens"):
        LossAggregationConfig.from_dict({"mode": "token_mean_legacy"})
