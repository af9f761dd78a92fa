"""The micro-batch: one handle both plans make (``plan.micro_batch``), checked once, and one reduction
(``plan.loss``, lossagg/micro_batch.py) for one tensor or a mapping of terms, with or without parts;
what it refuses, how it cuts a micro-batch from the step's layout, and a loss function calling it
compiled whole (``torch.compile(fullgraph=True)``) against eager."""

from __future__ import annotations

import pytest
import torch

import lossagg
from lossagg import DeferredPlan, LossAggregationConfig, StepPlan
from lossagg.testing import reference_loss

TERMS = {"entropy": {"coefficient": -0.01}, "kl": {"mode": "token_mean", "coefficient": 0.05}}


def _step(seed: int = 0, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (n,), generator=g)
    lengths[3] = 0
    cu = lossagg.cu_seqlens_from_lengths(lengths).long()
    mask = torch.rand(int(cu[-1]), generator=g) < 0.85
    values = {k: torch.randn(int(cu[-1]), generator=g, dtype=torch.float64) for k in ("pg", "entropy", "kl")}
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.25
    return lengths, cu, mask, values, weights


def _whole_step(config, values, mask, cu, groups=None, weights=None):
    """J of the whole step from the float64 references of each term's own mode (docs/terms.md)."""
    total = 0.0
    for name, v in values.items():
        term = None if name == "pg" else config.terms[name]
        mode = config.mode if term is None else term.mode
        weighting = config.weighting if term is None else term.weighting
        coefficient = 1.0 if term is None else term.coefficient
        settings = {"mode": mode, "empty_samples": config.empty_samples}
        if mode == "constant":
            settings["divisor"] = config.divisor if term is None else term.divisor
        if weighting == "none":
            j = reference_loss(LossAggregationConfig.from_dict(settings), v, mask, cu, groups)
        else:  # a weighted mean: the sample's weight on its numerator, W in place of N
            assert weighting == "mean" and mode == "sample_mean"
            lengths = cu[1:] - cu[:-1]
            sums = torch.segment_reduce((v * mask).to(torch.float64), "sum", lengths=lengths, unsafe=True)
            counts = torch.segment_reduce(mask.to(torch.float64), "sum", lengths=lengths, unsafe=True)
            j = (weights * sums / counts.clamp(min=1.0)).sum() / weights.sum()
        total = total + coefficient * j
    return total


# ------------------------------------------------------------------------------ one entrance
@pytest.mark.parametrize("kind", ["step", "deferred"])
def test_a_config_with_terms_given_one_tensor_is_refused_by_name(kind):
    lengths, cu, mask, values, _ = _step()
    config = LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": {"entropy": {"coefficient": -0.01}}})
    plan = StepPlan.from_mask(config, mask, cu) if kind == "step" else DeferredPlan(config, 8)
    mb = plan.micro_batch(slice(None), mask, cu)
    with pytest.raises(ValueError, match=r"the config has the terms entropy besides 'pg'.*got one tensor \(it would be the PG term alone\)"):
        plan.loss(values["pg"], mb)
    # the mapping of both is served
    j = plan.loss({"pg": values["pg"], "entropy": values["entropy"]}, mb)
    assert j.dtype == torch.float64


@pytest.mark.parametrize("kind", ["step", "deferred"])
def test_a_micro_batch_is_its_plans_and_alone(kind):
    lengths, cu, mask, values, _ = _step()
    config = LossAggregationConfig()

    def make():
        return StepPlan.from_mask(config, mask, cu) if kind == "step" else DeferredPlan(config, 8)

    plan, other = make(), make()
    mb = other.micro_batch(slice(None), mask, cu)
    with pytest.raises(ValueError, match="the MicroBatch was made by another plan"):
        plan.loss(values["pg"], mb)
    mine = plan.micro_batch(slice(None), mask, cu)
    with pytest.raises(TypeError, match="a MicroBatch already holds its samples and layout"):
        plan.loss(values["pg"], mine, slice(None))
    with pytest.raises(TypeError, match="pass a MicroBatch"):
        plan.loss(values["pg"], mask)
    assert "8 samples, packed" in repr(mine) and mine.num_samples == 8 and mine.names == ("pg",)


def test_a_deferred_micro_batch_that_never_ran_its_loss_is_named_at_close():
    lengths, cu, mask, values, _ = _step()
    plan = DeferredPlan(LossAggregationConfig(), 8)
    first = plan.micro_batch(torch.arange(0, 4), mask, cu, step_layout=True)
    plan.micro_batch(torch.arange(4, 8), mask, cu, step_layout=True)
    plan.loss(values["pg"][first.tokens], first)
    with pytest.raises(ValueError, match=r"1 micro-batch\(es\) made by micro_batch\(\) never ran loss\(\) \(the first holds samples 4, 5, 6, 7\)"):
        plan.close()


@pytest.mark.parametrize("kind", ["step", "deferred"])
def test_cut_from_the_step_layout_equals_the_hand_cut_micro_batch(kind):
    lengths, cu, mask, values, _ = _step(seed=3)
    config = LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": {"entropy": {"coefficient": -0.01}}})
    names = ("pg", "entropy")

    def plan_of():
        return StepPlan.from_mask(config, mask, cu) if kind == "step" else DeferredPlan(config, 8)

    by_hand, cut = plan_of(), plan_of()
    for lo, hi in ((0, 3), (3, 8)):
        samples = torch.arange(lo, hi)
        tokens = slice(int(cu[lo]), int(cu[hi]))
        a = by_hand.loss({n: values[n][tokens] for n in names}, mask[tokens], samples, cu[lo : hi + 1] - cu[lo])
        mb = cut.micro_batch(samples, mask, cu, step_layout=True)
        assert mb.tokens == tokens and torch.equal(mb.cu_seqlens, cu[lo : hi + 1] - cu[lo])
        b = cut.loss({n: values[n][mb.tokens] for n in names}, mb)
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="samples must be consecutive positions to cut a micro-batch from the step's packed layout"):
        plan_of().micro_batch(torch.tensor([0, 2]), mask, cu, step_layout=True)
    # padded: the rows of the samples
    padded_mask = torch.ones(8, 5, dtype=torch.bool)
    padded = StepPlan.from_mask(LossAggregationConfig(), padded_mask)
    mb = padded.micro_batch(torch.tensor([1, 5]), padded_mask, step_layout=True)
    assert mb.mask.shape == (2, 5) and mb.tokens.tolist() == [1, 5]
    assert padded.micro_batch(torch.arange(2, 4), padded_mask, step_layout=True).tokens == slice(2, 4)


# ------------------------------------------------------------------------- several dtypes
def test_a_deferred_plan_serves_terms_of_several_dtypes():
    lengths, cu, mask, values, _ = _step(seed=5)
    config = LossAggregationConfig.from_dict({"mode": "token_mean", "terms": TERMS})
    plan = DeferredPlan(config, 8)
    dtypes = {"pg": torch.float32, "entropy": torch.float64, "kl": torch.bfloat16}
    leaves = {n: values[n].to(dt).requires_grad_(True) for n, dt in dtypes.items()}
    final = mask & (values["pg"] < 1.0)
    for lo, hi in ((0, 4), (4, 8)):
        mb = plan.micro_batch(torch.arange(lo, hi), final, cu, step_layout=True)
        j, parts = plan.loss({n: v[mb.tokens] for n, v in leaves.items()}, mb, parts=True)
        assert j.dtype == torch.float64 and parts["pg"].dtype == torch.float32 and parts["entropy"].dtype == torch.float64
        (j * 1.0).backward()
    step = plan.close()
    rounded = {n: v.detach().to(torch.float64) for n, v in leaves.items()}
    want = _whole_step(config, rounded, final, cu)
    assert abs(step.loss - want.item()) <= 1e-5 * max(1.0, abs(want.item()))  # float32 and bfloat16 accumulate in float32
    for n, v in leaves.items():
        ref = {k: t.clone().requires_grad_(k == n) for k, t in rounded.items()}
        (g,) = torch.autograd.grad(_whole_step(config, ref, final, cu), ref[n])
        assert torch.allclose(v.grad.to(torch.float64) * step.scale, g, rtol=1e-2 if v.dtype == torch.bfloat16 else 1e-6, atol=1e-7), n


# ---------------------------------------------------------------------- compiled whole
def _loss_function(plan, logits, mb):
    """A trainer's loss function: per-token terms from the model's output, then the plan's reduction."""
    logp = torch.nn.functional.logsigmoid(logits)
    values = {"pg": -logp * 0.7, "entropy": -(logp.exp() * logp), "kl": (logp + 0.1) ** 2}
    return plan.loss(values, mb)


@pytest.mark.parametrize("kind", ["step", "deferred"])
def test_a_loss_function_compiles_whole_with_terms_and_weights(kind, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch._dynamo.reset()
    lengths, cu, mask, values, weights = _step(seed=7)
    settings = {"mode": "sample_mean", "weighting": "mean", "terms": {"entropy": {"coefficient": -0.01, "weighting": "mean"}}}
    settings["terms"]["kl"] = {"mode": "sample_mean", "coefficient": 0.05, "weighting": "mean"}
    config = LossAggregationConfig.from_dict(settings)
    logits = torch.randn(int(cu[-1]), dtype=torch.float32)
    compiled = torch.compile(_loss_function, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (_loss_function, compiled):
        plan = StepPlan.from_mask(config, mask, cu, sample_weights=weights) if kind == "step" else DeferredPlan(config, 8, sample_weights=weights)
        leaf = logits.clone().requires_grad_(True)
        total = 0.0
        for lo, hi in ((0, 5), (5, 8)):
            mb = plan.micro_batch(torch.arange(lo, hi), mask, cu, step_layout=True)
            j = fn(plan, leaf[mb.tokens], mb)
            j.backward()
            total = total + j.detach()
        step = plan.close() if kind == "deferred" else None
        results.append((total, leaf.grad, step))
    (eager, eager_grad, eager_step), (comp, comp_grad, comp_step) = results
    assert torch.equal(eager, comp) and torch.equal(eager_grad, comp_grad)
    if kind == "deferred":  # the compiled loss recorded its terms' J_k for close()
        assert eager_step.terms == comp_step.terms and eager_step.loss == comp_step.loss


def test_values_and_metrics_are_named_as_the_user_passed_them():
    """A term given by name is named by it (values['kl']), never by its position among the op's
    arguments; so is a metric."""
    lengths, cu, mask, values, _ = _step()
    plan = StepPlan.from_mask(LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": {"kl": {"coefficient": 0.1}}}), mask, cu)
    mb = plan.micro_batch(slice(None), mask, cu)
    pg = values["pg"]
    with pytest.raises(TypeError, match=r"StepPlan.loss: values\['kl'\] must have a floating dtype \(per-token values\), got torch.int64"):
        plan.loss({"pg": pg, "kl": torch.ones_like(pg, dtype=torch.int64)}, mb)
    with pytest.raises(ValueError, match=r"values\['kl'\] is an expanded view .* pass values\['kl'\].contiguous\(\)"):
        plan.loss({"pg": pg, "kl": torch.ones((), dtype=torch.float64).expand(pg.shape)}, mb)
    with pytest.raises(TypeError, match=r"metrics\['kl_metric'\] must have a floating dtype, got torch.int64"):
        plan.metrics({"kl_metric": torch.ones_like(pg, dtype=torch.int64)}, mb)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed process group .* got str 'dp'"):
        StepPlan.from_mask(LossAggregationConfig(), mask, cu, process_group="dp")


def test_slices_lists_and_layouts_are_named_as_the_user_wrote_them():
    """Slices that do not step forward or have no integer bounds, cu_seqlens given as a list, a packed mask without
    its cu_seqlens, a step layout whose offsets do not end at its mask's tokens: each refused naming the argument,
    for both plans (never torch's or Python's own error)."""
    cfg = LossAggregationConfig()
    m, cu = torch.ones(6, dtype=torch.bool), torch.tensor([0, 1, 2, 3, 4, 5, 6])
    plans = (StepPlan(cfg, torch.ones(6)), DeferredPlan(cfg, 6))
    for plan in plans:
        for bad, kind, text in (
            (slice(None, None, -1), ValueError, "samples as a slice must step forward .* got step=-1"),
            (slice(0, 6, 0), ValueError, "samples as a slice must step forward .* got step=0"),
            (slice("a", None), TypeError, "samples as a slice must have integer bounds, got start='a'"),
        ):
            with pytest.raises(kind, match=text):
                plan.micro_batch(bad, m, cu)
        with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int32/int64 tensor .* got list"):
            plan.micro_batch(slice(0, 6), m, cu.tolist())
        with pytest.raises(ValueError, match=r"mask has shape \(6,\) and cu_seqlens is None: a packed \[T\] mask needs cu_seqlens"):
            plan.micro_batch(slice(0, 6), m)
    with pytest.raises(ValueError, match=r"with step_layout=True, .* cu_seqlens ends at 6, the mask has shape \(5,\)"):
        plans[0].micro_batch(slice(0, 2), m[:5], cu, step_layout=True)


@pytest.mark.parametrize("kind", ["step", "deferred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_usual_call_of_a_whole_loss_has_the_bits_and_checks_of_the_general_route(kind, dtype):
    """``plan.loss(values, mb)`` with every term's tensor by name takes a short route (lossagg/micro_batch.py):
    the same J and gradients, bit for bit, as the general route (``parts=True``), on micro-batches cut by a
    slice (their [K, B] tables contiguous, copied once when made) and by positions; a mask made under
    ``torch.inference_mode()`` is still refused by name when the values require grad."""
    lengths, cu, mask, values, weights = _step(seed=3, n=8)
    if kind == "step":
        config = LossAggregationConfig.from_dict({"mode": "sample_mean", "weighting": "mean", "terms": TERMS})
        plan = StepPlan.from_mask(config, mask, cu, sample_weights=weights)
    else:  # a DeferredPlan's terms divide by the PG term's step-level factors
        config = LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": {"entropy": {"coefficient": -0.01}, "kl": {"coefficient": 0.05}}})
    total = 0.0
    for samples in (slice(0, 3), [3, 5, 4], slice(6, 8)):
        lo = [int(cu[i]) for i in (range(8)[samples] if isinstance(samples, slice) else samples)]
        hi = [int(cu[i + 1]) for i in (range(8)[samples] if isinstance(samples, slice) else samples)]
        idx = torch.cat([torch.arange(a, b) for a, b in zip(lo, hi, strict=True)])
        mb_cu = lossagg.cu_seqlens_from_lengths(torch.tensor([b - a for a, b in zip(lo, hi, strict=True)])).long()
        got, want = [], []
        for route in ("usual", "general"):
            leaves = {k: v[idx].to(dtype).requires_grad_(True) for k, v in values.items()}
            if kind == "deferred":
                plan = DeferredPlan(config, 8)
            mb = plan.micro_batch(samples, mask[idx], mb_cu)
            assert all(t is None or t.is_contiguous() for pair in mb.tables.values() for t in pair)
            j = plan.loss(leaves, mb) if route == "usual" else plan.loss(leaves, mb, parts=True)[0]
            j.backward()
            (got if route == "usual" else want).append((j.detach(), [leaves[k].grad for k in leaves]))
        assert torch.equal(got[0][0], want[0][0])
        assert all(torch.equal(a, b) for a, b in zip(got[0][1], want[0][1], strict=True))
        total += float(got[0][0])
    if kind == "step":
        assert total == pytest.approx(float(_whole_step(config, values, mask, cu, weights=weights)), rel=1e-5)
    with torch.inference_mode():
        frozen = mask.clone()
    if kind == "deferred":
        plan = DeferredPlan(config, 8)
    mb = plan.micro_batch(slice(None), frozen, cu)
    leaves = {k: v.to(dtype).requires_grad_(True) for k, v in values.items()}
    with pytest.raises(ValueError, match=r"mask was made under torch.inference_mode\(\)"):
        plan.loss(leaves, mb)
