"""``lossagg demo``: GRPO on a tiny counting task, once per aggregation mode.

:mod:`.train` holds the task, the policy and the training loop; :mod:`.report` the
table and the figure. The command-line options are defined here, without torch, so
``lossagg --help`` and ``lossagg check`` do not load it (:func:`run_demo` imports the
training, and with it torch, when the demo runs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.demo.report import summarise, write_figure
from lossagg.modes import MODES


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per mode (default 100)")
    names = list(MODES)  # the modes registered when the parser is built
    p.add_argument("--modes", nargs="+", default=names, choices=names, help="modes to run (default: every registered mode)")
    p.add_argument("--out", default="demo-out", help="folder for the figure and the table (default demo-out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--config", default=None, help="a config file; its mode's run uses it (lossagg check format)")


def _check_demo_args(args) -> str | None:
    """What is wrong with the demo's options, if anything (one line)."""
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--prompts-per-step", args.prompts_per_step, 1),
        # group-relative advantages need at least two samples per prompt (a std of one is NaN)
        ("--n-samples-per-prompt", args.n_samples_per_prompt, 2),
        ("--micro-batches", args.micro_batches, 1),
    ):
        if value < least:
            return f"{flag} must be >= {least}, got {value}"
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr must be a finite number > 0, got {args.lr}"
    if not (math.isfinite(args.clip) and args.clip >= 0):
        return f"--clip must be a finite number >= 0, got {args.clip}"
    return None


def _progress_printer(total: int, start: float):
    tty = sys.stdout.isatty()
    done = [0]

    def progress(mode, step, reward):
        done[0] += 1
        if not tty and done[0] % max(1, total // 10) and done[0] != total:
            return
        width = 30
        filled = int(width * done[0] / total)
        sys.stdout.write(
            ("\r" if tty else "") + f"[{'#' * filled}{'.' * (width - filled)}] {done[0]}/{total} {mode:<12} step {step:>3} "
            f"reward {reward:.2f} ({time.perf_counter() - start:.0f}s)" + ("" if tty else "\n")
        )
        sys.stdout.flush()

    return progress


def run_demo(args) -> int:
    # deferred: the training needs torch, which the options (and lossagg check) do without
    import torch

    from lossagg.demo.train import train_mode  # deferred: imports torch (see above)

    args.config_obj = None
    if args.config:
        try:
            args.config_obj = LossAggregationConfig.from_file(args.config)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 1
        if args.config_obj.mode not in args.modes:
            args.modes = [*args.modes, args.config_obj.mode]
        # the groups the demo samples must be the config's groups
        n = args.config_obj.n_samples_per_prompt
        if n is not None:
            if n < 2:
                print(
                    f"lossagg demo: {args.config}: n_samples_per_prompt must be >= 2 for the demo "
                    f"(group-relative advantages need two samples per prompt), got {n}",
                    file=sys.stderr,
                )
                return 2
            args.n_samples_per_prompt = n
    problem = _check_demo_args(args)
    if problem:
        print(f"lossagg demo: {problem}", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, ".lossagg-write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        print(f"lossagg demo: --out {args.out!r} is not a writable folder ({exc.strerror or exc})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    start = time.perf_counter()
    progress = _progress_printer(args.steps * len(args.modes), start)
    results = {mode: train_mode(mode, args, progress) for mode in args.modes}
    sys.stdout.write("\n")

    table, ok = summarise(results)
    print(table)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(table + "\n")
    print("split invariance: one step split into 4 micro-batches gives the unsplit gradient " + ("(checked for every mode)" if ok else "-- FAILED"))
    sessions = [m for m in args.modes if MODES[m].needs_sessions]
    if sessions:
        print(
            f"sessions: the task is single-turn, so each rollout is a session of one sample and {', '.join(sessions)} "
            "give their one-sample form (docs/modes.md, 'Sessions')"
        )
    figure = write_figure(results, args.out)
    if figure:
        print(f"figure: {figure}")
    print(f"table: {os.path.join(args.out, 'summary.md')}  ({time.perf_counter() - start:.0f}s)")
    return 0 if ok else 1
