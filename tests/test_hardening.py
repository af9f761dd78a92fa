"""Hostile and careless input, class by class: never garbage, never a Python traceback from
the command line, bounded work on any config file."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
import torch

import lossagg
from lossagg import LossAggregationConfig, StepPlan
from lossagg.demo import add_demo_args, run_demo

# ------------------------------------------------------------------------ ops


def small_batch():
    values = torch.randn(6)
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 3, 6])
    return values, mask, cu, torch.tensor([2.0, 4.0])


def test_fake_kernels_check_devices_shapes_and_dtypes():
    values, mask, cu, d = small_batch()
    with pytest.raises(ValueError, match="mask must be on the same device as values"):
        lossagg.segment_sum(values, mask.to("meta"), cu)
    with pytest.raises(ValueError, match="mask must be on the same device as values"):
        lossagg.reduce(values, mask.to("meta"), cu_seqlens=cu, sample_denoms=d)
    meta = [t.to("meta") for t in (values, mask, cu, d)]
    assert lossagg.reduce(meta[0], meta[1], cu_seqlens=meta[2], sample_denoms=meta[3]).shape == ()
    assert lossagg.segment_sum(meta[0].expand(3, 6), meta[1], meta[2]).shape == (3, 2)
    with pytest.raises(ValueError, match="mask must have the token shape"):
        lossagg.segment_sum(meta[0], meta[1][:5], meta[2])
    with pytest.raises(ValueError, match="sample_denoms must be a 1-D tensor of length B = 2"):
        lossagg.reduce(meta[0], meta[1], cu_seqlens=meta[2], sample_denoms=meta[3][:1])
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32 or int64"):
        lossagg.segment_sum(meta[0], meta[1], meta[2].float())


def test_denominators_checked_in_the_dtype_they_divide_in():
    values, mask, cu, _ = small_batch()
    tiny = torch.tensor([1e-300, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"sample_denoms\[0\] = 1e-300 is 0 in Float"):
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=tiny)
    huge = torch.tensor([1e300, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="is inf in Float"):
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=huge)
    j = lossagg.reduce(values.double(), mask, cu_seqlens=cu, sample_denoms=tiny)  # float64 values divide in float64
    assert torch.isfinite(j)


def test_gradients_never_go_missing():
    values, mask, cu, d = small_batch()
    values.requires_grad_(True)
    float_mask = mask.float().requires_grad_(True)
    with pytest.raises(ValueError, match="not differentiable in mask"):
        lossagg.reduce(values, float_mask, cu_seqlens=cu, sample_denoms=d)
    with pytest.raises(ValueError, match="not differentiable in sample_denoms"):
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d.clone().requires_grad_(True))
    with pytest.raises(ValueError, match="not differentiable in mask"):
        lossagg.segment_sum(values, float_mask, cu)
    # detached, they work
    lossagg.reduce(values, float_mask.detach(), cu_seqlens=cu, sample_denoms=d).backward()


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_double_backward_is_exact(layout):
    g = torch.Generator().manual_seed(0)
    if layout == "packed":
        values = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
        mask = torch.rand(7, generator=g) < 0.7
        cu = torch.tensor([0, 3, 7])
        metric_values = torch.randn(2, 7, dtype=torch.float64, generator=g, requires_grad=True)
    else:
        values = torch.randn(2, 4, dtype=torch.float64, generator=g, requires_grad=True)
        mask = torch.rand(2, 4, generator=g) < 0.7
        cu = None
        metric_values = torch.randn(2, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    d = torch.tensor([3.0, 5.0], dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda v: lossagg.reduce(v, mask, cu_seqlens=cu, sample_denoms=d), (values,))
    assert torch.autograd.gradgradcheck(lambda v: lossagg.segment_sum(v, mask, cu), (metric_values,))


def test_bool_mask_viewed_from_bytes_reads_any_nonzero_byte_as_kept():
    raw = torch.tensor([0, 2, 255, 1, 128, 0], dtype=torch.uint8)
    mask = raw.view(torch.bool)
    values = torch.arange(1.0, 7.0)
    cu = torch.tensor([0, 3, 6])
    expected = torch.tensor([2.0 + 3.0, 4.0 + 5.0])
    assert torch.equal(lossagg.segment_sum(values, mask, cu), expected)
    assert torch.equal(lossagg.segment_sum(values, raw != 0, cu), expected)
    values.requires_grad_(True)
    lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=torch.ones(2)).backward()
    assert values.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_token_counts_are_exact_integers():
    n = 2**24 + 1  # float32 cannot hold it
    mask = torch.ones(n, dtype=torch.bool)
    counts = lossagg.token_counts(mask, torch.tensor([0, 1, n]))
    assert counts.dtype == torch.int64 and counts.tolist() == [1, n - 1]
    assert lossagg.token_counts(mask[:8].reshape(2, 4)).tolist() == [4, 4]
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the number of tokens"):
        lossagg.token_counts(mask[:8], torch.tensor([0, 9]))


# ------------------------------------------------------------------ StepPlan


@pytest.fixture
def plan():
    return StepPlan(LossAggregationConfig(), torch.tensor([2, 3, 4, 5]))


def test_samples_accepts_positions_slices_and_bool_selections(plan):
    full = plan.sample_denoms.float()
    assert torch.equal(plan.sample_denoms_for([1, 3]), full[[1, 3]])
    assert torch.equal(plan.sample_denoms_for(slice(1, 3)), full[1:3])
    assert torch.equal(plan.sample_denoms_for(torch.tensor([False, True, False, True])), full[[1, 3]])


@pytest.mark.parametrize(
    ("samples", "kind", "message"),
    [
        ([-1], ValueError, r"samples must be positions in \[0, 4\)"),
        ([4], ValueError, r"samples must be positions in \[0, 4\)"),
        ([0.5, 1.5], TypeError, "samples must hold integer positions"),
        (torch.tensor([True, False]), ValueError, "bool selection must have one entry per sample"),
        (3, TypeError, "samples must be a 1-D selection"),
        ("ab", TypeError, "samples must be integer positions"),
    ],
)
def test_bad_samples_are_named(plan, samples, kind, message):
    with pytest.raises(kind, match=message):
        plan.sample_denoms_for(samples)


def test_sample_count_mismatch_blames_samples(plan):
    values = torch.randn(5)
    mask = torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"samples selects 3 sample\(s\) but cu_seqlens has 2"):
        plan.loss(values, mask, [0, 1, 2], torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="samples selects 1"):
        plan.metrics({"kl": values}, mask, [0], torch.tensor([0, 2, 5]))


def test_helpers_name_bad_arguments():
    counts = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="group_index must be a 1-D tensor of integer prompt-group indices"):
        StepPlan(LossAggregationConfig(mode="prompt_mean"), counts, group_index=["p1", "p2"])
    assert StepPlan({"mode": "token_mean"}, counts).config.mode == "token_mean"
    with pytest.raises(TypeError, match="config must be a LossAggregationConfig"):
        StepPlan("token_mean", counts)
    with pytest.raises(lossagg.ConfigError, match="unknown mode"):
        StepPlan({"mode": "nope"}, counts)
    with pytest.raises(TypeError, match="token_counts must hold real numbers"):
        StepPlan(LossAggregationConfig(), torch.tensor([1 + 1j]))
    with pytest.raises(TypeError, match="token_counts must be"):
        StepPlan(LossAggregationConfig(), ["a", "b"])
    with pytest.raises(ValueError, match="num_group_labels must be an integer >= 1"):
        StepPlan(LossAggregationConfig(mode="prompt_mean"), counts, group_index=[0, 0], num_group_labels=0)
    plan = StepPlan(LossAggregationConfig(), counts)
    with pytest.raises(ValueError, match="metric 'kl' must have the token shape of mask"):
        plan.metrics({"kl": torch.ones(2)}, torch.ones(3, dtype=torch.bool), [0, 1], torch.tensor([0, 1, 3]))
    cu = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="cp_size must be an integer >= 1"):
        lossagg.zigzag_local_cu_seqlens(cu, "2")
    with pytest.raises(ValueError, match="cp_rank must be an integer"):
        lossagg.zigzag_positions(cu, 2, 1.0)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the number of tokens T = 4"):
        lossagg.zigzag_shard(torch.ones(4), cu, 2, 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        lossagg.zigzag_positions(torch.tensor([0, 3, 2]), 2, 0)
    with pytest.raises(ValueError, match="num_micro_batches must be an integer"):
        lossagg.gradient_scale("megatron", num_micro_batches=True)


# ----------------------------------------------------------- config and CLI


def write(tmp_path, name, data: bytes | str):
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(p)


def alias_bomb():
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    return "\n".join(lines) + f"\nmode: *{prev}\n"


BAD_FILES = {
    "deep.json": ('{"a":' * 100_000 + "1" + "}" * 100_000, "nests deeper"),
    "deep.yaml": ("a:\n  " + "- " * 3000 + "1\n", "nests deeper"),
    "deep.toml": ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper"),
    "bigint.json": ('{"mode": "constant", "divisor": ' + "9" * 5000 + "}", "divisor: an integer of 5000 digits is out of range"),
    "bigdiv.yaml": ("mode: constant\ndivisor: " + "9" * 400 + "\n", "divisor"),
    "bomb.yaml": (alias_bomb(), "more than"),
    "longstring.yaml": ("mode: " + "x" * 3_000_000 + "\n", "unknown mode"),
    "toolarge.yaml": ("# " + "x" * (5 * 1024 * 1024) + "\n", "larger than"),
    "dup.yaml": ("mode: token_mean\nmode: constant\n", "'mode' is given twice"),
    "dup.json": ('{"mode": "token_mean", "mode": "constant"}', "'mode' is given twice"),
    "dup.toml": ('mode = "token_mean"\nmode = "constant"\n', "cannot parse"),
    "binary.yaml": (b"\xff\xfe\x00mode", "cannot parse"),
    "list.json": ("[1, 2]", "expected a mapping"),
    "section.yaml": ("loss_aggregation: 3\n", "expected a mapping of settings"),
    "keys.yaml": ("1: 2\n", "setting names must be strings"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_cli_check_bad_files_one_line_exit_1_bounded(tmp_path, capsys, name):
    from lossagg.cli import main

    text, message = BAD_FILES[name]
    path = write(tmp_path, name, text)
    start = time.perf_counter()
    assert main(["check", path]) == 1
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip()
    assert message in err, err[:500]
    assert "Traceback" not in err and len(err) < 2000, err[:500]
    assert elapsed < 10, f"took {elapsed:.1f}s"


def test_cli_check_paths_that_are_not_files(tmp_path, capsys):
    from lossagg.cli import main

    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    cases = {
        str(tmp_path): "is a directory",
        str(tmp_path / "loop_a"): "cannot read the file",
        "/dev/zero": "is a character device, not a regular file",
    }
    for path, message in cases.items():
        assert main(["check", path]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and path in err and "\n" not in err, err


def test_cli_never_shows_a_traceback(tmp_path):
    path = write(tmp_path, "deep.json", '{"a":' * 50_000 + "1" + "}" * 50_000)
    run = subprocess.run([sys.executable, "-m", "lossagg", "check", path], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert run.returncode == 1 and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_rules_are_not_judged_against_a_default_standing_in_for_an_invalid_value():
    with pytest.raises(lossagg.ConfigError) as info:
        LossAggregationConfig.from_dict({"mode": "tokn_mean", "divisor": 2.0})
    assert "sample_mean" not in str(info.value).split("expected one of")[0]
    assert [p for p, _ in info.value.issues] == ["mode"]


def test_empty_section_means_every_default(tmp_path):
    path = write(tmp_path, "train.yaml", "lr: 1.0e-6\nbatch: 8\nloss_aggregation:\n")
    assert LossAggregationConfig.from_file(path) == LossAggregationConfig()


def test_unknown_setting_with_a_huge_name_is_quoted_short():
    with pytest.raises(lossagg.ConfigError) as info:
        LossAggregationConfig.from_dict({"m" * 100_000: 1})
    assert len(str(info.value)) < 500


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--prompts-per-step", "0"], "--prompts-per-step must be >= 1"),
        (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt must be >= 2"),
        (["--micro-batches", "-1"], "--micro-batches must be >= 1"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--out", "/proc/lossagg-cannot-write-here"], "is not a writable folder"),
    ],
)
def test_demo_refuses_bad_options_cleanly(tmp_path, capsys, flags, message):
    p = argparse.ArgumentParser()
    add_demo_args(p)
    args = p.parse_args(["--out", str(tmp_path), *flags])
    assert run_demo(args) == 2
    assert message in capsys.readouterr().err
