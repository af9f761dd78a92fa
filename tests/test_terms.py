"""The whole loss: several terms, each with its own reducer and coefficient, in one plan and one
pass (docs/terms.md). ``J = Σ_k c_k J_k``; every term is checked against the float64 reference
of its own mode (lossagg.testing.reference_loss, docs/modes.md), over micro-batch splits, and
across DP x CP ranks in gloo processes with the plan's all-reduces counted."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import worlds
from batches import per_prompt, sessions_in
from worlds import dp_cp_groups

import lossagg
from lossagg import ConfigError, LossAggregationConfig, StepPlan
from lossagg.cli import main as cli_main
from lossagg.testing import check_split_invariance, reference_loss

N_PER_PROMPT = 4


def batch(seed=0, n=12, dtype=torch.float64, padded=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 24, (n,), generator=g)
    lengths[3] = 0  # an empty sample
    cu = lossagg.cu_seqlens_from_lengths(lengths).long()
    total = int(cu[-1])
    mask = torch.rand(total, generator=g) < 0.8
    mask[int(cu[5]) : int(cu[6])] = False  # a fully masked sample
    values = {name: torch.randn(total, generator=g).to(dtype) for name in ("pg", "entropy", "kl", "nll")}
    groups = torch.arange(n) // N_PER_PROMPT
    if padded:
        width = int(lengths.max())
        pmask = torch.zeros(n, width, dtype=torch.bool)
        pvalues = {k: torch.zeros(n, width, dtype=dtype) for k in values}
        for i in range(n):
            a, b = int(cu[i]), int(cu[i + 1])
            pmask[i, : b - a] = mask[a:b]
            for k in values:
                pvalues[k][i, : b - a] = values[k][a:b]
        return pvalues, pmask, None, groups
    return values, mask, cu, groups


def term_config(pg="prompt_mean", **terms):
    settings = {"mode": pg, "n_samples_per_prompt": N_PER_PROMPT, **lossagg.MODES[pg].example_settings}
    settings["terms"] = terms or {"entropy": {"coefficient": -0.01}, "kl": {"mode": "token_mean", "coefficient": 0.05}}
    return LossAggregationConfig.from_dict(settings)


def weighted_reference(config, values, mask, cu, groups, weights, weighting):
    """J of one term with per-sample weights, from the float64 reference of its mode (docs/terms.md):
    J is linear in the numerators, so ``multiply`` is the reference of the values times their
    sample's weight; a weighted mean has the mode's sample count (N, or c(N') under skip) replaced
    by the weights' sum over the samples that count (every one, or the non-empty ones under skip)."""
    if weighting == "none":
        return reference_loss(config, values, mask, cu, groups, session_index=sessions_in(groups))
    per_token = torch.repeat_interleave(weights, cu[1:] - cu[:-1])
    j = reference_loss(config, values * per_token, mask, cu, groups, session_index=sessions_in(groups))
    if weighting == "multiply":
        return j
    counted = lossagg.token_counts(mask, cu) > 0 if config.empty_samples == "skip" else torch.ones(weights.shape[0], dtype=torch.bool)
    n = max(int(counted.sum()), 1) if config.empty_samples == "skip" else weights.shape[0]
    w = weights[counted].sum() if weighting == "mean" else weights[counted].abs().sum()
    return j * n / (w if w != 0 else 1.0)


def reference(config, values, mask, cu, groups, weights=None):
    """Σ_k c_k J_k, each J_k the float64 reference of the term's own mode (weighted as the term says)."""
    base = {"empty_samples": config.empty_samples}
    pg = LossAggregationConfig.from_dict({"mode": config.mode, **({"divisor": config.divisor} if config.divisor else {}), **base})
    total = weighted_reference(pg, values["pg"], mask, cu, groups, weights, config.weighting)
    for name, term in config.terms.items():
        c = LossAggregationConfig.from_dict({"mode": term.mode, **({"divisor": term.divisor} if term.divisor else {}), **base})
        total = total + term.coefficient * weighted_reference(c, values[name], mask, cu, groups, weights, term.weighting)
    return total


# ---------------------------------------------------------------------- config
def test_a_term_without_a_mode_gets_the_default_reducer_and_a_note():
    config = term_config()
    assert config.terms["entropy"].mode == "sample_mean" and config.terms["kl"].mode == "token_mean"
    assert "terms.entropy.mode unset: the default reducer under mode=prompt_mean, sample_mean" in config.resolution_notes
    token_level = LossAggregationConfig.from_dict({"mode": "token_mean", "terms": {"entropy": {"coefficient": -1}}})
    assert token_level.terms["entropy"].mode == "token_mean" and token_level.terms["entropy"].coefficient == -1.0
    assert LossAggregationConfig().terms == {}


@pytest.mark.parametrize(
    ("terms", "path", "message"),
    [
        ({"pg": {}}, "terms.pg", "the term name 'pg' is the PG term"),
        ({"Entropy": {}}, "terms.Entropy", "a term's name must be lower case letters"),
        ({"x": {"mode": "constant"}}, "terms.x.divisor", "the term's mode=constant needs divisor"),
        ({"x": {"divisor": 2.0}}, "terms.x.divisor", "divisor is only used with a mode that divides by L"),
        ({"x": {"mode": "nope"}}, "terms.x.mode", "unknown mode 'nope'; a term's reducer is one of"),
        ({"x": {"coefficient": float("nan")}}, "terms.x.coefficient", "finite number"),
        ({"x": {"coefficient": "1"}}, "terms.x.coefficient", "valid number"),
        ({"x": {"coefficient": True}}, "terms.x.coefficient", "valid number"),
        ({"x": {"weight": 1.0}}, "terms.x.weight", "unknown setting"),
    ],
)
def test_a_bad_term_is_refused_by_its_path(terms, path, message):
    with pytest.raises(ConfigError) as got:
        LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": terms})
    assert any(p == path and message in m for p, m in got.value.issues), got.value.issues


def test_a_grouped_term_keeps_the_groups_whole():
    with pytest.raises(ConfigError, match="terms.x.mode: under the term's mode=prompt_mean global_batch_size"):
        LossAggregationConfig.from_dict({"n_samples_per_prompt": 4, "global_batch_size": 10, "terms": {"x": {"mode": "prompt_mean"}}})


def test_flags_give_the_terms_and_name_the_flag():
    parser = lossagg.add_loss_aggregation_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--loss-aggregation", "prompt_mean", "--loss-aggregation-term", "entropy:-0.01", "--loss-aggregation-term", "kl:0.05:token_mean"]
    )
    config = lossagg.config_from_args(args)
    assert config.terms["kl"].mode == "token_mean" and config.terms["entropy"].coefficient == -0.01
    for argv, message in (
        (["--loss-aggregation-term", "x"], "--loss-aggregation-term: expected NAME:COEFFICIENT[:MODE[:DIVISOR]]"),
        (["--loss-aggregation-term", "x:abc"], "--loss-aggregation-term: the coefficient of term 'x' must be a number, got 'abc'"),
        (["--loss-aggregation-term", "x:1", "--loss-aggregation-term", "x:2"], "term 'x' is given twice"),
        (["--loss-aggregation-term", "x:1:constant"], "--loss-aggregation-term x.divisor: the term's mode=constant needs divisor"),
        (["--loss-aggregation-term", "x:1:constant:0"], "--loss-aggregation-term x.divisor"),
    ):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            lossagg.config_from_args(parser.parse_args(argv))


def test_the_schema_and_check_know_the_terms(tmp_path, capsys):
    assert cli_main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "terms" in schema["properties"]
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"mode": "prompt_mean", "terms": {"entropy": {"coefficient": -0.01}}}))
    assert cli_main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert '"entropy"' in out and "terms.entropy.mode unset" in out
    path.write_text(json.dumps({"terms": {"x": {"mode": "constant"}}}))
    assert cli_main(["check", str(path)]) == 1
    assert "terms.x.divisor" in capsys.readouterr().err


# ------------------------------------------------------------------------ plan
@pytest.mark.parametrize("empty", ["count", "skip"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("term_mode", list(lossagg.MODES))
def test_every_term_is_its_own_modes_reference(term_mode, padded, empty):
    values, mask, cu, groups = batch(padded=padded)
    packed_values, packed_mask, packed_cu, _ = batch(padded=False)  # the same step, packed, for the reference
    term = {"mode": term_mode, "coefficient": -0.3, **lossagg.MODES[term_mode].example_settings}
    settings = {"mode": "sample_mean", "n_samples_per_prompt": per_prompt(term_mode, N_PER_PROMPT), "empty_samples": empty}
    config = LossAggregationConfig.from_dict({**settings, "terms": {"nll": term, "kl": {"mode": "token_mean", "coefficient": 0.05}}})
    names = ("pg", "nll", "kl")
    leaves = {k: values[k].clone().requires_grad_(True) for k in names}
    plan = StepPlan.from_mask(config, mask, cu, group_index=groups, session_index=sessions_in(groups))
    j = plan.loss(leaves, mask, slice(None), cu)
    ref_leaves = {k: packed_values[k].clone().requires_grad_(True) for k in names}
    want = reference(config, ref_leaves, packed_mask, packed_cu, groups)
    assert abs(j.item() - want.item()) <= 1e-12 * max(1.0, abs(want.item()))
    got_g = torch.autograd.grad(j, [leaves[k] for k in names])
    want_g = torch.autograd.grad(want, [ref_leaves[k] for k in names])
    lengths = (packed_cu[1:] - packed_cu[:-1]).tolist()
    for a, b in zip(got_g, want_g, strict=True):
        if padded:  # the padded gradient's rows, read as the packed tokens
            a = torch.cat([a[i, :n] for i, n in enumerate(lengths)])
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)


def test_micro_batches_add_up_to_the_step():
    values, mask, cu, groups = batch(seed=3)
    config = term_config()
    values = {k: values[k] for k in ("pg", "entropy", "kl")}
    plan = StepPlan.from_mask(config, mask, cu, group_index=groups, session_index=sessions_in(groups))
    whole = plan.loss(values, mask, slice(None), cu)
    total = 0.0
    lengths = cu[1:] - cu[:-1]
    for samples in (torch.tensor([0, 5, 7]), torch.tensor([1, 2, 3, 4]), torch.tensor([6, 8, 9, 10, 11])):
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in samples.tolist()])
        mb_cu = lossagg.cu_seqlens_from_lengths(lengths[samples]).long()
        total = total + plan.loss({k: v[idx] for k, v in values.items()}, mask[idx], samples, mb_cu)
    assert abs(total.item() - whole.item()) <= 1e-12
    assert abs(whole.item() - reference(config, values, mask, cu, groups).item()) <= 1e-12


@pytest.mark.parametrize("mode", list(lossagg.MODES))
def test_the_pg_term_alone_has_the_bits_of_plan_loss(mode):
    values, mask, cu, groups = batch(seed=5, n=40, dtype=torch.float32)
    config = LossAggregationConfig.from_dict({"mode": mode, **lossagg.MODES[mode].example_settings})
    plan = StepPlan.from_mask(config, mask, cu, group_index=groups, session_index=sessions_in(groups))
    v = values["pg"].clone().requires_grad_(True)
    a = plan.loss({"pg": v}, mask, slice(None), cu)
    (ga,) = torch.autograd.grad(a, v)
    b = plan.loss(v, mask, slice(None), cu)
    (gb,) = torch.autograd.grad(b, v)
    assert torch.equal(a, b) and torch.equal(ga, gb)


def test_one_plan_gathers_every_terms_totals_and_from_totals_asks_for_them():
    values, mask, cu, groups = batch()
    config = LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": {"kl": {"mode": "max_length", "coefficient": 0.5}}})
    plan = StepPlan.from_mask(config, mask, cu)
    assert {"num_samples", "max_tokens", "total_tokens"} <= set(plan.totals)
    counts = lossagg.token_counts(mask, cu)
    with pytest.raises(ValueError, match="max_tokens"):
        StepPlan.from_totals(config, counts, num_samples=12)
    given = StepPlan.from_totals(config, counts, num_samples=12, max_tokens=float(counts.max()))
    assert torch.equal(given.term_denoms["kl"], plan.term_denoms["kl"])


def test_a_grouped_term_without_groups_is_named():
    values, mask, cu, groups = batch()
    config = LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": {"nll": {"mode": "prompt_mean"}}})
    with pytest.raises(ValueError, match=r"group_index is required under mode=prompt_mean \(the reducer of term 'nll'\)"):
        StepPlan.from_mask(config, mask, cu)


def test_the_terms_given_must_be_the_configs():
    values, mask, cu, groups = batch()
    plan = StepPlan.from_mask(term_config(), mask, cu, group_index=groups, session_index=sessions_in(groups))
    with pytest.raises(ValueError, match="missing kl"):
        plan.loss({"pg": values["pg"], "entropy": values["entropy"]}, mask, slice(None), cu)
    with pytest.raises(ValueError, match="not terms of the config: 'nll'"):
        plan.loss(values, mask, slice(None), cu)
    three = {k: values[k] for k in ("pg", "entropy", "kl")}
    with pytest.raises(ValueError, match=r"values\['kl'\] must be a tensor with the token shape of the micro-batch's mask"):
        plan.loss({**three, "kl": values["kl"][:-1]}, mask, slice(None), cu)
    mixed = plan.loss({**three, "kl": values["kl"].float()}, mask, slice(None), cu)  # each term in its own dtype
    assert mixed.dtype == torch.float64 and abs(mixed.item() - plan.loss(three, mask, slice(None), cu).item()) < 1e-6
    with pytest.raises(TypeError, match=r"values must be a tensor \(the PG term\) or a mapping"):
        plan.loss([values["pg"]], mask, slice(None), cu)


# ---------------------------------------------------------- DP x CP, gloo processes
DP, CP, MICRO_BATCHES = 2, 2, 2


def _model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


def _step():
    g = torch.Generator().manual_seed(21)
    n = 4 * N_PER_PROMPT
    lengths = torch.randint(0, 26, (n,), generator=g)
    lengths[2] = 0
    cu = lossagg.cu_seqlens_from_lengths(lengths).long()
    total = int(cu[-1])
    features = torch.randn(total, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(total, generator=g) < 0.75
    groups = torch.arange(n) // N_PER_PROMPT
    return features, mask, cu, groups


def _weights():
    return torch.linspace(-0.5, 2.0, 4 * N_PER_PROMPT, dtype=torch.float64)


def _weighted_config():
    return LossAggregationConfig.from_dict({**term_config().model_dump(exclude_unset=True), "weighting": "multiply"})


def _terms_of(model, features):
    out = model(features)
    return {"pg": out[:, 0] ** 2, "entropy": torch.tanh(out[:, 1]), "kl": out[:, 2].exp()}


def _worker(rank, world, init_file, results_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    dp_rank, cp_rank, dp_group, _ = dp_cp_groups(rank, DP, CP)
    features, mask, cu, groups = _step()
    n = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    own = torch.tensor_split(torch.arange(n), DP)[dp_rank]
    config = _weighted_config()
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(k.get("op")), real(*a, **k))[1]
    try:
        counts = lossagg.token_counts(mask, cu)[own]
        labels = n // N_PER_PROMPT
        plan = StepPlan(config, counts, group_index=groups[own], process_group=dp_group, num_group_labels=labels, sample_weights=_weights()[own])
    finally:
        dist.all_reduce = real
    model = _model()
    for mb_local in torch.tensor_split(torch.arange(own.numel()), MICRO_BATCHES):
        mb = own[mb_local]
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in mb.tolist()] + [torch.zeros(0, dtype=torch.long)])
        mb_cu = lossagg.cu_seqlens_from_lengths(lengths[mb]).long()
        local_cu = lossagg.zigzag_local_cu_seqlens(mb_cu, CP)
        local_features = lossagg.zigzag_shard(features[idx].T, mb_cu, CP, cp_rank).T
        local_mask = lossagg.zigzag_shard(mask[idx], mb_cu, CP, cp_rank, pad_value=False)
        plan.loss(_terms_of(model, local_features), local_mask, mb_local, local_cu).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    ref_model = _model()
    reference(config, _terms_of(ref_model, features), mask, cu, groups, weights=_weights()).backward()
    failures = [f"rank {rank}: the plan made {len(calls)} all-reduces ({calls}), not one sum"] if calls != [dist.ReduceOp.SUM] else []
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        if not torch.allclose(p.grad, r.grad, rtol=1e-10, atol=1e-13):
            failures.append(f"rank {rank}: max gradient error {(p.grad - r.grad).abs().max():.3g}")
    with open(os.path.join(results_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures))
    dist.destroy_process_group()


@pytest.mark.xdist_group("engines")
def test_dp2_cp2_whole_loss_gradient_equals_the_unsplit_step(tmp_path):
    """pg on prompt_mean with per-sample weights, entropy on sample_mean, KL on token_mean, over 2
    micro-batches × DP 2 × CP 2: the summed gradients are the unsplit step's (float64), and the
    plan makes one sum all-reduce."""
    world = DP * CP
    worlds.start(_worker, (world, tempfile.mktemp(dir=tmp_path), str(tmp_path)), world)
    failures = [t for r in range(world) if (t := (tmp_path / f"rank{r}.txt").read_text())]
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ the Megatron adapter
@pytest.mark.parametrize("per_token", [False, True])
def test_the_megatron_loss_func_returns_the_whole_loss(per_token):
    from lossagg.integrations.megatron import make_loss_func

    values, mask, cu, groups = batch(seed=8)
    values = {k: values[k] for k in ("pg", "entropy", "kl")}
    config = term_config(pg="token_mean" if per_token else "prompt_mean")
    plan = StepPlan.from_mask(config, mask, cu, group_index=groups, session_index=sessions_in(groups))
    lengths = cu[1:] - cu[:-1]
    total, tokens, reports = 0.0, 0, {}
    for samples in (torch.arange(0, 6), torch.arange(6, 12)):
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in samples.tolist()])
        mb_cu = lossagg.cu_seqlens_from_lengths(lengths[samples]).long()
        loss_func = make_loss_func(plan, samples, mb_cu, mask[idx], num_micro_batches=2, calculate_per_token_loss=per_token)
        out = loss_func({k: v[idx] for k, v in values.items()})
        # Megatron's treatment: divide by the micro-batches (off) or by the summed num_tokens (on)
        total = total + (out[0] / 2 if not per_token else out[0])
        for k, v in out[-1].items():
            reports[k] = reports.get(k, 0.0) + v
        if per_token:
            tokens = tokens + out[1]
    if per_token:
        total = total / tokens
    assert abs(total.item() - reference(config, values, mask, cu, groups).item()) <= 1e-12
    assert set(reports) == {"pg_loss", "entropy_loss", "kl_loss"}
    single = LossAggregationConfig.from_dict({"mode": "token_mean"})
    assert abs(reports["kl_loss"].item() - reference_loss(single, values["kl"], mask, cu).item()) <= 1e-12
    with pytest.raises(TypeError, match="output_tensor must be a mapping of every term's per-token values"):
        make_loss_func(plan, torch.arange(0, 12), cu, mask, num_micro_batches=1)(values["pg"])


# ---------------------------------------------------------------- per-sample weights
def _weights_for(n, seed=4):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g, dtype=torch.float64) * 2.5 - 0.5  # some negative, none zero


@pytest.mark.parametrize("empty", ["count", "skip"])
@pytest.mark.parametrize("weighting", ["multiply", "mean", "abs_mean"])
@pytest.mark.parametrize("mode", list(lossagg.MODES))
def test_a_weighted_term_is_its_reference(mode, weighting, empty):
    spec = lossagg.MODES[mode]
    has_n = isinstance(spec.denoms, lossagg.DenomProduct) and "N" in spec.denoms.factors
    settings = {
        "mode": mode,
        "weighting": weighting,
        "empty_samples": empty,
        "n_samples_per_prompt": per_prompt(mode, N_PER_PROMPT),
        **spec.example_settings,
    }
    if weighting != "multiply" and not has_n:
        with pytest.raises(ConfigError, match=f"weighting={weighting} replaces the sample count N"):
            LossAggregationConfig.from_dict(settings)
        return
    values, mask, cu, groups = batch(seed=9)
    weights = _weights_for(cu.numel() - 1)
    config = LossAggregationConfig.from_dict({**settings, "terms": {"kl": {"mode": "token_mean", "coefficient": 0.5, "weighting": "multiply"}}})
    plan = StepPlan.from_mask(config, mask, cu, group_index=groups, session_index=sessions_in(groups), sample_weights=weights)
    leaves = {k: values[k].clone().requires_grad_(True) for k in ("pg", "kl")}
    j = plan.loss(leaves, mask, slice(None), cu)
    ref_leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    want = reference(config, ref_leaves, mask, cu, groups, weights=weights)
    assert abs(j.item() - want.item()) <= 1e-12 * max(1.0, abs(want.item()))
    for a, b in zip(torch.autograd.grad(j, list(leaves.values())), torch.autograd.grad(want, list(ref_leaves.values())), strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)
    # the PG term's own part of plan.loss, and its split into micro-batches
    detached = {k: t.detach() for k, t in leaves.items()}
    whole = plan.loss(detached, mask, slice(None), cu, parts=True)[1]["pg"]
    v = detached["pg"]
    assert (
        abs(
            whole.item()
            - weighted_reference(LossAggregationConfig.from_dict({**settings, "weighting": "none"}), v, mask, cu, groups, weights, weighting).item()
        )
        <= 1e-12
    )
    lengths = cu[1:] - cu[:-1]
    parts = 0.0
    for samples in (torch.arange(0, 5), torch.arange(5, 12)):
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in samples.tolist()])
        share = {k: t[idx] for k, t in detached.items()}
        parts = parts + plan.loss(share, mask[idx], samples, lossagg.cu_seqlens_from_lengths(lengths[samples]).long(), parts=True)[1]["pg"]
    assert abs(parts.item() - whole.item()) <= 1e-12


def _padded_of(values, mask, cu):
    n, width = cu.numel() - 1, int((cu[1:] - cu[:-1]).max())
    pv, pm = torch.zeros(n, width, dtype=values.dtype), torch.zeros(n, width, dtype=torch.bool)
    for i in range(n):
        a, b = int(cu[i]), int(cu[i + 1])
        pv[i, : b - a], pm[i, : b - a] = values[a:b], mask[a:b]
    return pv, pm


def test_trl_weighted_nll_is_sample_mean_with_abs_mean_weights():
    """TRL's weighted_nll (huggingface/trl PR #5952, head 349a4cb2f, closed unmerged;
    trl/trainer/sft_trainer.py:850-857, the branch without num_items_in_batch), transcribed in
    float64: per_sample_loss = (l * valid).sum(-1) / valid.sum(-1).clamp(min=1), loss =
    (per_sample_loss * w).sum() / w.abs().sum().clamp(min=1e-8). Over the whole step it is
    sample_mean with weighting=abs_mean (N replaced by Σ|w|)."""
    values, mask, cu, groups = batch(seed=12)
    weights = _weights_for(cu.numel() - 1, seed=13)
    loss_mat, valid = _padded_of(values["pg"], mask, cu)
    per_sample_loss = (loss_mat * valid).sum(-1) / valid.sum(-1).clamp(min=1)
    trl = (per_sample_loss * weights).sum() / weights.abs().sum().clamp(min=1e-8)
    config = LossAggregationConfig(mode="sample_mean", weighting="abs_mean")
    ours = StepPlan.from_mask(config, mask, cu, sample_weights=weights).loss(values["pg"], mask, slice(None), cu)
    assert abs(ours.item() - trl.item()) <= 1e-12 * abs(trl.item())


def test_roll_weights_are_multiply():
    """ROLL's agg_loss with weights (alibaba/ROLL 8eb27cc, roll/utils/functionals.py:249-268, and
    masked_mean at 285-297), transcribed in float64 for one DP rank: seq-mean-token-mean is
    (masked_mean(l, m) * w * valid).sum() / (valid.sum() + 1e-8), sample_mean with
    empty_samples=skip and weighting=multiply (to about 1e-8, ROLL's epsilon); token-mean is
    (l * w[:, None]).sum() / m.sum() over a loss already zero off the mask, token_mean with
    weighting=multiply."""
    values, mask, cu, groups = batch(seed=14)
    weights = _weights_for(cu.numel() - 1, seed=15)
    loss_mat, m = _padded_of(values["pg"], mask, cu)
    m = m.to(torch.float64)
    mask_sum = m.sum(-1)
    seq = torch.where(mask_sum > 0, (loss_mat * m).sum(-1) / (mask_sum + 1e-8), torch.zeros_like(mask_sum))
    valid = (mask_sum > 0).to(torch.float64)
    roll_seq = (seq * weights * valid).sum() / (valid.sum() + 1e-8)
    roll_token = ((loss_mat * m) * weights.unsqueeze(-1)).sum() / m.sum()
    for settings, want in (({"mode": "sample_mean", "empty_samples": "skip"}, roll_seq), ({"mode": "token_mean"}, roll_token)):
        config = LossAggregationConfig.from_dict({**settings, "weighting": "multiply"})
        ours = StepPlan.from_mask(config, mask, cu, sample_weights=weights).loss(values["pg"], mask, slice(None), cu)
        assert abs(ours.item() - want.item()) <= 1e-7 * abs(want.item()), settings


def test_the_edges_of_weights_are_defined():
    values, mask, cu, groups = batch(seed=16)
    n = cu.numel() - 1
    v = values["pg"].clone().requires_grad_(True)
    # every weight zero under abs_mean: J = 0 and zero gradients (TRL's clamp gives the same)
    plan = StepPlan.from_mask(LossAggregationConfig(weighting="abs_mean"), mask, cu, sample_weights=torch.zeros(n, dtype=torch.float64))
    j = plan.loss(v, mask, slice(None), cu)
    (g,) = torch.autograd.grad(j, v)
    assert j.item() == 0.0 and not g.any()
    # a signed mean whose weights sum to 0 or less: refused, naming the total
    with pytest.raises(ValueError, match="weight_sum=0"):
        StepPlan.from_mask(
            LossAggregationConfig(weighting="mean"), mask, cu, sample_weights=torch.tensor([1.0, -1.0] * (n // 2), dtype=torch.float64)
        )
    bad = torch.ones(n, dtype=torch.float64)
    bad[7] = float("nan")
    with pytest.raises(ValueError, match=r"sample_weights\[7\] is nan: every weight must be finite"):
        StepPlan.from_mask(LossAggregationConfig(weighting="multiply"), mask, cu, sample_weights=bad)
    with pytest.raises(ValueError, match="pass sample_weights= to StepPlan"):
        StepPlan.from_mask(LossAggregationConfig(weighting="multiply"), mask, cu)
    with pytest.raises(ValueError, match="no term of the config uses them"):
        StepPlan.from_mask(LossAggregationConfig(), mask, cu, sample_weights=torch.ones(n, dtype=torch.float64))
    with pytest.raises(ValueError, match=f"one weight per sample of this rank \\({n}\\)"):
        StepPlan.from_mask(LossAggregationConfig(weighting="multiply"), mask, cu, sample_weights=torch.ones(n + 1))
    # from_totals asks for the weights' sum by name
    counts = lossagg.token_counts(mask, cu)
    with pytest.raises(ValueError, match="abs_weight_sum"):
        StepPlan.from_totals(LossAggregationConfig(weighting="abs_mean"), counts, sample_weights=torch.ones(n, dtype=torch.float64), num_samples=n)
    given = StepPlan.from_totals(
        LossAggregationConfig(weighting="abs_mean"), counts, sample_weights=torch.ones(n, dtype=torch.float64), num_samples=n, abs_weight_sum=2.0 * n
    )
    whole = StepPlan.from_mask(LossAggregationConfig(weighting="abs_mean"), mask, cu, sample_weights=torch.ones(n, dtype=torch.float64))
    assert torch.allclose(given.sample_denoms * 1.0, whole.sample_denoms * 2.0)


def test_routes_that_reduce_one_term_refuse_a_config_with_more():
    """aggregate, the references and the TRL trainer reduce the PG term alone, unweighted: a config
    with terms or a weighting is refused there, never half-applied."""
    values, mask, cu, groups = batch()
    for config in (term_config(), LossAggregationConfig(weighting="multiply")):
        for route in (
            lambda c: lossagg.aggregate(c, values["pg"], mask, cu_seqlens=cu, group_index=groups),
            lambda c: lossagg.aggregate(c, values["pg"], mask, cu_seqlens=cu, group_index=groups, rollout_mask=mask.clone()),
            lambda c: reference_loss(c, values["pg"], mask, cu, groups),
            lambda c: check_split_invariance(c, values["pg"], mask, cu, group_index=groups),
        ):
            with pytest.raises(ValueError, match="reduces the PG term alone, unweighted, and the config asks for"):
                route(config)


def test_weights_that_require_grad_are_refused_naming_them():
    """The loss is not differentiable in the samples' weights: given with requires_grad, they are
    refused by name (never silently detached, leaving w.grad None)."""
    values, mask, cu, groups = batch()
    n = cu.numel() - 1
    w = torch.rand(n, dtype=torch.float64, requires_grad=True)
    for make in (
        lambda: StepPlan.from_mask(LossAggregationConfig(weighting="mean"), mask, cu, sample_weights=w),
        lambda: lossagg.DeferredPlan(LossAggregationConfig(weighting="mean"), n, sample_weights=w),
    ):
        with pytest.raises(ValueError, match=r"sample_weights require grad.*pass sample_weights.detach\(\)"):
            make()
