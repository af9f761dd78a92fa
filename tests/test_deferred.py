"""lossagg.DeferredPlan in one process: a filter inside the loss, micro-batches, the rescale after
the last one (docs/composition.md, "Filters inside the loss"). Every mode the registry serves,
both empty-samples conventions, both layouts, with and without an estimate, against the float64
gradient of the filtered unsplit step; the whole loss with terms and weights; metrics; what is
refused, by name; the rescale applied to modules, optimizers and tensors; NeMo-RL's token-level
scheme transcribed in float64. The DP x CP worlds and the engines are tests/test_deferred_distributed.py."""

from __future__ import annotations

import filtered_step
import pytest
import torch
import torch_engines
from batches import function_mode, per_prompt, sessions_in

import lossagg
from lossagg.deferred import deferred_factors

F64 = torch.float64


def _step(seed=1):
    return torch_engines.make_step(n_per_prompt=4, seed=seed)


def _micro_batches(step, layout, size=4):
    """(samples, features, targets, mask, cu_seqlens) of micro-batches of ``size`` consecutive samples,
    packed or padded (rows of the micro-batch's longest sample)."""
    features, targets, mask, cu, _ = step
    lengths = cu[1:] - cu[:-1]
    out = []
    for samples in torch.arange(lengths.numel()).split(size):
        lo, hi = int(cu[samples[0]]), int(cu[samples[-1] + 1])
        if layout == "packed":
            out.append((samples, features[lo:hi], targets[lo:hi], mask[lo:hi], lossagg.cu_seqlens_from_lengths(lengths[samples]).long()))
            continue
        width = max(int(lengths[samples].max()), 1)
        x = torch.zeros(samples.numel(), width, features.shape[1], dtype=F64)
        y = torch.zeros(samples.numel(), width, dtype=F64)
        m = torch.zeros(samples.numel(), width, dtype=torch.bool)
        for r, i in enumerate(samples.tolist()):
            n = int(lengths[i])
            x[r, :n], y[r, :n], m[r, :n] = features[cu[i] : cu[i + 1]], targets[cu[i] : cu[i + 1]], mask[cu[i] : cu[i + 1]]
        out.append((samples, x, y, m, None))
    return out


def _run(config, step, layout, estimate=None, size=4):
    """(the step's J and gradient from a deferred plan, the closed step)."""
    groups = step[4]
    model = torch_engines.make_model()
    plan = lossagg.DeferredPlan(config, groups.numel(), group_index=groups, session_index=sessions_in(groups), estimate=estimate)
    total = 0.0
    for samples, x, y, m, cu in _micro_batches(step, layout, size):
        loss = torch_engines.per_token_loss(model, x, y)
        contribution = plan.loss(loss, filtered_step.keep(loss, m, cu), samples, cu)
        contribution.backward()
        total += float(contribution.detach())
    closed = plan.close()
    closed.apply_(model)
    return total * closed.scale, [p.grad for p in model.parameters()], closed


def _configs():
    for mode, spec in lossagg.MODES.items():
        for empty in ("count", "skip"):
            yield lossagg.LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, 4), empty_samples=empty, **spec.example_settings)


def test_the_filter_drops_samples_and_tokens():
    step = _step()
    _, _, final = filtered_step.reference(lossagg.LossAggregationConfig(), step)
    mask, cu = step[2], step[3]
    rollout, kept = lossagg.token_counts(mask, cu), lossagg.token_counts(final, cu)
    dropped_samples = int(((rollout > 0) & (kept == 0)).sum())
    assert dropped_samples >= 2 and int(kept.sum()) < int(rollout.sum()) - dropped_samples, (rollout, kept)


@pytest.mark.parametrize("estimate", ["none", "rollout plan", "mapping"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("config", list(_configs()), ids=lambda c: f"{c.mode}-{c.empty_samples}")
def test_every_mode_gives_the_filtered_steps_value_and_gradient(config, layout, estimate):
    step = _step()
    features, targets, mask, cu, groups = step
    want, want_j, final = filtered_step.reference(config, step)
    rollout = lossagg.StepPlan.from_mask(config, mask, cu, group_index=groups, session_index=sessions_in(groups))
    given = {"none": None, "rollout plan": rollout, "mapping": dict(rollout.totals)}[estimate]
    j, grads, closed = _run(config, step, layout, given)
    assert abs(j - want_j) <= 1e-12 * max(abs(want_j), 1.0)
    for g, e in zip(grads, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-14)
    assert closed.loss == pytest.approx(want_j, rel=1e-12, abs=1e-15)
    assert torch.equal(closed.plan.token_counts, lossagg.token_counts(final, cu).double())
    final_plan = lossagg.StepPlan.from_mask(config, final, cu, group_index=groups, session_index=sessions_in(groups))
    torch.testing.assert_close(closed.plan.sample_denoms, final_plan.sample_denoms, rtol=0, atol=0)
    if estimate == "none":  # every step-level factor read as 1 until the end: the rescale is 1 / G
        assert closed.scale == pytest.approx(float(final_plan.sample_denoms[0] / closed.plan.sample_denoms[0]) * closed.scale, rel=1e-15)


def test_the_whole_loss_with_terms_and_weights():
    # terms whose step-level factors agree (N for each): one rescale serves them all
    step = _step()
    features, targets, mask, cu, groups = step
    weights = torch.linspace(0.5, 2.0, groups.numel(), dtype=F64)
    config = lossagg.LossAggregationConfig.from_dict(
        {
            "mode": "sample_mean",
            "weighting": "multiply",
            "terms": {"entropy": {"coefficient": -0.1}, "kl": {"mode": "constant", "divisor": 24.0, "coefficient": 0.5}},
        }
    )
    model = torch_engines.make_model()
    plan = lossagg.DeferredPlan(config, groups.numel(), sample_weights=weights)
    for samples, x, y, m, mcu in _micro_batches(step, "packed"):
        loss = torch_engines.per_token_loss(model, x, y)
        terms = {"pg": loss, "entropy": loss.sin(), "kl": loss.sqrt()}
        plan.loss(terms, filtered_step.keep(loss, m, mcu), samples, mcu).backward()
    closed = plan.close()
    closed.apply_(model)
    ref = torch_engines.make_model()
    loss = torch_engines.per_token_loss(ref, features, targets)
    final = filtered_step.keep(loss, mask, cu)
    counts = lossagg.token_counts(final, cu).double()
    sums = [torch.stack([(v[a:b] * final[a:b]).sum() for a, b in zip(cu[:-1], cu[1:], strict=True)]) for v in (loss, loss.sin(), loss.sqrt())]
    n = groups.numel()
    want = (
        (weights * sums[0] / (n * counts.clamp(min=1))).sum() - 0.1 * (sums[1] / (n * counts.clamp(min=1))).sum() + 0.5 * sums[2].sum() / (n * 24.0)
    )
    want.backward()
    assert closed.loss == pytest.approx(float(want.detach()), rel=1e-12)
    for g, e in zip((p.grad for p in model.parameters()), (p.grad for p in ref.parameters()), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-14)


def test_metrics_reported_after_the_step_use_the_final_totals():
    step = _step()
    features, targets, mask, cu, groups = step
    for mode in ("sample_mean", "token_mean"):
        config = lossagg.LossAggregationConfig(mode=mode)
        model = torch_engines.make_model()
        plan = lossagg.DeferredPlan(config, groups.numel())
        provisional = 0.0
        for samples, x, y, m, mcu in _micro_batches(step, "packed"):
            loss = torch_engines.per_token_loss(model, x, y)
            final = filtered_step.keep(loss, m, mcu)
            plan.loss(loss, final, samples, mcu)
            provisional += float(plan.metrics({"entropy": x[:, 0]}, final, samples, mcu)["entropy"].detach())
        closed = plan.close()
        loss = torch_engines.per_token_loss(torch_engines.make_model(), features, targets)
        final = filtered_step.keep(loss, mask, cu)
        want = lossagg.StepPlan.from_mask(config, final, cu).metrics({"entropy": features[:, 0]}, final, slice(None), cu)["entropy"]
        assert closed.metrics["entropy"] == pytest.approx(float(want), rel=1e-12)
        assert provisional * closed.metric_scale == pytest.approx(float(want), rel=1e-12)


@pytest.mark.parametrize("mode", ["sample_mean", "prompt_mean", "session_token_mean"])
def test_a_one_process_close_reads_the_logged_values_as_the_buffer_does(mode, monkeypatch):
    """Without a process group the close adds the logged values as host floats (no buffer to all-reduce): the
    same DeferredStep, bit for bit and key for key, as the buffer's route, which a device value still takes."""
    step = _step()
    _, _, _, _, groups = step
    n = groups.numel()
    spec = lossagg.MODES[mode]
    labels = {"group_index": groups} if spec.needs_groups else {"session_index": torch.arange(n) // 2} if spec.needs_sessions else {}
    config = lossagg.LossAggregationConfig.from_dict(
        {
            "mode": mode,
            "n_samples_per_prompt": 4 if spec.needs_groups else None,  # _step's groups, whole in each micro-batch of 4
            "terms": {"entropy": {"mode": mode, "coefficient": -0.1}, "kl": {"mode": mode, "coefficient": 0.5}},
        }
    )

    def closed():
        model = torch_engines.make_model()
        plan = lossagg.DeferredPlan(config, n, metrics=["entropy", "clip", "ratio"], **labels)  # by key: clip, entropy, ratio
        for samples, x, y, m, mcu in _micro_batches(step, "packed"):
            loss = torch_engines.per_token_loss(model, x, y)
            final = filtered_step.keep(loss, m, mcu)
            plan.loss({"pg": loss, "entropy": loss.sin(), "kl": loss.float().sqrt()}, final, samples, mcu)
            plan.metrics({"entropy": x[:, 0], "clip": x[:, 1].float(), "ratio": x[:, 0].exp()}, final, samples, mcu)
        return plan.close()

    fast = closed()
    with monkeypatch.context() as m:
        m.setattr(lossagg.ledger.StepLedger, "host_sums", lambda self: None)  # as for a value on a device
        slow = closed()
    assert (fast.scale, fast.metric_scale, fast.loss) == (slow.scale, slow.metric_scale, slow.loss)
    assert list(fast.terms.items()) == list(slow.terms.items()) and list(fast.metrics.items()) == list(slow.metrics.items())
    assert list(fast.plan.totals) == list(slow.plan.totals)
    for name, value in slow.plan.totals.items():
        same = torch.equal(fast.plan.totals[name], value) if isinstance(value, torch.Tensor) else fast.plan.totals[name] == value
        assert same, name
    assert fast.loss != 0.0 and list(fast.metrics) == ["clip", "entropy", "ratio"]


def test_nemo_rls_token_level_scheme_gives_the_same_number():
    """NeMo-RL's in-loss filter (PR #4171, open when read; NVIDIA-NeMo/RL), transcribed in float64:
    each micro-batch's token-level loss divides by the step's rollout count G plus 1e-8
    (``masked_mean(..., global_normalization_factor=global_valid_toks)``, nemo_rl/algorithms/utils.py
    lines 212-224 and nemo_rl/algorithms/loss/loss_functions.py lines 678-683 at 7ea279ab, G from
    ``process_global_batch``, nemo_rl/models/megatron/data.py lines 806-817), the filtered tokens out
    of the numerator; after the last micro-batch the worker multiplies the gradients by G / K, K the
    surviving tokens summed over DP in float64 (``_normalize_in_loss_seq_filter``,
    nemo_rl/models/policy/workers/megatron_policy_worker.py at the PR's commit 94d53ee5, lines
    1036-1042 as issue #4242 cites them; read from the PR's file, its line numbers not computed
    here). It covers token-level losses: lossagg's token_mean with the rollout plan as estimate."""
    step = _step()
    features, targets, mask, cu, groups = step
    # NeMo-RL, two DP ranks of two micro-batches each
    model = torch_engines.make_model()
    g_rollout = float(mask.sum())  # global_valid_toks: the DP sum of token_mask * sample_mask
    survivors = 0.0
    for _, x, y, m, mcu in _micro_batches(step, "packed"):
        loss = torch_engines.per_token_loss(model, x, y)
        kept = filtered_step.keep(loss, m, mcu).to(F64)
        (torch.sum(loss * kept) / (g_rollout + 1e-8)).backward()  # masked_mean with the global factor
        survivors += float(kept.sum())  # seq_logprob_error_valid_tokens, summed over micro-batches and DP
    token_factor = g_rollout / survivors
    nemo = [p.grad * token_factor for p in model.parameters()]  # model.scale_gradients(token_factor)
    # lossagg: token_mean, the rollout plan as the estimate
    config = lossagg.LossAggregationConfig(mode="token_mean")
    rollout = lossagg.StepPlan.from_mask(config, mask, cu)
    _, grads, closed = _run(config, step, "packed", rollout)
    assert closed.scale == pytest.approx(token_factor, rel=1e-15)
    for g, e in zip(grads, nemo, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=0)  # NeMo-RL's + 1e-8 on G: 1e-8 / G relative


# ------------------------------------------------------------------------- refusals
def test_a_mode_whose_denoms_are_a_function_is_refused_by_name():
    spec = function_mode(
        "sample_sqrt_deferred",
        "N · sqrt(c(M[i]))",
        lambda x: x.totals.num_samples * x.token_counts.clamp(min=1.0).sqrt(),
        lambda r: sum(s / max(m, 1.0) ** 0.5 for s, m in zip(r.numerators, r.token_counts, strict=True)) / len(r.numerators),
    )
    lossagg.register_mode(spec)
    try:
        with pytest.raises(ValueError, match=r"DeferredPlan cannot serve mode=sample_sqrt_deferred: its d\[i\] is a function"):
            lossagg.DeferredPlan(lossagg.LossAggregationConfig(mode="sample_sqrt_deferred"), 4)
        # the same maths declared as a product is served
        product = lossagg.ModeSpec(
            name="sample_mean_declared",
            summary="sample_mean, declared",
            formula="(1/N) Σ_i Σ_t m·l / c(M[i])",
            denoms=lossagg.DenomProduct("N", "c(M[i])"),
            reference=lossagg.MODES["sample_mean"].reference,
        )
        lossagg.register_mode(product)
        assert deferred_factors(product) == (("N",), False)
        lossagg.DeferredPlan(lossagg.LossAggregationConfig(mode="sample_mean_declared"), 4)
    finally:
        lossagg.unregister_mode("sample_sqrt_deferred")
        if "sample_mean_declared" in lossagg.MODES:
            lossagg.unregister_mode("sample_mean_declared")


def test_prompt_mean_needs_whole_groups_in_each_micro_batch():
    step = _step()
    config = lossagg.LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=4)
    with pytest.raises(
        ValueError,
        match=r"prompt group 0 has 3 of its 4 samples in this micro-batch: mode=prompt_mean reads its samples and tokens when its micro-batch runs",
    ):
        _run(config, step, "packed", size=3)
    with pytest.raises(ValueError, match="set n_samples_per_prompt"):
        lossagg.DeferredPlan(lossagg.LossAggregationConfig(mode="prompt_mean"), 16, group_index=step[4])


def test_terms_with_other_step_level_factors_are_refused_by_name():
    config = lossagg.LossAggregationConfig.from_dict(
        {"mode": "prompt_mean", "n_samples_per_prompt": 4, "terms": {"kl": {"mode": "token_mean", "coefficient": 0.1}}}
    )
    remedy = r"give 'kl' the PG term's mode and weighting \(mode=prompt_mean\)"
    with pytest.raises(ValueError, match=r"term 'kl' \(mode=token_mean\).*'kl' has c\(T\) where the PG term has P: " + remedy):
        lossagg.DeferredPlan(config, 16, group_index=torch.arange(16) // 4)


def test_a_rank_without_samples_closes_with_the_same_buffer():
    # a rank whose share of the step is empty still closes (in a world, its all-reduce carries every
    # term's logged value, zeros); a step without any sample has J = 0 and nothing to rescale
    for mode in ("sample_mean", "token_mean"):
        closed = lossagg.DeferredPlan(lossagg.LossAggregationConfig(mode=mode), 0).close()
        assert closed.scale == 1.0 and closed.loss == 0.0 and closed.terms == {"pg": 0.0}


def test_misuse_is_named_and_leaves_nothing_half_applied():
    step = _step()
    config = lossagg.LossAggregationConfig()
    model = torch_engines.make_model()
    plan = lossagg.DeferredPlan(config, 16)
    batches = _micro_batches(step, "packed")
    samples, x, y, m, cu = batches[0]
    loss = torch_engines.per_token_loss(model, x, y)
    with pytest.raises(ValueError, match=r"make its micro-batch \(micro_batch\(\) or loss\(\)\) first"):
        plan.metrics({"x": loss}, m, samples, cu)
    with pytest.raises(ValueError, match="samples selects 3 sample"):
        plan.loss(loss, m, samples[:3], cu)
    with pytest.raises(TypeError, match="values must have a floating dtype"):  # fails in the reduction: the micro-batch is forgotten
        plan.loss(torch.zeros_like(loss, dtype=torch.int32), m, samples, cu)
    plan.loss(loss, m, samples, cu)  # the same micro-batch again, after the failure
    with pytest.raises(ValueError, match="sample 0 already ran in an earlier micro-batch"):
        plan.loss(loss, m, samples, cu)
    with pytest.raises(ValueError, match=r"12 of this rank's 16 samples never ran a micro-batch \(4, 5, 6, 7, 8, 9, 10, 11, \.\.\.\)"):
        plan.close()
    with pytest.raises(ValueError, match="estimate must hold the step total.s. total_tokens that mode=token_mean reads"):
        lossagg.DeferredPlan(lossagg.LossAggregationConfig(mode="token_mean"), 4, estimate={"num_samples": 4})
    with pytest.raises(TypeError, match="estimate must be a StepPlan or a mapping"):
        lossagg.DeferredPlan(config, 4, estimate=3.0)


def test_megatron_loss_func_refuses_what_it_cannot_serve():
    from lossagg.integrations.megatron import make_loss_func

    mask = torch.ones(4, dtype=torch.bool)
    cu = torch.tensor([0, 2, 4])
    plan = lossagg.StepPlan(lossagg.LossAggregationConfig(), torch.tensor([2, 2]))
    with pytest.raises(TypeError, match="needs a lossagg.DeferredPlan, got a StepPlan"):
        make_loss_func(plan, [0, 1], cu, mask, num_micro_batches=1, keep=lambda out, m: m)
    deferred = lossagg.DeferredPlan(lossagg.LossAggregationConfig(mode="token_mean"), 2)
    with pytest.raises(ValueError, match="calculate_per_token_loss=True divides the gradients"):
        make_loss_func(deferred, [0, 1], cu, mask, num_micro_batches=1, calculate_per_token_loss=True)


# --------------------------------------------------------------------- the rescale
def test_apply_scales_modules_optimizers_tensors_and_buffers_once():
    closed = lossagg.DeferredStep(scale=0.5, metric_scale=1.0, plan=lossagg.StepPlan(lossagg.LossAggregationConfig(), torch.tensor([1.0])), loss=None)
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert closed.apply_(model) == 2 and all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert closed.apply_(optimizer) == 2 and torch.equal(model.weight.grad, torch.full_like(model.weight, 0.25))
    assert closed.apply_([model.bias, model.bias]) == 1 and torch.equal(model.bias.grad, torch.full_like(model.bias, 0.125))  # once
    main = torch.nn.Parameter(torch.zeros(2))
    main.main_grad = torch.ones(2)  # Megatron's buffer view is scaled, not .grad
    grad = torch.ones(3)
    assert closed.apply_([main, grad]) == 2 and torch.equal(main.main_grad, torch.full((2,), 0.5)) and torch.equal(grad, torch.full((3,), 0.5))

    class Buffers:
        def scale_gradients(self, factor):
            self.factor = factor

    buffers = Buffers()
    closed.apply_(buffers)
    assert buffers.factor == 0.5
    with pytest.raises(TypeError, match="target must be a module, an optimizer"):
        closed.apply_(3)


def test_hostile_and_careless_calls_are_named():
    """Metrics given twice for a sample, or after close(); a process group that is not one; an
    estimate of NumPy and 0-dim tensor numbers; an integer gradient to rescale."""
    import numpy as np

    mask = torch.ones(2, 3, dtype=torch.bool)
    plan = lossagg.DeferredPlan({"mode": "sample_mean"}, 2)
    mb = plan.micro_batch(slice(None), mask)
    plan.loss(torch.randn(2, 3), mb)
    plan.metrics({"ent": torch.ones(2, 3)}, mb)
    with pytest.raises(ValueError, match="metric 'ent' was already reported for sample 0 in this step"):
        plan.metrics({"ent": torch.ones(1, 3)}, mask[:1], [0])
    step = plan.close()
    assert step.metrics == {"ent": pytest.approx(1.0)}  # the mean of ones, counted once (twice: 1.5)
    with pytest.raises(RuntimeError, match=r"DeferredPlan.metrics: the step is closed"):
        plan.metrics({"ent": torch.ones(2, 3)}, mb)
    for name, group in (("process_group", "dp"), ("cp_group", "cp")):
        with pytest.raises(TypeError, match=rf"{name} must be a torch.distributed process group .* got str '{group[:2]}'"):
            lossagg.DeferredPlan({"mode": "sample_mean"}, 2, **{name: group})
    for number in (np.float64(4.0), np.int64(4), torch.tensor(4.0)):
        plan = lossagg.DeferredPlan({"mode": "sample_mean"}, 2, estimate={"num_samples": number})
        assert plan._used == 4.0
    with pytest.raises(TypeError, match=r"DeferredStep.apply_: target holds a gradient of dtype torch.int64, which cannot be scaled"):
        step.apply_([torch.ones(3), torch.ones(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"estimate: the step total num_samples must be a finite number >= 0, got 1000000000"):
        lossagg.DeferredPlan({"mode": "sample_mean"}, 6, estimate={"num_samples": 10**400})
    with pytest.raises(ValueError, match=r"num_local_samples \(this rank's samples in the step\) must be <= 2\*\*31, got 1099511627776"):
        lossagg.DeferredPlan({"mode": "sample_mean"}, 2**40)  # refused before its ledger is allocated (1 TiB)


def test_a_micro_batch_reduced_twice_is_refused_and_a_failed_call_can_be_retried():
    """plan.loss on one DeferredPlan handle counts in the gradients each time it is backpropagated but in the
    step's J once: a second successful reduction of a term is refused by name; a call that raised recorded
    nothing, so the same handle is reduced again."""
    config = lossagg.LossAggregationConfig.from_dict({"mode": "token_mean", "terms": {"kl": {"coefficient": 0.5, "mode": "token_mean"}}})
    mask = torch.ones(2, 3, dtype=torch.bool)
    values = {k: torch.randn(2, 3, dtype=F64, requires_grad=True) for k in ("pg", "kl")}
    plan = lossagg.DeferredPlan(config, 2)
    mb = plan.micro_batch(slice(None), mask)
    with pytest.raises(ValueError, match=r"values\['kl'\] must be a tensor with the token shape"):
        plan.loss({"pg": values["pg"], "kl": torch.ones(3, dtype=F64)}, mb)
    first = plan.loss(values, mb)  # the retry after the failed call
    first.backward()
    with pytest.raises(ValueError, match=r"the term\(s\) pg, kl of this micro-batch were already reduced"):
        plan.loss(values, mb)
    with pytest.raises(ValueError, match=r"the term\(s\) kl of this micro-batch were already reduced"):
        plan.loss(values["kl"], mb, terms="kl")
    step = plan.close()
    assert step.loss == pytest.approx(float(first) * step.scale)  # one reduction counted, as in the gradients
    # the terms one call at a time: each once, then the micro-batch is whole
    plan = lossagg.DeferredPlan(config, 2)
    mb = plan.micro_batch(slice(None), mask)
    parts = [plan.loss(values[k], mb, terms=k) for k in ("pg", "kl")]
    step = plan.close()
    assert step.loss == pytest.approx(float(sum(parts)) * step.scale)
    plan = lossagg.DeferredPlan(config, 2)
    plan.loss(values["pg"], plan.micro_batch(slice(None), mask), terms="pg")
    with pytest.raises(ValueError, match=r"never reduced the term\(s\) kl in loss\(\)"):
        plan.close()


def test_a_plan_shared_by_two_threads_records_a_micro_batch_once():
    """Two threads giving the same samples to one fresh plan: one records them, the other is refused
    (the check and the record are one atomic step), in every one of 200 tries."""
    import threading

    mask = torch.ones(4, 64, dtype=torch.bool)
    for _ in range(200):
        plan = lossagg.DeferredPlan({"mode": "token_mean"}, 4)
        outcomes, start = [], threading.Barrier(2)

        def give(plan=plan, outcomes=outcomes, start=start):
            start.wait()
            try:
                plan.micro_batch(slice(None), mask)
                outcomes.append("made")
            except ValueError as exc:
                outcomes.append("refused" if "already ran" in str(exc) else str(exc))

        threads = [threading.Thread(target=give) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["made", "refused"], outcomes
