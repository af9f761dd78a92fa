"""Sequence-level objectives (lossagg/sequence.py, docs/sequence.md) in one process.

* The per-sample reductions (``sequence_sum``, ``sequence_mean``, ``broadcast_to_tokens``) against
  float64 loops, with gradients, on CPU and CUDA (the CP all-reduce is tests/test_sequence_distributed.py's).
* GSPO, GMPO, LUSPO and CISPO, unsplit and split over micro-batches x DP, against the float64
  references of tests/sequence_reference.py (values and gradients).
* The peers' own code on the same numbers: TRL 1.16's ``GRPOTrainer._compute_loss`` (called on a
  minimal trainer object whose log-probabilities are given, for ``importance_sampling_level="sequence"``
  with ``grpo`` (GSPO) and ``luspo``, and for ``cispo``; its experimental ``GMPOTrainer``'s the same
  way) and verl 0.9.1's registered policy losses
  (``gspo``, ``geo_mean`` (GMPO), ``cispo``). Skipped, with the reason, when a peer is not importable.
* Bad arguments are refused naming the argument.
* NaN/inf under a zero mask, and the overflow of a clipped branch, stay out of the gradient
  (values and gradients against float64).
"""

from __future__ import annotations

import math
import os
import types
from collections import defaultdict

import pytest
import torch
from batches import policy_batch
from hostile_numbers import refused_naming
from sequence_reference import masked_sum, reference_objective, sample_rows

import lossagg
from lossagg.sequence import (
    SEQUENCE_OBJECTIVES,
    broadcast_to_tokens,
    objective_config,
    sequence_loss,
    sequence_mean,
    sequence_sum,
)
from lossagg.testing import rank_totals

EPS = {"gspo": (0.2, 0.28), "luspo": (0.2, 0.28), "gmpo": (0.2, 0.28), "cispo": (0.2, 0.28)}
LAYOUTS = ["padded", "packed32", "packed64"]


def plan_for(objective, batch):
    """The unsplit step's plan: rollout token counts from the (0/1) mask."""
    return lossagg.StepPlan(objective_config(objective), lossagg.token_counts(batch.mask, batch.cu_seqlens))


def ours(objective, batch, plan=None, samples=slice(None)):
    low, high = EPS[objective]
    plan = plan_for(objective, batch) if plan is None else plan
    return sequence_loss(
        objective, plan, batch.log_prob, batch.old_log_prob, batch.advantages, batch.mask, samples, batch.cu_seqlens, eps_low=low, eps_high=high
    )


def reference(objective, batch):
    low, high = EPS[objective]
    return reference_objective(
        objective, batch.log_prob, batch.old_log_prob, batch.advantages, batch.mask, batch.cu_seqlens, eps_low=low, eps_high=high
    )


def value_and_grad(fn, leaf):
    j = fn()
    (grad,) = torch.autograd.grad(j, leaf)
    return j.detach(), grad


# ------------------------------------------------------------- per-sample reductions
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("metrics", [None, 3])
def test_sequence_sum_and_mean_are_the_per_sample_sums_and_means(layout, metrics, device):
    b = policy_batch(1, layout)
    values = b.log_prob.detach()
    if metrics is not None:
        values = torch.stack([values * (k + 1) for k in range(metrics)])
    values = values.to(device).requires_grad_(True)
    mask, cu = b.mask.to(device), None if b.cu_seqlens is None else b.cu_seqlens.to(device)
    weights = torch.randn((metrics or 1, b.advantages.shape[0]), dtype=torch.float64, device=device)

    def ref(kind):
        rows = values.unsqueeze(0) if metrics is None else values
        out = []
        for k in range(rows.shape[0]):
            per = []
            for x, m in zip(sample_rows(rows[k], cu), sample_rows(mask, cu), strict=True):
                s = masked_sum(x, m)
                per.append(s if kind == "sum" else s / torch.clamp(m.sum(), min=1.0))
            out.append(torch.stack(per))
        out = torch.stack(out)
        return out if metrics is not None else out[0]

    for kind, fn in (("sum", sequence_sum), ("mean", sequence_mean)):
        got = fn(values, mask, cu)
        expected = ref(kind)
        assert got.dtype == torch.float64 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)
        w = weights if metrics is not None else weights[0]
        (g_got,) = torch.autograd.grad((got * w).sum(), values)
        (g_ref,) = torch.autograd.grad((expected * w).sum(), values)
        torch.testing.assert_close(g_got, g_ref, rtol=1e-13, atol=1e-13)


def test_sequence_mean_divides_by_the_mask_sum_and_gives_0_without_loss_tokens():
    values = torch.tensor([1.0, 2.0, 4.0, 8.0, 3.0])
    mask = torch.tensor([0.5, 2.0, 0.0, 0.0, 1.0])  # weights, as in TRL and verl
    cu = torch.tensor([0, 2, 4, 5])
    got = sequence_mean(values, mask, cu)
    torch.testing.assert_close(got, torch.tensor([(0.5 + 4.0) / 2.5, 0.0, 3.0]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_broadcast_to_tokens_repeats_each_sample_over_its_tokens(layout, device):
    b = policy_batch(2, layout)
    mask, cu = b.mask.to(device), None if b.cu_seqlens is None else b.cu_seqlens.to(device)
    per_sample = torch.arange(1.0, 9.0, dtype=torch.float64, device=device).requires_grad_(True)
    tokens = broadcast_to_tokens(per_sample, mask, cu)
    assert tokens.shape == mask.shape
    for i, row in enumerate(sample_rows(tokens.detach(), cu)):
        assert bool((row == i + 1).all())
    (grad,) = torch.autograd.grad(tokens.sum(), per_sample)
    widths = torch.tensor([row.numel() for row in sample_rows(mask, cu)], dtype=torch.float64, device=device)
    torch.testing.assert_close(grad, widths)


# ----------------------------------------------------------------- the objectives
@pytest.mark.parametrize("objective", list(SEQUENCE_OBJECTIVES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(3))
def test_an_unsplit_step_is_the_objectives_j(objective, layout, seed):
    b = policy_batch(seed, layout)
    j, grad = value_and_grad(lambda: ours(objective, b), b.log_prob)
    j_ref, grad_ref = value_and_grad(lambda: reference(objective, b), b.log_prob)
    torch.testing.assert_close(j, j_ref, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-15)
    assert grad.abs().sum() > 0


def test_the_batches_clip_on_both_sides():
    """The numbers the tests use clip GSPO's sample ratios above and below (so the clipped
    branches are compared too)."""
    low, high = EPS["gspo"]
    ratios = []
    for seed in range(3):
        b = policy_batch(seed, "padded")
        ratios.append(torch.exp(sequence_mean(b.log_prob.detach() - b.old_log_prob, b.mask)))
    ratios = torch.cat(ratios)
    assert bool((ratios > 1 + high).any()) and bool((ratios < 1 - low).any())


@pytest.mark.parametrize("objective", list(SEQUENCE_OBJECTIVES))
@pytest.mark.parametrize("micro_batches, dp", [(2, 1), (1, 2), (2, 2), (3, 2)])
def test_micro_batches_and_dp_ranks_add_up_to_j(objective, micro_batches, dp):
    """Each DP rank's plan (from the step totals, as its all-reduce would gather them) and each
    micro-batch's contribution; their sum and its gradient are the unsplit J's."""
    b = policy_batch(4, "packed64")
    cu = b.cu_seqlens
    n = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    counts = lossagg.token_counts(b.mask, cu)
    config = objective_config(objective)
    low, high = EPS[objective]

    def composed():
        total = torch.zeros((), dtype=torch.float64)
        for own in torch.tensor_split(torch.arange(n), dp):
            plan = lossagg.StepPlan.from_totals(config, counts[own], **rank_totals(config, counts, own))
            for mb_local in torch.tensor_split(torch.arange(own.numel()), micro_batches):
                mb = own[mb_local]
                if mb.numel() == 0:
                    continue
                lo, hi = int(cu[mb[0]]), int(cu[mb[-1] + 1])
                mb_cu = lossagg.cu_seqlens_from_lengths(lengths[mb], dtype=torch.int64)
                total = total + sequence_loss(
                    objective,
                    plan,
                    b.log_prob[lo:hi],
                    b.old_log_prob[lo:hi],
                    b.advantages[mb],
                    b.mask[lo:hi],
                    mb_local,
                    mb_cu,
                    eps_low=low,
                    eps_high=high,
                )
        return total

    j, grad = value_and_grad(composed, b.log_prob)
    j_ref, grad_ref = value_and_grad(lambda: reference(objective, b), b.log_prob)
    torch.testing.assert_close(j, j_ref, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("objective", ["gspo", "gmpo"])
def test_a_sample_ratio_taken_inside_one_cp_shard_is_not_j(objective):
    """Without the CP sum (each CP shard's tokens averaged on their own), the loss is not J:
    what the all-reduce of sequence_sum is there for."""
    b = policy_batch(0, "packed64")
    plan = plan_for(objective, b)
    low, high = EPS[objective]
    j_ref = reference(objective, b)
    total = torch.zeros((), dtype=torch.float64)
    for rank in range(2):
        shard = [lossagg.zigzag_shard(t, b.cu_seqlens, 2, rank) for t in (b.log_prob, b.old_log_prob, b.mask)]
        local_cu = lossagg.zigzag_local_cu_seqlens(b.cu_seqlens, 2)
        total = total + sequence_loss(objective, plan, *shard[:2], b.advantages, shard[2], slice(None), local_cu, eps_low=low, eps_high=high)
    assert abs(float(total.detach()) - float(j_ref.detach())) > 1e-3


# -------------------------------------------------------------------------- peers
def trl_trainer_class(gmpo=False):
    """TRL's ``GRPOTrainer`` (or its experimental ``GMPOTrainer``); the test is skipped when TRL is not importable."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    trl = pytest.importorskip("trl", reason="TRL is not importable (scripts/install_peers.sh installs it)")
    try:
        if gmpo:
            from trl.experimental.gmpo import GMPOTrainer  # TRL is optional: imported where it is used

            return GMPOTrainer
        return trl.GRPOTrainer
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"TRL's trainer is not importable: {exc}")


def trl_loss(loss_type, importance_sampling_level, b, epsilon_low, epsilon_high, gmpo=False):
    """TRL's own ``GRPOTrainer._compute_loss`` (``GMPOTrainer._compute_loss`` with ``gmpo``) on ``b``
    (padded), called on a minimal trainer object: its log-probabilities are ``b.log_prob`` (the
    model call is replaced), one process, one accumulation step, no KL, no entropy bonus, no vLLM
    correction."""
    trainer_cls = trl_trainer_class(gmpo)

    class Accelerator:
        num_processes = 1

        @staticmethod
        def reduce(t, reduction="sum"):
            return t

        @staticmethod
        def gather(t):
            return t

        gather_for_metrics = gather

    trainer = object.__new__(trainer_cls)
    trainer.__dict__.update(
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        beta=0.0,
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=Accelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        max_completion_length=b.mask.shape[1],
        args=types.SimpleNamespace(delta=None, steps_per_generation=1),
    )
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (b.log_prob, torch.zeros_like(b.log_prob), None)
    bs, width = b.mask.shape
    inputs = {
        "prompt_ids": torch.zeros(bs, 1, dtype=torch.long),
        "prompt_mask": torch.ones(bs, 1, dtype=torch.long),
        "completion_ids": torch.zeros(bs, width, dtype=torch.long),
        "completion_mask": b.mask,
        "advantages": b.advantages,
        "old_per_token_logps": b.old_log_prob,
        "num_items_in_batch": b.mask.sum(),
    }
    return trainer_cls._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("objective, loss_type", [("gspo", "grpo"), ("luspo", "luspo")])
@pytest.mark.parametrize("seed", range(3))
def test_gspo_and_luspo_are_trls_sequence_level_losses(objective, loss_type, seed):
    b = policy_batch(seed, "padded")
    low, high = EPS[objective]
    j, grad = value_and_grad(lambda: ours(objective, b), b.log_prob)
    theirs, grad_theirs = value_and_grad(lambda: trl_loss(loss_type, "sequence", b, low, high), b.log_prob)
    torch.testing.assert_close(j, theirs, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, grad_theirs, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(3))
def test_cispo_is_trls(seed):
    """TRL caps CISPO's ratio at ``epsilon_high`` itself, with no lower bound: ours with
    ``eps_low=None`` and ``eps_high = epsilon_high - 1``."""
    b = policy_batch(seed, "padded")
    plan = plan_for("cispo", b)
    j, grad = value_and_grad(
        lambda: sequence_loss("cispo", plan, b.log_prob, b.old_log_prob, b.advantages, b.mask, slice(None), eps_low=None, eps_high=0.25),
        b.log_prob,
    )
    theirs, grad_theirs = value_and_grad(lambda: trl_loss("cispo", "token", b, 0.2, 1.25), b.log_prob)
    torch.testing.assert_close(j, theirs, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, grad_theirs, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(3))
def test_gmpo_is_trls_experimental_gmpo_trainer_but_for_samples_without_loss_tokens(seed):
    """TRL's ``GMPOTrainer`` counts a sample without loss tokens as ``-A_i`` (the geometric mean
    of no ratios is 1); here, as in verl, such a sample adds 0. That term is a constant: the
    gradients are the same and the values differ by exactly ``-sum of those A_i / N``."""
    b = policy_batch(seed, "padded")
    low, high = EPS["gmpo"]
    j, grad = value_and_grad(lambda: ours("gmpo", b), b.log_prob)
    theirs, grad_theirs = value_and_grad(lambda: trl_loss("grpo", "token", b, low, high, gmpo=True), b.log_prob)
    without_tokens = b.mask.sum(-1) == 0
    assert int(without_tokens.sum()) >= 2 and bool((b.advantages[without_tokens] != 0).any())
    torch.testing.assert_close(j - b.advantages[without_tokens].sum() / b.mask.shape[0], theirs, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, grad_theirs, rtol=1e-12, atol=1e-15)


def verl_loss(name, b, loss_agg_mode, clip_ratio_low, clip_ratio_high):
    """verl's registered policy loss ``name`` (``verl.trainer.ppo.core_algos.get_policy_loss_fn``)
    on ``b`` (padded, advantages broadcast over each response's tokens as verl's are), the whole
    batch being the step (``global_batch_size`` = its responses, empty ones included)."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not importable (scripts/install_peers.sh installs it)")
    from verl.workers.config import ActorConfig  # verl is optional: imported where it is used

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=clip_ratio_low,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
    )
    config.global_batch_info.update(dp_size=1, global_batch_size=b.mask.shape[0])
    advantages = b.advantages[:, None].expand(b.mask.shape)
    loss, _ = core_algos.get_policy_loss_fn(name)(b.old_log_prob, b.log_prob, advantages, b.mask, loss_agg_mode=loss_agg_mode, config=config)
    return loss


# verl divides by M_i + 1e-8 where we divide by max(M_i, 1) (GSPO's seq-mean-token-mean, GMPO's
# means): a relative difference of about 1e-8 / M_i, hence rtol 1e-7 against verl's GSPO and GMPO.
@pytest.mark.parametrize(
    "objective, name, loss_agg_mode, rtol",
    [("gspo", "gspo", "seq-mean-token-mean", 1e-7), ("gmpo", "geo_mean", "token-mean", 1e-7), ("cispo", "cispo", "token-mean", 1e-13)],
)
@pytest.mark.parametrize("seed", range(3))
def test_gspo_gmpo_and_cispo_are_verls_policy_losses(objective, name, loss_agg_mode, rtol, seed):
    b = policy_batch(seed, "padded")
    low, high = EPS[objective]
    j, grad = value_and_grad(lambda: ours(objective, b), b.log_prob)
    theirs, grad_theirs = value_and_grad(lambda: verl_loss(name, b, loss_agg_mode, low, high), b.log_prob)
    torch.testing.assert_close(j, theirs, rtol=rtol, atol=1e-15)
    torch.testing.assert_close(grad, grad_theirs, rtol=rtol, atol=1e-12)
    # the tolerance is not what makes them agree: another clip range is another loss
    other, _ = value_and_grad(lambda: verl_loss(name, b, loss_agg_mode, low / 4, high / 4), b.log_prob)
    assert abs(float(other) - float(j)) > 1e3 * rtol * abs(float(j))


# -------------------------------------------------------------------- bad arguments
def _call(objective="gspo", plan=None, **changes):
    b = policy_batch(0, "packed64")
    args = dict(
        log_prob=b.log_prob,
        old_log_prob=b.old_log_prob,
        advantages=b.advantages,
        mask=b.mask,
        samples=slice(None),
        cu_seqlens=b.cu_seqlens,
        eps_low=0.2,
        eps_high=0.28,
    )
    args.update(changes)
    plan = plan_for(objective if objective in SEQUENCE_OBJECTIVES else "gspo", b) if plan is None else plan
    return lambda: sequence_loss(objective, plan, **args)


@pytest.mark.parametrize(
    "call, names",
    [
        (_call("ppo"), ["objective must be one of 'gspo', 'gmpo', 'luspo', 'cispo', got 'ppo'"]),
        (_call(eps_low=-0.1), ["eps_low must be a finite number >= 0, got -0.1"]),
        (_call(eps_low=None), ["eps_low must be a finite number >= 0, got None"]),
        (_call(eps_high=float("nan")), ["eps_high must be a finite number >= 0"]),
        (_call(advantages=torch.zeros(3)), ["advantages must be [B] = [8]", "got shape [3]"]),
        (_call(advantages=torch.zeros(8, 2)), ["advantages must be [B] = [8]"]),
        (_call(advantages=[0.0] * 8), ["advantages must be a torch.Tensor, got list"]),
        (_call(advantages=torch.zeros(8, dtype=torch.complex64)), ["advantages must be real numbers"]),
        (_call(old_log_prob=torch.zeros(3, dtype=torch.float64)), ["old_log_prob must have the token shape of mask"]),
        (_call(log_prob=torch.zeros(35, dtype=torch.long)), ["log_prob must have a floating dtype, got torch.int64"]),
        (_call(cu_seqlens=torch.tensor([0, 3, 2])), ["cu_seqlens must be non-decreasing"]),
        (_call(mask=torch.ones(5, 7)), ["mask must be [T] when cu_seqlens is given"]),
        (_call(cp_group="world"), ["cp_group must be a torch.distributed process group (the CP group of this rank) or None, got str 'world'"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_are_refused_by_name(call, names):
    refused_naming(call, *names)


def test_a_plan_of_another_mode_is_refused_naming_the_objectives_mode():
    b = policy_batch(0, "packed64")
    token_plan = lossagg.StepPlan(lossagg.LossAggregationConfig(mode="token_mean"), lossagg.token_counts(b.mask, b.cu_seqlens))
    refused_naming(_call("gspo", plan=token_plan), "plan must reduce by mode=sample_mean for objective='gspo'", "got a plan of mode=token_mean")
    constant_2 = lossagg.StepPlan(lossagg.LossAggregationConfig(mode="constant", divisor=2), lossagg.token_counts(b.mask, b.cu_seqlens))
    refused_naming(_call("luspo", plan=constant_2), "plan must reduce by mode=constant, divisor=1 for objective='luspo'", "divisor=2")
    refused_naming(_call("gspo", plan="sample_mean"), "plan must be a lossagg.StepPlan, got str")


def test_the_reductions_refuse_bad_arguments_by_name():
    values, mask, cu = torch.zeros(4), torch.ones(4), torch.tensor([0, 2, 4])
    refused_naming(lambda: sequence_mean(values.reshape(1, 1, 4), mask, cu), "values has shape [1, 1, 4]")
    refused_naming(lambda: sequence_mean([0.0], mask, cu), "values must be a torch.Tensor, got list")
    refused_naming(lambda: sequence_sum(values, mask, cu, cp_group=object()), "cp_group must be a torch.distributed process group", "got object")
    refused_naming(lambda: broadcast_to_tokens(torch.zeros(3), mask, cu), "per_sample must be [B] = [2]")
    refused_naming(lambda: broadcast_to_tokens(torch.zeros(2), mask.reshape(2, 2, 1), None), "mask must be [B, T] when cu_seqlens is None")
    refused_naming(lambda: lossagg.all_reduce_sum([1.0], None), "tensor must be a torch.Tensor, got list")


def test_objective_config_names_the_objectives():
    assert objective_config("gspo").mode == "sample_mean"
    assert (objective_config("luspo").mode, objective_config("luspo").divisor) == ("constant", 1.0)
    refused_naming(lambda: objective_config("GSPO"), "objective must be one of")


# ------------------------------------------- NaN, inf and overflow kept out of the gradient
def _step(dtype, log_ratio_of_first: float):
    cu = torch.tensor([0, 3, 6])
    mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool)
    log_prob = torch.tensor([-1.0, -1.5, float("nan"), -0.5, float("inf"), -2.0], dtype=dtype)
    old = torch.tensor([-1.0, -1.5, float("nan"), -0.7, float("-inf"), -1.9], dtype=dtype)
    old[:2] = log_prob[:2] - log_ratio_of_first  # sample 0's mean log ratio
    return log_prob, old, mask, cu


@pytest.mark.parametrize("name", sorted(SEQUENCE_OBJECTIVES))
@pytest.mark.parametrize("log_ratio", [0.1, 100.0])
def test_sequence_objectives_keep_nan_and_overflow_out_of_the_gradient(name, log_ratio):
    obj = SEQUENCE_OBJECTIVES[name]
    adv = torch.tensor([1.0, -0.5])
    kwargs = {"eps_low": 0.2, "eps_high": 0.28}
    results = {}
    for dtype in (torch.float32, torch.float64):
        log_prob, old, mask, cu = _step(dtype, log_ratio)
        log_prob.requires_grad_(True)
        j = lossagg.aggregate(obj.config(), obj.token_loss(log_prob, old, adv.to(dtype), mask, cu, **kwargs), mask, cu_seqlens=cu)
        j.backward()
        grad = log_prob.grad
        assert torch.isfinite(j), (name, dtype, j)
        assert torch.isfinite(grad).all(), (name, dtype, grad)
        assert (grad[~mask] == 0).all(), (name, dtype, grad)
        results[dtype] = (j.item(), grad.to(torch.float64))
    (j32, g32), (j64, g64) = results[torch.float32], results[torch.float64]
    assert j32 == pytest.approx(j64, rel=1e-5, abs=1e-6)
    assert torch.allclose(g32, g64, rtol=1e-5, atol=1e-6), (name, g32, g64)
    if log_ratio > 50 and name in ("gspo", "luspo", "gmpo"):  # the clipped branch: a constant, gradient 0 on sample 0
        assert (g64[:3] == 0).all()


def test_gspo_clipped_branch_value_is_the_bound():
    log_prob, old, mask, cu = _step(torch.float32, 100.0)
    loss = lossagg.gspo_token_loss(log_prob, old, torch.tensor([2.0, -0.5]), mask, cu, eps_low=0.2, eps_high=0.28)
    assert loss[0].item() == pytest.approx(-1.28 * 2.0) and math.isfinite(loss[3].item())
