"""lossagg.integrations.megatron driven the way Megatron's no-pipelining schedule drives a
loss function: per micro-batch ``loss_func(output)``, the division by the number of
micro-batches (per-token loss off) or by the step's summed ``num_tokens`` (on), gradients
averaged (off) or summed (on) over DP ranks. The final gradient is J's, for every mode."""

from __future__ import annotations

import pytest
import torch

import lossagg
from lossagg.integrations.megatron import make_loss_func
from lossagg.modes import MODES
from lossagg.testing import rank_totals, reference_loss

DP, MICRO_BATCHES, N_PER_PROMPT = 2, 3, 2


def make_step(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = 6 * N_PER_PROMPT
    lengths = torch.randint(0, 12, (n,), generator=g)
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    features = torch.randn(int(cu[-1]), 5, generator=g, dtype=torch.float64)
    mask = torch.rand(int(cu[-1]), generator=g) < 0.8
    return lengths, cu, features, mask, torch.arange(n) // N_PER_PROMPT


def per_token_loss(model, features):
    return -torch.nn.functional.logsigmoid(model(features).squeeze(-1))


def megatron_schedule(config, per_token_loss_on, seed):
    """Gradient Megatron would apply, for a step split over DP ranks and micro-batches."""
    lengths, cu, features, mask, groups = make_step(seed)
    n = lengths.numel()
    model = torch.nn.Linear(5, 1).double()
    torch.manual_seed(0)
    torch.nn.init.normal_(model.weight)
    rank_grads, all_num_tokens = [], []
    all_counts = lossagg.token_counts(mask, cu)
    for own in torch.tensor_split(torch.arange(n), DP):
        model.zero_grad()
        # what a trainer hands each rank: the step totals, no collective
        plan = lossagg.StepPlan.from_totals(config, all_counts[own], **rank_totals(config, all_counts, own, groups))
        for local in torch.tensor_split(torch.arange(own.numel()), MICRO_BATCHES):
            samples = own[local]
            lo, hi = int(cu[samples[0]]), int(cu[samples[-1] + 1])
            mb_cu = cu[samples[0] : samples[-1] + 2] - lo
            loss_func = make_loss_func(
                plan, local, mb_cu, mask[lo:hi], num_micro_batches=MICRO_BATCHES, dp_size=DP, calculate_per_token_loss=per_token_loss_on
            )
            out = loss_func(per_token_loss(model, features[lo:hi]))
            if len(out) == 3:  # per-token loss: kept as is, num_tokens summed
                out[0].backward()
                all_num_tokens.append(out[1])
            else:
                (out[0] / MICRO_BATCHES).backward()
        rank_grads.append(model.weight.grad.clone())
    if per_token_loss_on:
        grad = sum(rank_grads) / sum(all_num_tokens)  # summed over DP, divided by total tokens
    else:
        grad = sum(rank_grads) / DP  # averaged over DP
    model.zero_grad()
    reference_loss(config, per_token_loss(model, features), mask, cu, groups).backward()
    return grad, model.weight.grad


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("per_token_loss_on", [False, True])
def test_megatron_schedule_gives_the_gradient_of_j(mode, per_token_loss_on):
    config = lossagg.LossAggregationConfig(mode=mode, n_samples_per_prompt=N_PER_PROMPT, **MODES[mode].example_settings)
    grad, expected = megatron_schedule(config, per_token_loss_on, seed=sum(map(ord, mode)) % 100)  # str hash() changes from run to run
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


def test_reports_and_num_tokens():
    config = lossagg.LossAggregationConfig(mode="token_mean")
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.bool)
    cu = torch.tensor([0, 2, 4])
    plan = lossagg.StepPlan.from_mask(config, mask, cu)
    f = make_loss_func(plan, [0, 1], cu, mask, num_micro_batches=1, calculate_per_token_loss=True, metrics={"kl": torch.ones(4)})
    loss, num_tokens, report = f(torch.ones(4))
    assert num_tokens.item() == 3 and loss.item() == pytest.approx(3.0) and report["pg_loss"].item() == pytest.approx(1.0)
    assert report["kl"].item() == pytest.approx(1.0)
