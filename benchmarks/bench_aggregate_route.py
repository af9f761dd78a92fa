"""Is ``lossagg.aggregate`` worth its own route? Its one-pass route (the native ``aggregate`` op: the
sums, the counts, ``d`` and ``J`` from one read of the loss and the mask) against the route every
plan takes (a :class:`lossagg.StepPlan` from the mask, then the one micro-batch reduction,
``plan.loss``) and against the raw ``lossagg.reduce`` given ``d``, at 16 tokens, 0.5M and 4M tokens.

The rule (issue 60): retire the one-pass route if the plan route is within 1.1x of it at every size
and pass; otherwise keep it. (Issue 44's rule, printed beside it: the plan route within 1.3x the raw
reduce at 4M tokens and within 3 µs of the one-pass route at 16 tokens.) Contenders are
timed interleaved, medians of the rounds (benchmarks/bench_reduce.py's harness), forward and
forward+backward.

    python benchmarks/bench_aggregate_route.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_reduce  # noqa: E402  (the harness: batches, interleaved medians, the CPU's description)

import lossagg  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=101)
    args = p.parse_args(argv)
    print(
        f"# aggregate's route: torch {torch.__version__}, CPU ({bench_reduce.cpu_description()}, {torch.get_num_threads()} threads, "
        f"lossagg CPU kernels: {lossagg.cpu_isa()}); medians of {args.rounds} interleaved rounds (fewer for 4M)\n"
    )
    cases = [
        ("16 tokens (B=4 x ~4)", 4, 4, args.rounds * 10),
        ("0.5M tokens (B=1024 x ~512)", 1024, 512, args.rounds),
        ("4M tokens (B=64 x ~64k)", 64, 65536, 21),
    ]
    print("| case | mode | pass | one-pass route (µs) | plan route (µs) | raw reduce (µs) | plan − one-pass (µs) | plan / one-pass | plan / raw |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    verdict = {}
    for name, n, mean_len, rounds in cases:
        b = bench_reduce.make_packed(n, mean_len, "cpu")
        for mode in ("sample_mean", "token_mean"):
            cfg = lossagg.LossAggregationConfig(mode=mode)
            d = lossagg.StepPlan.from_mask(cfg, b["mask"], b["cu"]).sample_denoms
            mask, cu = b["mask"], b["cu"]
            for pass_name in ("fwd", "fwd+bwd"):
                leaf = b["values"].clone().requires_grad_(pass_name == "fwd+bwd")

                def run(fn, leaf=leaf, pass_name=pass_name):
                    def go():
                        j = fn(leaf)
                        if pass_name == "fwd+bwd":
                            j.backward()

                    return go

                fns = {
                    "one_pass": run(lambda v, c=cfg, m=mask, cu=cu: lossagg.aggregate(c, v, m, cu_seqlens=cu)),
                    "plan": run(lambda v, c=cfg, m=mask, cu=cu: lossagg.StepPlan.from_mask(c, m, cu).loss(v, m, slice(None), cu)),
                    "raw": run(lambda v, m=mask, cu=cu, d=d: lossagg.reduce(v, m, cu_seqlens=cu, sample_denoms=d)),
                }
                med = bench_reduce.interleaved_medians(fns, "cpu", rounds)
                us = {k: v * 1e3 for k, v in med.items()}
                diff, ratio, routes = us["plan"] - us["one_pass"], us["plan"] / us["raw"], us["plan"] / us["one_pass"]
                verdict[(name, mode, pass_name)] = (diff, ratio, routes)
                print(
                    f"| {name} | {mode} | {pass_name} | {us['one_pass']:.1f} | {us['plan']:.1f} | {us['raw']:.1f} | {diff:+.1f} | "
                    f"{routes:.2f} | {ratio:.2f} |"
                )
    small = max(v[0] for k, v in verdict.items() if k[0].startswith("16 tokens"))
    large = max(v[1] for k, v in verdict.items() if k[0].startswith("4M"))
    worst = max(verdict.items(), key=lambda kv: kv[1][2])
    print(f"\nplan route / one-pass route, worst: {worst[1][2]:.2f} ({', '.join(worst[0])}) (issue 60's rule: <= 1.1 at every size)")
    print(f"plan route − one-pass route at 16 tokens, worst: {small:+.1f} µs; plan route / raw reduce at 4M tokens, worst: {large:.2f}")
    print("verdict: " + ("retire the one-pass route" if worst[1][2] <= 1.1 else "keep the one-pass route"))


if __name__ == "__main__":
    main()
