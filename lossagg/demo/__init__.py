"""``lossagg demo``: GRPO on a tiny counting task, single- and multi-turn, under each aggregation mode,
over several seeds.

:mod:`.train` holds the task, the policy and the training loop; :mod:`.report` the
summary and the figure. The command-line options are defined here, without torch, so
``lossagg --help`` and ``lossagg check`` do not load it (each run imports the training,
and with it torch, when it starts).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.demo.report import summarise, write_figure
from lossagg.modes import MODES

#: the task variants (lossagg.demo.train, which imports torch, keeps their rules): name -> most turns per session
TASKS = {"single-turn": 1, "multi-turn": 3}


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    names = list(MODES)  # the modes registered when the parser is built
    p.add_argument("--modes", nargs="+", default=names, choices=names, help="modes to run (default: every registered mode)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="task variants (default: both)")
    p.add_argument("--seeds", type=int, default=3, help="runs per mode and task, seeds 0.. (default 3)")
    p.add_argument("--out", default="demo-out", help="folder for the figure, the summary and the runs' histories (default demo-out)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--n-samples-per-prompt", type=int, default=8, help="sessions per prompt (default 8)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=None, help="processes running the runs (default: the CPUs this process may use)")
    p.add_argument("--config", default=None, help="a config file; its mode's runs use it (lossagg check format)")


def _check_demo_args(args) -> str | None:
    """What is wrong with the demo's options, if anything (one line)."""
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--prompts-per-step", args.prompts_per_step, 1),
        # group-relative advantages need at least two samples per prompt (a std of one is NaN)
        ("--n-samples-per-prompt", args.n_samples_per_prompt, 2),
        ("--micro-batches", args.micro_batches, 1),
        ("--seeds", args.seeds, 1),
        ("--workers", 1 if args.workers is None else args.workers, 1),
    ):
        if value < least:
            return f"{flag} must be >= {least}, got {value}"
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr must be a finite number > 0, got {args.lr}"
    if not (math.isfinite(args.clip) and args.clip >= 0):
        return f"--clip must be a finite number >= 0, got {args.clip}"
    return None


def run_demo(args) -> int:
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
    started = time.perf_counter()
    runs = planned_runs(args)
    if not runs:
        print(
            f"lossagg demo: nothing to run: --modes {' '.join(args.modes)} are session modes, which run on the multi-turn task only "
            f"(--tasks {' '.join(args.tasks)}; on the single-turn task each is its sample mode)",
            file=sys.stderr,
        )
        return 2
    results = run_all(runs, args)
    summary, ok = summarise(results, args)
    print(summary)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(summary + "\n")
    with open(os.path.join(args.out, "runs.json"), "w") as f:
        json.dump({"settings": _settings(args), "runs": results}, f)
    figure = write_figure(results, args.out)
    if figure:
        print(f"figure: {figure}")
    print(
        f"summary: {os.path.join(args.out, 'summary.md')}; every run's per-step history: {os.path.join(args.out, 'runs.json')} "
        f"({time.perf_counter() - started:.0f} s)"
    )
    return 0 if ok else 1


def planned_runs(args) -> list[tuple[str, str, int]]:
    """(task, mode, seed) of every run. A session of the single-turn task is one answer, so there a session
    mode is its sample mode's twin (docs/modes.md, "Sessions"): the session modes run on the multi-turn task."""
    return [
        (task, mode, seed)
        for task in args.tasks
        for mode in args.modes
        if task != "single-turn" or not MODES[mode].needs_sessions
        for seed in range(args.seed, args.seed + args.seeds)
    ]


def _settings(args) -> dict:
    keys = ("steps", "seeds", "seed", "prompts_per_step", "n_samples_per_prompt", "micro_batches", "lr", "clip")
    return {k: getattr(args, k) for k in keys}


def _run(job):
    import torch  # deferred: the options (this module) do without torch

    from lossagg.demo.train import train_run  # deferred: imports torch (see the module docstring)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a run's numbers do not depend on where it ran
    try:
        (task, mode, seed), args, check_split = job
        return train_run(task, mode, seed, args, check_split=check_split)
    finally:
        torch.set_num_threads(threads)


def run_all(runs, args) -> list[dict]:
    """Every run, on ``args.workers`` processes (forked where the platform has fork); one line per mode and task
    once its seeds are done, with their time. Each run starts from its own seed, so the results do not depend
    on the number of processes."""

    workers = args.workers
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(workers, len(runs)))
    # the split check once per mode and task, on its first seed
    jobs = [(run, args, run[2] == args.seed) for run in runs]
    per_pair: dict[tuple[str, str], list[dict]] = {}
    pairs = list(dict.fromkeys((task, mode) for task, mode, _ in runs))
    results = []

    def finished(result):
        results.append(result)
        pair = (result["task"], result["mode"])
        per_pair.setdefault(pair, []).append(result)
        if len(per_pair[pair]) == args.seeds:
            rewards = [sum(r["history"]["reward"][-max(1, args.steps // 5) :]) / max(1, args.steps // 5) for r in per_pair[pair]]
            print(
                f"[{sum(len(v) == args.seeds for v in per_pair.values())}/{len(pairs)}] {pair[0]:<11} {pair[1]:<26} "
                f"{args.seeds} seed{'s' if args.seeds > 1 else ''}, final reward {sum(rewards) / len(rewards):.2f}, "
                f"{sum(r['seconds'] for r in per_pair[pair]):.1f} s",
                flush=True,
            )

    if workers == 1:
        for job in jobs:
            finished(_run(job))
    else:
        # forked on Linux (the runs inherit the imports); spawned elsewhere, where fork under torch is unsafe
        method = "fork" if sys.platform.startswith("linux") else "spawn"
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
            for result in pool.map(_run, jobs):
                finished(result)
    order = {run: i for i, run in enumerate(runs)}
    return sorted(results, key=lambda r: order[(r["task"], r["mode"], r["seed"])])
