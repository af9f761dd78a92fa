"""The demo's logic at a tiny size: it runs, writes the table and the figure, and its split check passes."""

from __future__ import annotations

import argparse
import importlib.util
import os

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
