"""``lossagg.aggregate(config, ...)`` against the raw op it replaces, forward only, at the bar's size (B=1,024 samples of
~512 float32 tokens, packed; docs/benchmarks.md, issue 60's goal: <= 1.1x): ``lossagg.reduce`` given the plan's
``d``, and each native op called below autograd, to split the gap between the op and the Python above it.

    python benchmarks/bench_aggregate_call.py [--rounds 301] [--runs 2]

Contenders interleaved in one process, medians of the rounds (benchmarks/bench_reduce.py's harness).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_reduce  # noqa: E402  (the harness: interleaved medians, the CPU's description)

import lossagg  # noqa: E402
from lossagg.ops import _AGGREGATE, _BELOW_AUTOGRAD, _REDUCE  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=301)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    b = bench_reduce.make_packed(1024, 512, "cpu")
    v, m, cu = b["values"], b["mask"], b["cu"]
    print(
        f"# aggregate against reduce, forward, B=1024 x ~512 float32 tokens: torch {torch.__version__}, CPU "
        f"({bench_reduce.cpu_description()}, {torch.get_num_threads()} threads); medians of {args.rounds} interleaved rounds\n"
    )
    print("| mode | run | `reduce` (µs) | `aggregate` (µs) | aggregate / reduce | op: reduce (µs) | op: aggregate (µs) | op / op |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in ("sample_mean", "token_mean"):
        config = lossagg.LossAggregationConfig(mode=mode)
        d = lossagg.StepPlan.from_mask(config, m, cu).sample_denoms
        program = list(lossagg.MODES[mode].denoms.program(config.empty_samples))

        def op_reduce(d=d):
            with _BELOW_AUTOGRAD():
                return _REDUCE(v, m, cu, d)

        def op_aggregate(program=program):
            with _BELOW_AUTOGRAD():
                return _AGGREGATE(v, m, cu, program, 0.0)[0]

        runners = {
            "reduce": lambda d=d: lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=d),
            "aggregate": lambda config=config: lossagg.aggregate(config, v, m, cu_seqlens=cu),
            "op_reduce": op_reduce,
            "op_aggregate": op_aggregate,
        }
        assert torch.equal(runners["reduce"](), runners["aggregate"]())  # the same bits
        for run in range(args.runs):
            t = {k: x * 1e3 for k, x in bench_reduce.interleaved_medians(runners, "cpu", args.rounds, seed=run).items()}
            print(
                f"| {mode} | {run + 1} | {t['reduce']:.1f} | {t['aggregate']:.1f} | {t['aggregate'] / t['reduce']:.3f} | "
                f"{t['op_reduce']:.1f} | {t['op_aggregate']:.1f} | {t['op_aggregate'] / t['op_reduce']:.3f} |"
            )


if __name__ == "__main__":
    main()
