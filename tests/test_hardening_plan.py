"""Hostile and careless inputs to the planner, the config files and the command line (second
hardening round): each case is an input and its verdict, refused with a message naming the
argument the user typed, or accepted with a value checked against a float64 formula."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import lossagg
from lossagg import LossAggregationConfig, StepPlan
from lossagg.testing import rank_totals

COUNTS = torch.tensor([3, 0, 5, 4])  # this rank: 4 samples, 12 tokens, longest 5
GROUP_SUMS = torch.tensor([3.0, 7.0, 9.0, 4.0])  # Sg[g(i)] of each local sample (its own count at least)
CFG = {
    "sample_mean": LossAggregationConfig(mode="sample_mean"),
    "token_mean": LossAggregationConfig(mode="token_mean"),
    "prompt_mean": LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2),
    "prompt_mean_any": LossAggregationConfig(mode="prompt_mean"),
    "max_length": LossAggregationConfig(mode="max_length"),
    "constant": LossAggregationConfig(mode="constant", divisor=8.0),
}

# (case, config, keywords, error type, the message, as a regex)
FROM_TOTALS_REFUSED = [
    (
        "a mode name instead of a config",
        "the string",
        dict(num_samples=4),
        TypeError,
        r"config must be a LossAggregationConfig .* got the string 'token_mean'",
    ),
    ("num_samples missing", "sample_mean", dict(), ValueError, r"mode=sample_mean needs the step total\(s\) num_samples \(N"),
    ("total_tokens missing under token_mean", "token_mean", dict(num_samples=8), ValueError, r"needs the step total\(s\) total_tokens \(T"),
    (
        "max_tokens missing under max_length",
        "max_length",
        dict(num_samples=8, total_tokens=40),
        ValueError,
        r"needs the step total\(s\) max_tokens \(L_max",
    ),
    ("group totals missing under prompt_mean", "prompt_mean", dict(num_samples=8), ValueError, r"num_groups \(P.*group_token_sums \(Sg"),
    ("an unknown total", "sample_mean", dict(num_samples=8, num_tokens=3), TypeError, r"unknown step total 'num_tokens'"),
    ("num_samples below the rank's", "sample_mean", dict(num_samples=3), ValueError, r"num_samples .* >= this rank's 4 sample\(s\), got 3"),
    ("num_samples a float", "sample_mean", dict(num_samples=8.5), ValueError, r"num_samples must be an integer >= 0, got 8.5"),
    ("num_samples a string", "sample_mean", dict(num_samples="8"), ValueError, r"num_samples must be an integer >= 0, got '8'"),
    ("num_samples a bool", "sample_mean", dict(num_samples=True), ValueError, r"num_samples must be an integer"),
    (
        "total_tokens below the rank's",
        "token_mean",
        dict(num_samples=8, total_tokens=11),
        ValueError,
        r"total_tokens .* >= this rank's own 12, got 11",
    ),
    (
        "total_tokens 0 while tokens exist",
        "token_mean",
        dict(num_samples=8, total_tokens=0),
        ValueError,
        r"total_tokens .* >= this rank's own 12, got 0",
    ),
    (
        "total_tokens nan",
        "token_mean",
        dict(num_samples=8, total_tokens=float("nan")),
        ValueError,
        r"total_tokens must be a finite number >= 0, got nan",
    ),
    ("total_tokens inf", "token_mean", dict(num_samples=8, total_tokens=float("inf")), ValueError, r"total_tokens must be a finite number"),
    (
        "max_tokens below the rank's longest",
        "max_length",
        dict(num_samples=8, max_tokens=4),
        ValueError,
        r"max_tokens .* >= this rank's own 5, got 4",
    ),
    (
        "max_tokens above total_tokens",
        "max_length",
        dict(num_samples=8, max_tokens=50, total_tokens=40),
        ValueError,
        r"max_tokens \(L_max, 50\) cannot exceed",
    ),
    (
        "more groups than samples",
        "prompt_mean_any",
        dict(num_samples=4, num_groups=5, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_groups \(P, 5\) cannot exceed num_samples \(N, 4\)",
    ),
    (
        "N != n x P when promised",
        "prompt_mean",
        dict(num_samples=8, num_groups=3, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_samples \(N, 8\) must equal n_samples_per_prompt \(2\) × num_groups \(P, 3\) = 6",
    ),
    (
        "num_groups 0 with samples",
        "prompt_mean",
        dict(num_samples=4, num_groups=0, group_token_sums=GROUP_SUMS),
        ValueError,
        r"num_groups must be an integer >= 1, got 0",
    ),
    (
        "a group sum below its sample's count",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=torch.tensor([3.0, 7.0, 4.0, 4.0])),
        ValueError,
        r"group_token_sums\[2\] .* >= the sample's own 5 tokens, got 4",
    ),
    (
        "a negative group sum",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=[4, -4, 9, 4]),
        ValueError,
        r"group_token_sums must be >= 0",
    ),
    (
        "group sums of the wrong length",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=torch.tensor([9.0, 9.0])),
        ValueError,
        r"group_token_sums must have one entry per local sample \(4\)",
    ),
    ("group sums a string", "prompt_mean", dict(num_samples=4, num_groups=2, group_token_sums="9"), TypeError, r"group_token_sums must be a 1-D"),
    (
        "total_tokens below the rank's, beside group sums",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=GROUP_SUMS, total_tokens=8),
        ValueError,
        r"total_tokens .* >= this rank's own 12",
    ),
    (
        "a group sum above the step's tokens",
        "prompt_mean",
        dict(num_samples=4, num_groups=2, group_token_sums=[3, 7, 20, 4], total_tokens=12),
        ValueError,
        r"group_token_sums holds 20, more than total_tokens \(T, 12\)",
    ),
]


@pytest.mark.parametrize(("case", "cfg", "kwargs", "kind", "message"), FROM_TOTALS_REFUSED, ids=[c[0] for c in FROM_TOTALS_REFUSED])
def test_from_totals_refuses(case, cfg, kwargs, kind, message):
    config = "token_mean" if cfg == "the string" else CFG[cfg]
    with pytest.raises(kind, match=message):
        StepPlan.from_totals(config, COUNTS, **kwargs)


# (case, config, keywords, expected d[i] as a float64 formula)
FROM_TOTALS_ACCEPTED = [
    ("NumPy num_samples", "sample_mean", dict(num_samples=np.int64(8)), [8 * 3, 8 * 1, 8 * 5, 8 * 4]),
    ("0-dim tensor num_samples", "sample_mean", dict(num_samples=torch.tensor(8)), [8 * 3, 8 * 1, 8 * 5, 8 * 4]),
    ("total_tokens as a NumPy int", "token_mean", dict(num_samples=8, total_tokens=np.int64(40)), [40.0] * 4),
    ("total_tokens equal to the rank's", "token_mean", dict(num_samples=4, total_tokens=12), [12.0] * 4),
    ("max_tokens from another rank", "max_length", dict(num_samples=8, max_tokens=np.int32(9)), [8 * 9.0] * 4),
    (
        "prompt groups, NumPy P",
        "prompt_mean",
        dict(num_samples=4, num_groups=np.int64(2), group_token_sums=GROUP_SUMS),
        [2 * 3.0, 2 * 7.0, 2 * 9.0, 2 * 4.0],
    ),
    (
        "group sums as a list",
        "prompt_mean_any",
        dict(num_samples=4, num_groups=3, group_token_sums=[3, 7, 9, 4]),
        [3 * 3.0, 3 * 7.0, 3 * 9.0, 3 * 4.0],
    ),
    ("totals not needed are checked and kept", "sample_mean", dict(num_samples=8, total_tokens=40, max_tokens=5), [8 * 3, 8 * 1, 8 * 5, 8 * 4]),
]


@pytest.mark.parametrize(("case", "cfg", "kwargs", "expected"), FROM_TOTALS_ACCEPTED, ids=[c[0] for c in FROM_TOTALS_ACCEPTED])
def test_from_totals_accepts(case, cfg, kwargs, expected):
    plan = StepPlan.from_totals(CFG[cfg], COUNTS, **kwargs)
    assert plan.sample_denoms.dtype == torch.float64
    assert plan.sample_denoms.tolist() == [float(x) for x in expected]
    for name in kwargs:
        assert name in plan.totals


def test_from_totals_refuses_an_integral_float_count():
    with pytest.raises(ValueError, match=re.escape("num_samples must be an integer >= 0, got np.float64(8.0)")):
        StepPlan.from_totals(CFG["constant"], COUNTS, num_samples=np.float64(8.0))


def test_from_totals_and_the_all_reduce_agree_for_every_mode():
    """The same numbers by both paths (the step is this rank's samples)."""
    groups = torch.tensor([0, 0, 1, 1])
    for name, spec in lossagg.MODES.items():
        config = LossAggregationConfig(mode=name, n_samples_per_prompt=2, **spec.example_settings)
        gathered = StepPlan(config, COUNTS, group_index=groups)
        given = StepPlan.from_totals(config, COUNTS, **rank_totals(config, COUNTS, torch.arange(4), groups))
        assert torch.equal(gathered.sample_denoms, given.sample_denoms), name


# ---------------------------------------------------------------------- StepPlan
STEP_PLAN_REFUSED = [
    ("num_group_labels 10**12", dict(num_group_labels=10**12), ValueError, r"num_group_labels must be <= 16777216 .* got 1000000000000"),
    ("num_group_labels 0", dict(num_group_labels=0), ValueError, r"num_group_labels must be an integer >= 1, got 0"),
    ("num_group_labels a float", dict(num_group_labels=2.0), ValueError, r"num_group_labels must be an integer >= 1, got 2.0"),
    ("num_groups (the pre-release name)", dict(num_groups=2), TypeError, r"num_groups"),
    ("group_index outside the labels", dict(num_group_labels=1), ValueError, r"group_index must lie in \[0, 1\)"),
]


class _FakeGroup:
    """Stands for a process group of one rank; all_reduce is patched to the identity."""


@pytest.mark.parametrize(("case", "kwargs", "kind", "message"), STEP_PLAN_REFUSED, ids=[c[0] for c in STEP_PLAN_REFUSED])
def test_step_plan_refuses(case, kwargs, kind, message, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no collective before the arguments are checked"))
    with pytest.raises(kind, match=message):
        StepPlan(CFG["prompt_mean"], COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=_FakeGroup(), **kwargs)


def test_group_labels_from_the_config_are_bounded_and_named(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no collective before the arguments are checked"))
    config = LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2, global_batch_size=2**40)
    with pytest.raises(ValueError, match=re.escape("num_group_labels (global_batch_size // n_samples_per_prompt of the config) must be <= 16777216")):
        StepPlan(config, COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=_FakeGroup())


def test_step_plan_accepts_numpy_label_counts(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    plan = StepPlan(CFG["prompt_mean"], COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=_FakeGroup(), num_group_labels=np.int64(3))
    assert plan.totals.num_groups == 2 and plan.sample_denoms.tolist() == [2 * 3.0, 2 * 3.0, 2 * 9.0, 2 * 9.0]


@pytest.mark.parametrize(
    ("mode", "collectives"),
    [("sample_mean", ["sum"]), ("token_mean", ["sum"]), ("constant", ["sum"]), ("prompt_mean", ["sum"]), ("max_length", ["sum", "max"])],
)
def test_the_planner_gathers_sums_in_one_all_reduce_and_a_max_only_when_needed(mode, collectives, monkeypatch):
    import torch.distributed as dist

    calls = []

    def fake_all_reduce(buf, op=None, group=None):
        calls.append(("sum" if op == dist.ReduceOp.SUM else "max", buf.dtype, buf.numel()))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    config = LossAggregationConfig(mode=mode, n_samples_per_prompt=2, global_batch_size=8, **lossagg.MODES[mode].example_settings)
    StepPlan(config, COUNTS, group_index=torch.tensor([0, 0, 1, 1]), process_group=_FakeGroup())
    assert [c[0] for c in calls] == collectives and all(c[1] == torch.float64 for c in calls)
    if mode == "prompt_mean":  # N, T, then sizes and token sums of the 4 labels
        assert calls[0][2] == 2 + 2 * 4


def test_an_empty_micro_batch_contributes_zero():
    plan = StepPlan(CFG["token_mean"], COUNTS)
    v = torch.randn(4, 6, requires_grad=True)
    m = torch.ones(4, 6, dtype=torch.bool)
    j = plan.loss(v[:0], m[:0], [])
    j.backward()
    assert j.item() == 0.0 and torch.equal(v.grad, torch.zeros_like(v))
    packed = torch.randn(12)
    assert plan.loss(packed[:0], torch.ones(0, dtype=torch.bool), [], torch.tensor([0])).item() == 0.0
    assert plan.metrics({"entropy": v[:0]}, m[:0], [])["entropy"].item() == 0.0


# ---------------------------------------------------------------------- config files
def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CONFIG_FILES = [
    (
        "YAML merge key",
        "t.yaml",
        "defaults: &d\n  mode: prompt_mean\n  n_samples_per_prompt: 4\n"
        "loss_aggregation:\n  <<: *d\n  n_samples_per_prompt: 8\n  global_batch_size: 16\n",
        {"mode": "prompt_mean", "n_samples_per_prompt": 8, "global_batch_size": 16},
    ),
    (
        "YAML merge of a list of mappings",
        "t.yaml",
        "a: &a {mode: constant}\nb: &b {divisor: 4.0}\nloss_aggregation:\n  <<: [*a, *b]\n",
        {"mode": "constant", "divisor": 4.0},
    ),
    ("YAML merge key at the top", "t.yaml", "base: &b {mode: token_mean}\n<<: *b\n", None),
]


@pytest.mark.parametrize(("case", "name", "text", "expected"), CONFIG_FILES, ids=[c[0] for c in CONFIG_FILES])
def test_config_files_accepted(case, name, text, expected, tmp_path):
    path = _write(tmp_path, name, text)
    if expected is None:  # a top-level merge brings 'base' along: an unknown setting, named
        with pytest.raises(lossagg.ConfigError, match="base: unknown setting"):
            LossAggregationConfig.from_file(path)
        return
    config = LossAggregationConfig.from_file(path)
    assert {k: getattr(config, k) for k in expected} == expected


CONFIG_FILES_REFUSED = [
    (
        "5000-digit integer, YAML",
        "t.yaml",
        "global_batch_size: " + "9" * 5000 + "\n",
        ["global_batch_size: an integer of 5000 digits is out of range"],
    ),
    (
        "5000-digit integer, JSON",
        "t.json",
        '{"n_samples_per_prompt": -' + "9" * 5000 + "}",
        ["n_samples_per_prompt: an integer of 5000 digits is out of range"],
    ),
    (
        "5000-digit integer, TOML",
        "t.toml",
        "[loss_aggregation]\nglobal_batch_size = " + "1_" * 2500 + "1  # big\n",
        ["global_batch_size: an integer of 2501 digits"],
    ),
    ("above 2**53", "t.yaml", "global_batch_size: 9007199254740993\n", ["global_batch_size: Input should be less than or equal to 9007199254740992"]),
    (
        "a key given twice beside a merge",
        "t.yaml",
        "d: &d {mode: token_mean}\nloss_aggregation:\n  <<: *d\n  mode: sample_mean\n  mode: constant\n",
        ["the key 'mode' is given twice"],
    ),
    (
        "four errors, a bad flag among them",
        "t.yaml",
        "mode: prompt_mean\ncalculate_per_token_loss: 'yes'\ndivisor: 1.0\nn_samples_per_prompt: 3\nglobal_batch_size: 7\nlr: 1\n",
        [
            "calculate_per_token_loss: expected a boolean",
            "divisor: divisor is only used with mode=constant",
            "global_batch_size: under prompt_mean global_batch_size (7) must be a multiple",
            "lr: unknown setting",
        ],
    ),
]


@pytest.mark.parametrize(("case", "name", "text", "messages"), CONFIG_FILES_REFUSED, ids=[c[0] for c in CONFIG_FILES_REFUSED])
def test_config_files_refused_with_every_error(case, name, text, messages, tmp_path):
    path = _write(tmp_path, name, text)
    with pytest.raises(lossagg.ConfigError) as err:
        LossAggregationConfig.from_file(path)
    text = str(err.value)
    for message in messages:
        assert message in text, text
    if len(messages) > 1:
        assert f"({len(messages)} errors)" in text and len(err.value.issues) == len(messages)


def test_a_mode_given_explicitly_keeps_its_rules_when_the_flag_is_invalid():
    with pytest.raises(lossagg.ConfigError) as err:
        LossAggregationConfig.from_dict({"mode": "constant", "calculate_per_token_loss": 1})
    assert [p for p, _ in err.value.issues] == ["calculate_per_token_loss", "divisor"]
    # with the mode unset, the flag decides it: no rule is judged against a default
    with pytest.raises(lossagg.ConfigError) as err:
        LossAggregationConfig.from_dict({"calculate_per_token_loss": 1, "divisor": 2.0})
    assert [p for p, _ in err.value.issues] == ["calculate_per_token_loss"]


# ---------------------------------------------------------------------- command line
def _cli(args, tmp_path, env=None):
    return subprocess.run(
        [sys.executable, "-m", "lossagg", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


@pytest.mark.parametrize("command", [["check", "f.yaml"], ["schema"]])
def test_a_bad_cpu_isa_variable_is_one_line_from_the_cli(command, tmp_path):
    _write(tmp_path, "f.yaml", "mode: token_mean\n")
    out = _cli(command, tmp_path, {"LOSSAGG_CPU_ISA": "bogus"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"lossagg {command[0]}: LOSSAGG_CPU_ISA must be one of auto, avx512, avx2, baseline, got 'bogus'"


def test_a_bad_cpu_isa_variable_is_raised_by_the_ops_not_at_import():
    code = (
        "import torch, lossagg\n"
        "try:\n"
        "    lossagg.segment_sum(torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "lossagg.set_cpu_isa('baseline')\n"
        "print(lossagg.segment_sum(torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3])).item())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "LOSSAGG_CPU_ISA": "avx9"}, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("LOSSAGG_CPU_ISA must be one of auto, avx512, avx2, baseline, got 'avx9'") and lines[1] == "3.0"


def test_demo_blames_the_config_file_not_a_flag(tmp_path):
    _write(tmp_path, "f.yaml", "loss_aggregation: {mode: sample_mean, n_samples_per_prompt: 1}\n")
    out = _cli(["demo", "--config", "f.yaml", "--steps", "1"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "f.yaml: n_samples_per_prompt must be >= 2 for the demo" in out.stderr and "--n-samples-per-prompt" not in out.stderr


# ---------------------------------------------------------------------- NaN across ISAs
ISAS = ["baseline", "avx2", "avx512"][: ["baseline", "avx2", "avx512"].index(lossagg._native.cpu_best_isa()) + 1]


def test_nan_results_are_nan_on_every_isa_and_the_rest_bitwise_equal():
    outs = []
    for isa in ISAS:
        lossagg.set_cpu_isa(isa)
        try:
            row = []
            for length in (5, 16, 40, 100, 20000):
                for bits in (0x7FC12345, 0xFFC54321, 0x7F812345):
                    v = torch.randn(3, 2 * length, generator=torch.Generator().manual_seed(length))
                    v[1, length // 3] = struct.unpack("f", struct.pack("I", bits))[0]
                    v[2, length + 1] = float("inf")
                    v[2, length + 2] = float("-inf")
                    mask = torch.ones(2 * length, dtype=torch.bool)
                    cu = torch.tensor([0, length, 2 * length])
                    row.append(lossagg.segment_sum(v, mask, cu))
                    row.append(lossagg.reduce(v[1], mask, cu_seqlens=cu, sample_denoms=torch.tensor([2.0, 3.0])).reshape(1))
            outs.append(torch.cat([r.reshape(-1) for r in row]))
        finally:
            lossagg.set_cpu_isa("auto")
    first = outs[0]
    assert torch.isnan(first).any()
    for isa, out in zip(ISAS[1:], outs[1:], strict=True):
        assert torch.equal(torch.isnan(out), torch.isnan(first)), isa
        keep = ~torch.isnan(first)
        assert torch.equal(out[keep].view(torch.int32), first[keep].view(torch.int32)), isa


def test_the_ops_docs_state_the_nan_exception():
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "ops.md")).read()
    assert re.search(r"payload and sign bit are not promised", text)
