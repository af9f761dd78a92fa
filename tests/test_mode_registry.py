"""A mode registered at run time goes through everything with no other change.

The throwaway mode below (``d[i] = N · c(M[i])²``: nonsense, but well defined) is
registered by the test itself and run through the config (round trip, spellings, JSON
Schema, argparse flags), ``lossagg check``, the demo's options, the planner over
micro-batch × DP × CP splits (one process, and DP 2 × CP 2 over gloo), ``from_totals``, the
verl, Megatron and TRL adapters, against its own reference formula. Then the registry's
refusals: names taken by modes, aliases or refused names, malformed entries, and a mode that
reads a total it did not declare.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import threading
import time

import pytest
import torch
import worlds
from batches import random_float64_step

import lossagg
from lossagg.modes import ModeSpec, register_mode, unregister_mode
from lossagg.step import plan_info
from lossagg.testing import check_split_invariance, rank_totals, reference_loss

THROWAWAY = "sample_sq"


def _c(x):
    return max(float(x), 1.0)


def throwaway_spec(**changes) -> ModeSpec:
    fields = dict(
        name=THROWAWAY,
        summary="each sample's token sum over its squared length (a test mode)",
        formula="(1/N) Σ_i Σ_t m·l / c(M[i])²",
        denom_formula="N · c(M[i])²",
        totals=("num_samples",),
        denoms=lambda x: x.totals.num_samples * x.token_counts.clamp(min=1.0) ** 2,
        reference=lambda r: sum(num / _c(m) ** 2 for num, m in zip(r.numerators, r.token_counts, strict=True)) / len(r.numerators),
    )
    fields.update(changes)
    return ModeSpec(**fields)


def register_throwaway():
    """Picklable, for spawned ranks: the registry is per process."""
    if THROWAWAY not in lossagg.MODES:
        register_mode(throwaway_spec())


@pytest.fixture
def throwaway():
    register_throwaway()
    try:
        yield THROWAWAY
    finally:
        unregister_mode(THROWAWAY)


# ------------------------------------------------------------------ the config
def test_config_round_trip_and_spellings(throwaway):
    config = lossagg.LossAggregationConfig(mode=throwaway)
    assert config.mode == throwaway and config.resolution_notes == ()
    dumped = json.loads(json.dumps(config.summary()))
    dumped.pop("resolution_notes")
    assert lossagg.LossAggregationConfig.from_dict(dumped) == config
    assert lossagg.LossAggregationConfig.from_dict({"mode": " Sample-Sq "}).mode == throwaway


def test_json_schema_lists_it_while_registered(throwaway):
    assert throwaway in lossagg.LossAggregationConfig.model_json_schema()["properties"]["mode"]["enum"]
    unregister_mode(throwaway)
    try:
        assert throwaway not in lossagg.LossAggregationConfig.model_json_schema()["properties"]["mode"]["enum"]
        with pytest.raises(lossagg.ConfigError) as err:
            lossagg.LossAggregationConfig.from_dict({"mode": throwaway})
        assert f"unknown mode '{throwaway}'" in str(err.value) and ", ".join(lossagg.MODES) in str(err.value)
    finally:
        register_throwaway()


def test_lossagg_check_flags_and_demo_options_accept_it(throwaway, tmp_path, capsys):
    from lossagg.cli import build_parser, main

    path = tmp_path / "train.yaml"
    path.write_text(f"lr: 1.0e-6\nloss_aggregation:\n  mode: {throwaway}\n  n_samples_per_prompt: 4\n")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid loss aggregation config" in out and f'"mode": "{throwaway}"' in out

    import argparse

    parser = lossagg.add_loss_aggregation_args(argparse.ArgumentParser())
    assert throwaway in parser.format_help()
    assert lossagg.config_from_args(parser.parse_args(["--loss-aggregation", throwaway])).mode == throwaway
    assert build_parser().parse_args(["demo", "--modes", throwaway]).modes == [throwaway]


# ------------------------------------------------------------------ the maths
def test_reference_is_the_formula(throwaway):
    # samples of 2, 1 and 3 tokens (the second fully masked): J = (1/3) (3/2² + 0 + 6/3²)
    values = torch.tensor([1.0, 2.0, 7.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True, True])
    cu = torch.tensor([0, 2, 3, 6])
    config = lossagg.LossAggregationConfig(mode=throwaway)
    expected = (3 / 4 + 0 + 6 / 9) / 3
    assert reference_loss(config, values, mask, cu).item() == pytest.approx(expected, rel=1e-15)
    assert lossagg.aggregate(config, values, mask, cu_seqlens=cu).item() == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("split", [(1, 1, 1), (3, 1, 1), (2, 2, 1), (1, 2, 2), (2, 3, 3)])
def test_any_split_gives_its_reference(throwaway, split):
    values, mask, cu, groups = random_float64_step()
    micro_batches, dp, cp = split
    config = lossagg.LossAggregationConfig(mode=throwaway, n_samples_per_prompt=4)
    report = check_split_invariance(
        config, values, mask, cu, group_index=groups, micro_batches=micro_batches, dp_size=dp, cp_size=cp, rtol=1e-12, atol=1e-14
    )
    assert report.ok, str(report)


def test_from_totals_takes_its_totals_and_names_a_missing_one(throwaway):
    values, mask, cu, groups = random_float64_step()
    config = lossagg.LossAggregationConfig(mode=throwaway)
    counts = lossagg.token_counts(mask, cu)
    whole = lossagg.StepPlan(config, counts).sample_denoms
    own = torch.arange(5, 11)
    plan = lossagg.StepPlan.from_totals(config, counts[own], **rank_totals(config, counts, own))
    assert torch.equal(plan.sample_denoms, whole[own])
    with pytest.raises(ValueError, match=r"mode=sample_sq needs the step total\(s\) num_samples \(N, samples in the step"):
        lossagg.StepPlan.from_totals(config, counts[own], total_tokens=float(counts.sum()))


@pytest.mark.xdist_group("engines")
def test_dp2_cp2_over_gloo_equals_its_reference(throwaway, tmp_path):
    import test_distributed

    world = test_distributed.DP * test_distributed.CP
    init_file = tempfile.mktemp(dir=tmp_path)
    args = (world, init_file, "mean", str(tmp_path), register_throwaway, [throwaway])
    worlds.start(test_distributed.worker, args, world)
    failures = [(tmp_path / f"rank{r}.txt").read_text() for r in range(world)]
    assert not any(failures), "\n".join(failures)


# ------------------------------------------------------------------ the adapters
def test_verl_adapter_accepts_it(throwaway):
    from lossagg.integrations.verl import agg_loss

    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 0, 8, 3])
    loss_mat = torch.randn(4, 8, generator=g, dtype=torch.float64)
    loss_mask = torch.arange(8)[None, :] < lengths[:, None]
    j = agg_loss(loss_mat, loss_mask, throwaway)
    config = lossagg.LossAggregationConfig(mode=throwaway)
    expected = reference_loss(config, loss_mat.reshape(-1), loss_mask.reshape(-1), torch.arange(0, 33, 8))
    assert j.item() == pytest.approx(expected.item(), rel=1e-12)
    # a micro-batch of a step of 8 samples over 2 DP ranks: N = global_batch_size, d[i] / dp_size as verl's own modes
    assert agg_loss(loss_mat, loss_mask, throwaway, dp_size=2, global_batch_size=8).item() == pytest.approx(expected.item(), rel=1e-12)
    with pytest.raises(ValueError, match="needs global_batch_size"):
        agg_loss(loss_mat, loss_mask, throwaway, dp_size=2)


def test_megatron_adapter_accepts_it(throwaway):
    import test_megatron_loss_func

    for per_token_loss_on in (False, True):
        test_megatron_loss_func.test_megatron_schedule_gives_the_gradient_of_j(throwaway, per_token_loss_on)


def test_trl_adapter_accepts_it(throwaway):
    pytest.importorskip("trl")
    from lossagg.integrations.trl import config_for_loss_type

    assert config_for_loss_type(throwaway, num_generations=4, max_completion_length=16).mode == throwaway


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"name": "sample_mean"}, "mode 'sample_mean' is already registered"),
        ({"name": "grpo"}, "'grpo' is an alias of mode sample_mean"),
        ({"name": "dr_grpo"}, "'dr_grpo' is an alias of mode constant"),
        ({"name": "token_sum"}, "'token-sum' is a refused name"),
        ({"name": "Sample-Sq"}, "ModeSpec.name must be lower case letters"),
        ({"name": ""}, "ModeSpec.name must be lower case letters"),
        ({"totals": ("num_sample",)}, "unknown step total 'num_sample' (did you mean 'num_samples'?)"),
        ({"totals": ()}, "ModeSpec.totals of mode 'sample_sq' must be a non-empty tuple"),
        ({"totals": ["num_samples"]}, "ModeSpec.totals of mode 'sample_sq' must be a non-empty tuple"),
        ({"summary": " "}, "ModeSpec.summary of mode 'sample_sq' must be a non-empty string"),
        ({"denoms": None}, "ModeSpec.denoms of mode 'sample_sq' must be callable"),
        ({"needs_divisor": 1}, "ModeSpec.needs_divisor of mode 'sample_sq' must be a bool"),
        ({"needs_divisor": True}, "example_settings of mode 'sample_sq' do not make a valid config"),
    ],
)
def test_register_refuses_and_registers_nothing(changes, message):
    before = dict(lossagg.MODES)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        register_mode(throwaway_spec(**changes))
    assert dict(lossagg.MODES) == before


def test_register_takes_a_modespec_and_built_ins_stay():
    with pytest.raises(TypeError, match="register_mode takes a lossagg.ModeSpec, got dict"):
        register_mode({"name": "x"})
    with pytest.raises(ValueError, match="mode 'token_mean' is built in and cannot be unregistered"):
        unregister_mode("token_mean")
    with pytest.raises(ValueError, match="mode 'nothing' is not registered"):
        unregister_mode("nothing")


def test_a_total_the_mode_did_not_declare_is_an_error():
    spec = throwaway_spec(name="sneaky", denoms=lambda x: x.token_counts.new_full(x.token_counts.shape, x.totals.total_tokens))
    register_mode(spec)
    try:
        with pytest.raises(AttributeError, match="step total 'total_tokens' was not gathered: mode 'sneaky' does not list it"):
            lossagg.StepPlan(lossagg.LossAggregationConfig(mode="sneaky"), torch.tensor([3, 4]))
    finally:
        unregister_mode("sneaky")


def test_a_mode_returning_the_wrong_shape_is_named():
    register_mode(throwaway_spec(name="scalar_d", denoms=lambda x: x.token_counts.sum()))
    try:
        with pytest.raises(ValueError, match=r"mode=scalar_d: its denoms must return one d\[i\] per local sample \(shape \(2,\)\), got \(\)"):
            lossagg.StepPlan(lossagg.LossAggregationConfig(mode="scalar_d"), torch.tensor([3, 4]))
    finally:
        unregister_mode("scalar_d")


# ------------------------------------------------------------- what a mode's d[i] may be
def _bad_denoms(make):
    return throwaway_spec(name="bad_d", denoms=lambda x: make(x.token_counts))


DENOMS_REFUSED = [
    ("bool", lambda m: m > 0, TypeError, "mode=bad_d: its denoms must return a real floating tensor of d[i], got dtype torch.bool"),
    ("complex", lambda m: m.to(torch.complex128) + 1j, TypeError, "real floating tensor of d[i], got dtype torch.complex128"),
    ("integer", lambda m: m.long() + 1, TypeError, "real floating tensor of d[i], got dtype torch.int64"),
    ("meta", lambda m: torch.ones_like(m, device="meta"), ValueError, "mode=bad_d: its denoms returned a meta tensor (no data)"),
    ("sparse", lambda m: (m + 1).to_sparse(), TypeError, "must return a dense (strided) tensor of d[i], got layout torch.sparse_coo"),
    ("nan", lambda m: m * float("nan"), ValueError, "mode=bad_d: d[0] = nan, but every d[i] must be finite and > 0 (2 of 2 are not)"),
    ("zero", lambda m: m * 0, ValueError, "mode=bad_d: d[0] = 0.0, but every d[i] must be finite and > 0"),
    ("negative", lambda m: -m, ValueError, "mode=bad_d: d[0] = -3.0, but every d[i] must be finite and > 0"),
    ("inf", lambda m: m * float("inf"), ValueError, "mode=bad_d: d[0] = inf, but every d[i] must be finite and > 0"),
    (
        "one_entry_bad",
        lambda m: torch.stack([m[0], -m[1]]),
        ValueError,
        "mode=bad_d: d[1] = -5.0, but every d[i] must be finite and > 0 (1 of 2 are not)",
    ),
    ("not_a_tensor", lambda m: [1.0, 2.0], TypeError, "mode=bad_d: its denoms must return a tensor of d[i] (one per local sample), got list"),
]


@pytest.mark.parametrize(("case", "make", "kind", "message"), DENOMS_REFUSED, ids=[c[0] for c in DENOMS_REFUSED])
def test_a_mode_whose_denoms_are_not_positive_finite_floats_is_refused_by_the_plan(case, make, kind, message):
    """StepPlan checks the d[i] a mode builds (never read True as 1.0 or drop an imaginary part,
    never leave the op to blame sample_denoms, which the user did not pass)."""
    register_mode(_bad_denoms(make))
    try:
        for build in (
            lambda: lossagg.StepPlan({"mode": "bad_d"}, torch.tensor([3.0, 5.0])),
            lambda: lossagg.StepPlan.from_totals({"mode": "bad_d"}, torch.tensor([3.0, 5.0]), num_samples=2),
        ):
            with pytest.raises(kind) as info:
                build()
            assert message in str(info.value), str(info.value)
            assert "sample_denoms" not in str(info.value)
    finally:
        unregister_mode("bad_d")


# ------------------------------------------------------------- the registry under threads
@pytest.fixture
def eager_thread_switches():
    """Threads switch every microsecond instead of every 5 ms, so that a window between a
    check and a change, or inside an iteration, is hit within a few rounds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_registering_one_name_from_many_threads_has_exactly_one_winner(eager_thread_switches):
    """Many rounds of 4 threads registering the same new name at once: exactly one succeeds and
    its spec is the one registered; the others are told the name is taken."""
    for round_ in range(40):
        name = f"race_{round_}"
        specs = [throwaway_spec(name=name, summary=f"contender {i}") for i in range(4)]
        start = threading.Barrier(len(specs))
        outcome: dict[int, str] = {}

        def contend(i, start=start, specs=specs, outcome=outcome):
            start.wait()
            try:
                register_mode(specs[i])
                outcome[i] = "won"
            except ValueError as exc:
                outcome[i] = str(exc)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(specs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            winners = [i for i, o in outcome.items() if o == "won"]
            assert len(winners) == 1, outcome
            assert lossagg.MODES[name] is specs[winners[0]]
            assert all(f"mode {name!r} is already registered" in o for i, o in outcome.items() if i != winners[0]), outcome
        finally:
            unregister_mode(name)


def test_readers_never_see_the_registry_change_under_them(eager_thread_switches):
    """Config validation, the JSON Schema, argparse flags and StepPlan, read from threads while
    others register and unregister modes: never an exception from a changing dict, and every
    mode a reader lists is one it can look up."""
    import argparse

    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(k):
        i = 0
        while not stop.is_set():
            name = f"churn_{k}_{i % 7}"
            try:
                register_mode(throwaway_spec(name=name))
                unregister_mode(name)
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
                return
            i += 1

    def read():
        counts = torch.tensor([3.0, 5.0])
        while not stop.is_set():
            try:
                schema = lossagg.LossAggregationConfig.model_json_schema()
                assert "sample_mean" in json.dumps(schema)
                lossagg.add_loss_aggregation_args(argparse.ArgumentParser())
                for name, spec in lossagg.MODES.items():
                    assert spec.name == name
                snapshot = list(lossagg.MODES.values())
                assert snapshot
                lossagg.StepPlan(lossagg.LossAggregationConfig(mode="sample_mean"), counts)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(2)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, repr(errors[0])
    assert not [m for m in lossagg.MODES if m.startswith("churn_")]


@pytest.mark.parametrize(("name", "kind", "message"), [(["a"], TypeError, "unregister_mode takes a mode name (str), got list"),
                                                       (None, TypeError, "got NoneType"),
                                                       ("no_such_mode", ValueError, "mode 'no_such_mode' is not registered")])  # fmt: skip
def test_unregister_names_what_it_was_given(name, kind, message):
    with pytest.raises(kind, match=re.escape(message)):
        unregister_mode(name)


def test_threads_planning_with_new_configs_at_once_share_the_config_caches_without_error(eager_thread_switches):
    """Each new config misses the caches of ``plan_info`` and ``aggregate`` and drops their oldest entry; threads doing so at
    once must not drop the same entry twice (a ``KeyError``) or walk a cache another thread is changing."""
    values, mask, cu = torch.randn(8, dtype=torch.float64), torch.ones(8), torch.tensor([0, 3, 8])
    want = lossagg.aggregate(lossagg.LossAggregationConfig(mode="sample_mean"), values, mask, cu_seqlens=cu)
    stop, errors = threading.Event(), []

    def work():
        while not stop.is_set():
            try:
                config = lossagg.LossAggregationConfig(mode="sample_mean")
                plan_info(config)
                assert torch.equal(lossagg.aggregate(config, values, mask, cu_seqlens=cu), want)
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
                return

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, repr(errors[0])
