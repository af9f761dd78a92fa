"""The demo's logic at a tiny size: it runs, writes the table and the figure, and its split
check passes; bad options and a bad config file are refused cleanly, naming what was typed."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest

from lossagg.demo import add_demo_args, run_demo
from lossagg.modes import MODES


def demo_args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    add_demo_args(p)
    return p.parse_args(["--steps", "4", "--prompts-per-step", "4", "--n-samples-per-prompt", "4", "--out", str(tmp_path), *extra])


def test_demo_runs_all_modes(tmp_path, capsys):
    assert run_demo(demo_args(tmp_path)) == 0
    captured = capsys.readouterr()
    out = captured.out
    for mode in list(MODES):
        assert f"| {mode} |" in out
    assert "gives the unsplit gradient (checked for every mode)" in out
    assert "each rollout is a session of one sample" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(tmp_path / "demo.png") > 1000
    else:  # matplotlib is optional (the demo extra): the demo says why there is no figure
        assert "matplotlib is not installed: no figure" in captured.err
        assert not (tmp_path / "demo.png").exists()
    assert "| mode |" in (tmp_path / "summary.md").read_text()


def test_demo_accepts_a_config_file(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("loss_aggregation: {mode: prompt_mean, n_samples_per_prompt: 4}\n")
    assert run_demo(demo_args(tmp_path, "--modes", "sample_mean", "--config", str(cfg))) == 0
    out = capsys.readouterr().out
    assert "| prompt_mean |" in out and "| sample_mean |" in out


def test_demo_rejects_a_bad_config(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mode: constant\n")
    assert run_demo(demo_args(tmp_path, "--config", str(cfg))) == 1
    assert "divisor" in capsys.readouterr().err


@pytest.mark.parametrize("steps", ["0"])
def test_demo_rejects_zero_steps(tmp_path, steps):
    args = demo_args(tmp_path)
    args.steps = int(steps)
    assert run_demo(args) == 2


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


def test_demo_blames_the_config_file_not_a_flag(tmp_path):
    (tmp_path / "f.yaml").write_text("loss_aggregation: {mode: sample_mean, n_samples_per_prompt: 1}\n")
    out = subprocess.run(
        [sys.executable, "-m", "lossagg", "demo", "--config", "f.yaml", "--steps", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ),
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "f.yaml: n_samples_per_prompt must be >= 2 for the demo" in out.stderr and "--n-samples-per-prompt" not in out.stderr
