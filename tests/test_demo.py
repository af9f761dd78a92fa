"""The demo's logic at a tiny size: it runs, writes the table and the figure, and its split
check passes; bad options and a bad config file are refused cleanly, naming what was typed."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from lossagg.demo import add_demo_args, run_demo
from lossagg.modes import MODES


def demo_args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    add_demo_args(p)
    small = ["--steps", "5", "--prompts-per-step", "4", "--n-samples-per-prompt", "4", "--seeds", "2"]
    return p.parse_args([*small, "--out", str(tmp_path), *extra])


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory):
    """One short demo over every mode and both tasks, on the default processes (every CPU: a pool where there
    are two or more): (its folder, what it printed)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run_demo(demo_args(out)) == 0
    return out, printed.getvalue()


def test_demo_runs_every_mode_on_both_tasks(short_demo):
    out, printed = short_demo
    runs = json.loads((out / "runs.json").read_text())["runs"]
    single = {r["mode"] for r in runs if r["task"] == "single-turn"}
    multi = {r["mode"] for r in runs if r["task"] == "multi-turn"}
    assert multi == set(MODES) and single == {m for m in MODES if not MODES[m].needs_sessions}
    assert {r["seed"] for r in runs} == {0, 1}
    # one progress line per mode and task, with its time
    assert len(re.findall(r"^\[\d+/14\] (single|multi)-turn +\w+ +2 seeds, final reward [\d.]+, [\d.]+ s$", printed, re.M)) == 14
    assert "same gradient" in printed and "MISMATCH" not in printed
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(out / "demo.png") > 1000


def test_the_summary_holds_the_runs_numbers(short_demo):
    """Each row of summary.md is recomputed here from runs.json (the runs' own histories), and runs.json is what
    the training gives: one run repeated here."""
    from lossagg.demo import report
    from lossagg.demo.train import train_run

    out, _ = short_demo
    saved = json.loads((out / "runs.json").read_text())
    summary = (out / "summary.md").read_text()
    pairs = report.by_pair(saved["runs"])
    for (task, mode), runs in pairs.items():
        reward = report.fmt(report.spread([report.final(r, "reward") for r in runs]))
        wrong = report.fmt(report.spread([report.final(r, "wrong_length") for r in runs]), 1)
        section = summary.split(f"## {task}")[1].split("## ")[0]
        row = next(line for line in section.splitlines() if line.startswith(f"| {mode} |"))
        assert f"| {reward} |" in row and f"→ {wrong} |" in row, (row, reward, wrong)
    args = demo_args(out)
    args.config_obj = None
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = train_run("multi-turn", "session_mean", 1, args)
    finally:
        torch.set_num_threads(threads)
    kept = next(r for r in saved["runs"] if (r["task"], r["mode"], r["seed"]) == ("multi-turn", "session_mean", 1))
    assert json.loads(json.dumps(again["history"])) == kept["history"]


def test_the_report_says_only_what_the_seeds_carry():
    """The summary's wording follows the numbers: a difference beyond twice its standard error is stated, one
    within it is called no difference, one seed is said to have no spread; what cannot be computed is n/a."""
    import math
    from types import SimpleNamespace

    from lossagg.demo import report

    def run(mode, seed, wrong):
        return {"task": "multi-turn", "mode": mode, "seed": seed, "history": {"wrong_length": [wrong] * 5}}

    def pairs(diffs):
        runs = [run("sample_mean", s, 4 + d) for s, d in enumerate(diffs)] + [run("token_mean", s, 4.0) for s in range(len(diffs))]
        return report.by_pair(runs)

    clear = report.length_bias(pairs([3.0, 3.2, 2.8]), "multi-turn", [0, 1, 2])
    assert "wrong answers end 3.00 tokens longer than token_mean's" in clear[0] and "beyond twice" in clear[0], clear
    noisy = report.length_bias(pairs([3.0, -2.0, 0.5]), "multi-turn", [0, 1, 2])
    assert "no difference beyond the seeds' spread" in noisy[0] and "does not show the bias" in noisy[0], noisy
    assert "one seed: no spread" in report.length_bias(pairs([1.0]), "multi-turn", [0])[0]
    assert report.fmt(report.spread([math.nan])) == "n/a" and report.fmt(report.spread([1.0])) == "1.00"
    assert report.family("no_such_mode") == "other" and report.family("max_length") == "constant divisor"
    assert report.family("session_mean") == "sample-normalised" and report.family("prompt_mean") == "token-normalised"
    assert report._split_text([{"split": None}]) == ("not checked", False)
    assert report._session_note({}, [0]).startswith("Sessions: run sample_mean and a session mode")
    text, ok = report.summarise(
        [{**run("sample_mean", 0, 4.0), "split": None, "history": {k: [1.0] * 5 for k in ("reward", "wrong_length", "right_length", "turns")}}],
        SimpleNamespace(steps=5, prompts_per_step=2, n_samples_per_prompt=2, micro_batches=1),
    )
    assert not ok and "not checked" in text


def test_the_session_modes_differ_from_sample_mean_on_the_multi_turn_task(short_demo):
    out, _ = short_demo
    runs = json.loads((out / "runs.json").read_text())["runs"]
    history = {(r["task"], r["mode"], r["seed"]): r["history"] for r in runs}
    for mode in (m for m in MODES if MODES[m].needs_sessions):
        assert all(history["multi-turn", mode, s] != history["multi-turn", "sample_mean", s] for s in (0, 1)), mode
    # on the single-turn task a session is one answer: the session modes are not run there (their twins are)
    assert not any(t == "single-turn" and MODES[m].needs_sessions for t, m, _ in history)
    assert "seeds whose run differs from sample_mean's: session_mean 2/2" in (out / "summary.md").read_text()


def test_demo_accepts_a_config_file(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("loss_aggregation: {mode: prompt_mean, n_samples_per_prompt: 4}\n")
    assert run_demo(demo_args(tmp_path, "--modes", "sample_mean", "--config", str(cfg), "--tasks", "single-turn", "--seeds", "1")) == 0
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
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--modes", "session_mean", "--tasks", "single-turn"], "nothing to run: --modes session_mean are session modes"),
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
