"""lossagg.integrations.megatron driven the way Megatron's no-pipelining schedule drives a
loss function: per micro-batch ``loss_func(output)``, the division by the number of
micro-batches (per-token loss off) or by the step's summed ``num_tokens`` (on), gradients
averaged (off) or summed (on) over DP ranks. The final gradient is J's, for every mode.
Hostile and careless sizes are refused naming the argument, or accepted with the value of
the float64 formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batches import per_prompt, sessions_in
from hostile_numbers import PROPERTY, int_like, numbers, refused_naming
from hypothesis import given
from hypothesis import strategies as st

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


def megatron_schedule(config, per_token_loss_on, seed, values_of=per_token_loss, reference=None):
    """Gradient Megatron would apply, for a step split over DP ranks and micro-batches, and J's gradient (float64 reference)."""
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
        plan = lossagg.StepPlan.from_totals(config, all_counts[own], **rank_totals(config, all_counts, own, groups, sessions_in(groups)))
        for local in torch.tensor_split(torch.arange(own.numel()), MICRO_BATCHES):
            samples = own[local]
            lo, hi = int(cu[samples[0]]), int(cu[samples[-1] + 1])
            mb_cu = cu[samples[0] : samples[-1] + 2] - lo
            loss_func = make_loss_func(
                plan, local, mb_cu, mask[lo:hi], num_micro_batches=MICRO_BATCHES, dp_size=DP, calculate_per_token_loss=per_token_loss_on
            )
            out = loss_func(values_of(model, features[lo:hi]))
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
    if reference is None:
        reference_loss(config, values_of(model, features), mask, cu, groups, session_index=sessions_in(groups)).backward()
    else:
        reference(config, values_of(model, features), mask, cu, groups).backward()
    return grad, model.weight.grad


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("per_token_loss_on", [False, True])
def test_megatron_schedule_gives_the_gradient_of_j(mode, per_token_loss_on):
    config = lossagg.LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, N_PER_PROMPT), **MODES[mode].example_settings)
    grad, expected = megatron_schedule(config, per_token_loss_on, seed=sum(map(ord, mode)) % 100)  # str hash() changes from run to run
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


# the PG term and two terms, each on a mode of its own: a term reduced on another's denominators changes the gradient
TERMS_CONFIG = {
    "mode": "sample_mean",
    "n_samples_per_prompt": N_PER_PROMPT,
    "terms": {"entropy": {"mode": "token_mean", "coefficient": -0.01}, "kl": {"mode": "prompt_mean", "coefficient": 0.05}},
}


def term_values(model, features):
    out = model(features).squeeze(-1)
    return {"pg": -torch.nn.functional.logsigmoid(out), "entropy": out**2, "kl": torch.sin(out) + 1.5}


def terms_reference(config, values, mask, cu, groups):
    """Σ_k c_k J_k, each J_k the float64 reference of the term's own mode."""
    total = 0.0
    for term in config.loss_terms:
        single = lossagg.LossAggregationConfig(mode=term.spec.name, n_samples_per_prompt=config.n_samples_per_prompt)
        total = total + term.coefficient * reference_loss(single, values[term.name], mask, cu, groups)
    return total


@pytest.mark.parametrize("per_token_loss_on", [False, True])
def test_megatron_schedule_with_terms_on_their_own_modes(per_token_loss_on):
    """output_tensor a mapping of the terms' per-token values: the gradient is that of Σ_k c_k J_k, each term on its own mode."""
    config = lossagg.LossAggregationConfig.from_dict(TERMS_CONFIG)
    grad, expected = megatron_schedule(config, per_token_loss_on, seed=11, values_of=term_values, reference=terms_reference)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


def test_a_filter_inside_the_loss_gives_the_filtered_steps_gradient():
    """keep= (a filter inside the loss, after the forward) with a DeferredPlan over three micro-batches: after the step's
    rescale the gradient is that of J over the kept tokens, not over the rollout's mask."""
    lengths, cu, features, mask, groups = make_step(seed=5)
    # one rescale after the step serves every term that divides by the PG term's step-level factors (here N)
    terms = {"entropy": {"mode": "sample_mean", "coefficient": -0.01}, "kl": {"mode": "sample_mean", "coefficient": 0.05}}
    config = lossagg.LossAggregationConfig.from_dict({**TERMS_CONFIG, "terms": terms})
    model = torch.nn.Linear(5, 1).double()
    torch.nn.init.normal_(model.weight, generator=torch.Generator().manual_seed(0))
    keep = lambda output, m: m & (output["pg"].detach() < 0.9)  # noqa: E731  (drops a good share of the tokens)
    plan = lossagg.DeferredPlan(config, lengths.numel(), group_index=groups)
    kept = torch.zeros_like(mask)
    for samples in torch.tensor_split(torch.arange(lengths.numel()), MICRO_BATCHES):
        lo, hi = int(cu[samples[0]]), int(cu[samples[-1] + 1])
        loss_func = make_loss_func(plan, samples, cu[samples[0] : samples[-1] + 2] - lo, mask[lo:hi], num_micro_batches=MICRO_BATCHES, keep=keep)
        values = term_values(model, features[lo:hi])
        kept[lo:hi] = keep(values, mask[lo:hi])
        loss, _ = loss_func(values)
        (loss / MICRO_BATCHES).backward()
    plan.close().apply_(model)
    grad = model.weight.grad.clone()
    assert 0 < int(kept.sum()) < int(mask.sum())  # the filter changed the step
    model.zero_grad()
    terms_reference(config, term_values(model, features), kept, cu, groups).backward()
    torch.testing.assert_close(grad, model.weight.grad, rtol=1e-9, atol=1e-12)


def test_reports_and_num_tokens():
    config = lossagg.LossAggregationConfig(mode="token_mean")
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.bool)
    cu = torch.tensor([0, 2, 4])
    plan = lossagg.StepPlan.from_mask(config, mask, cu)
    f = make_loss_func(plan, [0, 1], cu, mask, num_micro_batches=1, calculate_per_token_loss=True, metrics={"kl": torch.ones(4)})
    loss, num_tokens, report = f(torch.ones(4))
    assert num_tokens.item() == 3 and loss.item() == pytest.approx(3.0) and report["pg_loss"].item() == pytest.approx(1.0)
    assert report["kl"].item() == pytest.approx(1.0)


# ------------------------------------------------------ hostile and careless arguments
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


@PROPERTY
@given(num_micro_batches=numbers, dp_size=numbers, cp_size=numbers, per_token=st.booleans())
def test_megatron_sizes(num_micro_batches, dp_size, cp_size, per_token):
    plan, cu, mask = megatron_plan()
    call = lambda: make_loss_func(  # noqa: E731
        plan, [0, 1], cu, mask, num_micro_batches=num_micro_batches, dp_size=dp_size, cp_size=cp_size, calculate_per_token_loss=per_token
    )
    sizes = {"num_micro_batches": int_like(num_micro_batches), "dp_size": int_like(dp_size), "cp_size": int_like(cp_size)}
    bad = [name for name, v in sizes.items() if v is None or v < 1]
    if bad:
        return refused_naming(call, *bad)
    out = call()(torch.full((9,), 3.0, dtype=torch.float64))
    scale = 9.0 if per_token else sizes["num_micro_batches"] * sizes["dp_size"]  # T, or micro-batches x DP
    assert out[0].item() == pytest.approx(3.0 * scale, rel=1e-12)


def test_a_deferred_plan_with_terms_reports_each_term():
    """make_loss_func(DeferredPlan with terms, keep=...) reports pg_loss as the PG term's own share
    and <term>_loss for each other term (before the step's rescale), as the StepPlan route does;
    keep must be a function."""
    lengths, cu, features, mask, groups = make_step(seed=4)
    config = lossagg.LossAggregationConfig.from_dict({"mode": "token_mean", "terms": {"kl": {"coefficient": 0.5}}})
    values = {"pg": torch.randn(int(cu[-1]), dtype=torch.float64), "kl": torch.randn(int(cu[-1]), dtype=torch.float64)}
    n = lengths.numel()
    with pytest.raises(TypeError, match="keep must be a function keep\\(output_tensor, loss_mask\\).*got int 3"):
        make_loss_func(lossagg.DeferredPlan(config, n), slice(None), cu, mask, num_micro_batches=1, keep=3)
    keep = lambda output, m: m & (output["pg"].detach() < 1.0)  # noqa: E731
    plan = lossagg.DeferredPlan(config, n)
    loss, report = make_loss_func(plan, slice(None), cu, mask, num_micro_batches=1, keep=keep)(values)
    step = plan.close()
    assert set(report) == {"pg_loss", "kl_loss"}
    assert report["pg_loss"].item() * step.scale == pytest.approx(step.terms["pg"], rel=1e-12)
    assert report["kl_loss"].item() * step.scale == pytest.approx(step.terms["kl"], rel=1e-12)
    assert loss.item() * step.scale == pytest.approx(step.terms["pg"] + 0.5 * step.terms["kl"], rel=1e-12)
