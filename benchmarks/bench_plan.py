"""What planning a step costs: building a :class:`lossagg.StepPlan` (one process, token counts given) and
closing a :class:`lossagg.DeferredPlan` (its all-reduces aside: one process), against one ``lossagg.reduce``
forward of a 16-token micro-batch (the op's own per-call floor), for every built-in mode at 64 to 4,096
samples. Issue 60's goal: a plan in <= 50 µs for steps up to 4,096 samples in every mode.

Contenders are timed interleaved in one process, medians of the rounds (benchmarks/bench_reduce.py's harness);
the step's samples: token counts 0-1,023 (one in eight empty), prompt groups of 8, sessions of 2 samples.

    python benchmarks/bench_plan.py [--rounds 201] [--sizes 64 4096]
    python benchmarks/bench_plan.py --standalone   # each build timed alone (timeit: best of 7 repeats of 300)

Interleaving leaves every call with cold caches (each contender evicts the others'); ``--standalone`` times a
build in a loop of its own, warm, as a trainer that plans once per step does not see it, but steadier on a
shared machine: the same command before and after a change compares the two.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_reduce  # noqa: E402  (the harness: interleaved medians, the CPU's description)

import lossagg  # noqa: E402

GROUP, SESSION = 8, 2


def step_samples(n: int, seed: int = 0):
    """Token counts (one in eight empty), prompt groups of :data:`GROUP` samples and sessions of :data:`SESSION`."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 1024, (n,), generator=g)
    counts[::8] = 0
    return counts, torch.arange(n) // GROUP, torch.arange(n) // SESSION


def labels_for(mode: str, groups, sessions) -> dict:
    spec = lossagg.MODES[mode]
    out = {}
    if spec.needs_groups:
        out["group_index"] = groups
    if spec.needs_sessions:
        out["session_index"] = sessions
    return out


def config_for(mode: str) -> lossagg.LossAggregationConfig:
    spec = lossagg.MODES[mode]
    # under a mode with sessions in prompt groups, n_samples_per_prompt counts each group's sessions
    n = GROUP // SESSION if (spec.needs_groups and spec.needs_sessions) else GROUP
    return lossagg.LossAggregationConfig(mode=mode, n_samples_per_prompt=n, **({"divisor": 64.0} if spec.needs_divisor else {}))


def deferred_close(config, counts, labels):
    """A DeferredPlan of one micro-batch holding every sample (one segment each), its loss run, ready to close:
    returns the call that closes a fresh copy (the micro-batch is set up outside the timing)."""
    n = counts.numel()
    cu = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(counts.clamp(min=1), 0, out=cu[1:])
    mask = torch.zeros(int(cu[-1]), dtype=torch.bool)
    for i in range(n):
        mask[int(cu[i]) : int(cu[i]) + int(counts[i])] = True
    values = torch.zeros(mask.numel())

    def make():
        plan = lossagg.DeferredPlan(config, n, **labels)
        plan.loss(values, plan.micro_batch(slice(0, n), mask, cu))
        return plan

    return make


def standalone(args) -> None:
    import timeit

    def best(f) -> float:
        return min(timeit.repeat(f, number=300, repeat=7)) / 300 * 1e6

    x, m = torch.randn(16), torch.ones(16, dtype=torch.bool)
    cu16, d16 = torch.tensor([0, 4, 8, 12, 16]), torch.full((4,), 4.0, dtype=torch.float64)
    print(
        f"# plan build alone: torch {torch.__version__}, CPU ({bench_reduce.cpu_description()}, {torch.get_num_threads()} threads); "
        "timeit, best of 7 repeats of 300 calls, the reduce timed before each mode\n"
    )
    print("| mode | samples | StepPlan build (µs) | reduce, 16 tokens (µs) | build / reduce |")
    print("|---|---:|---:|---:|---:|")
    for mode in args.modes:
        config = config_for(mode)
        for n in args.sizes:
            counts, groups, sessions = step_samples(n)
            labels = labels_for(mode, groups, sessions)
            reduce_us = best(lambda: lossagg.reduce(x, m, cu_seqlens=cu16, sample_denoms=d16))
            build_us = best(lambda config=config, counts=counts, labels=labels: lossagg.StepPlan(config, counts, **labels))
            print(f"| {mode} | {n} | {build_us:.1f} | {reduce_us:.1f} | {build_us / reduce_us:.1f}x |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=201)
    p.add_argument("--sizes", type=int, nargs="*", default=[64, 4096])
    p.add_argument("--modes", nargs="*", default=list(lossagg.MODES))
    p.add_argument("--standalone", action="store_true", help="time each build alone (timeit), with the 16-token reduce timed the same way")
    args = p.parse_args(argv)
    if args.standalone:
        standalone(args)
        return
    print(
        f"# plan build and DeferredPlan close: torch {torch.__version__}, CPU ({bench_reduce.cpu_description()}, "
        f"{torch.get_num_threads()} threads, lossagg CPU kernels: {lossagg.cpu_isa()}); medians of {args.rounds} interleaved rounds\n"
    )
    x, m = torch.randn(16), torch.ones(16, dtype=torch.bool)
    cu16, d16 = torch.tensor([0, 4, 8, 12, 16]), torch.full((4,), 4.0, dtype=torch.float64)
    print("| mode | samples | StepPlan build (µs) | DeferredPlan close (µs) | reduce, 16 tokens (µs) | build / reduce | close / reduce |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    worst = worst_ratio = 0.0
    for mode in args.modes:
        config = config_for(mode)
        for n in args.sizes:
            counts, groups, sessions = step_samples(n)
            labels = labels_for(mode, groups, sessions)
            make = deferred_close(config, counts, labels)
            pending = [make() for _ in range(args.rounds + 3)]  # one fresh plan per close, made before the timing
            runners = {
                "build": lambda config=config, counts=counts, labels=labels: lossagg.StepPlan(config, counts, **labels),
                "close": lambda pending=pending: pending.pop().close(),
                "reduce": lambda: lossagg.reduce(x, m, cu_seqlens=cu16, sample_denoms=d16),
            }
            t = bench_reduce.interleaved_medians(runners, "cpu", args.rounds)
            us = {k: v * 1e3 for k, v in t.items()}
            worst = max(worst, us["build"], us["close"])
            worst_ratio = max(worst_ratio, us["build"] / us["reduce"], us["close"] / us["reduce"])
            print(
                f"| {mode} | {n} | {us['build']:.1f} | {us['close']:.1f} | {us['reduce']:.1f} | "
                f"{us['build'] / us['reduce']:.1f}x | {us['close'] / us['reduce']:.1f}x |"
            )
    print(f"\nslowest build or close: {worst:.0f} µs, cache-cold (goal: <= 50 µs on the issue's machine, timed alone)")
    print(
        f"slowest build or close against the reduce of the same round: {worst_ratio:.1f}x "
        f"(the goal in those units: 50 µs where the reduce took 8.6 µs, {50 / 8.6:.1f}x)"
    )


if __name__ == "__main__":
    main()
