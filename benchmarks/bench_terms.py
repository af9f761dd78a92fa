"""K = 3 loss terms in one call (``StepPlan.loss``) against 3 single-term calls and against
the memory floor, side by side in one process (docs/terms.md, docs/benchmarks.md).

Contenders, timed interleaved (one call each per round, in a fresh seeded order every round;
medians):

  one_call    plan.loss({pg, entropy, kl}, plan.micro_batch(...)): the whole loss from the plan, as
              a trainer pays it per micro-batch (the handle's checks and look-ups, then one
              lossagg.reduce_terms call)
  handle_made plan.loss({pg, entropy, kl}, mb) with the micro-batch made once before: the call a
              trainer compiles
  one_op      lossagg.reduce_terms with the [K, B] d given: the one call itself, the
              counterpart of three_calls
  three_calls lossagg.reduce once per term with that term's d[i] given (each call rereads the
              mask): the lower bound of three single-term calls
  floor       the three values' .sum() (one read of each value tensor); forward and backward,
              the autograd engine's own cost of a three-leaf backward that writes three gradients

The bytes of one step are those the terms and the mask must be read in: ``4K·T + T`` for float32
values and a bool mask (K = 3; forward and backward, ``8K·T + T``: the gradients written too).
Ratios are of bandwidths (or times) measured in this run.

    python benchmarks/bench_terms.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reduce import cpu_description  # noqa: E402  (the machine, as bench_reduce describes it)

import lossagg  # noqa: E402

K = 3
COEFFICIENTS = {"entropy": -0.01, "kl": 0.05}


def make_case(num_samples: int, mean_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (num_samples,), generator=g)
    cu = lossagg.cu_seqlens_from_lengths(lengths)
    total = int(cu[-1])
    mask = torch.rand(total, generator=g) < 0.9
    values = {name: torch.randn(total, generator=g) for name in ("pg", "entropy", "kl")}
    groups = torch.arange(num_samples) // 4
    config = lossagg.LossAggregationConfig.from_dict(
        {
            "mode": "prompt_mean",
            "n_samples_per_prompt": 4,
            "terms": {"entropy": {"coefficient": COEFFICIENTS["entropy"]}, "kl": {"mode": "token_mean", "coefficient": COEFFICIENTS["kl"]}},
        }
    )
    plan = lossagg.StepPlan.from_mask(config, mask, cu, group_index=groups)
    d = {name: plan.term_denoms[name].float() for name in values}
    table = torch.stack([d[name] for name in values])
    mb = plan.micro_batch(slice(None), mask, cu)
    return dict(values=values, mask=mask, cu=cu, plan=plan, mb=mb, d=d, table=table, total=total)


def one_call(c, values):
    return c["plan"].loss(values, c["plan"].micro_batch(slice(None), c["mask"], c["cu"]))


def handle_made(c, values):
    return c["plan"].loss(values, c["mb"])


def one_op(c, values):
    coefficients = [1.0, *COEFFICIENTS.values()]
    return lossagg.reduce_terms(list(values.values()), c["mask"], cu_seqlens=c["cu"], sample_denoms=c["table"], coefficients=coefficients)[0]


def three_calls(c, values):
    total = lossagg.reduce(values["pg"], c["mask"], cu_seqlens=c["cu"], sample_denoms=c["d"]["pg"])
    for name, coefficient in COEFFICIENTS.items():
        total = total + coefficient * lossagg.reduce(values[name], c["mask"], cu_seqlens=c["cu"], sample_denoms=c["d"][name])
    return total


def floor(c, values):
    return sum(v.sum() for v in values.values())


def runner(fn, c, backward):
    if not backward:
        return lambda: fn(c, c["values"])
    leaves = {k: v.detach().requires_grad_(True) for k, v in c["values"].items()}

    def run():
        for v in leaves.values():
            v.grad = None
        fn(c, leaves).backward()

    return run


def medians(runners, rounds, seed=0):
    order = random.Random(seed)
    for run in runners.values():
        for _ in range(3):
            run()
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name in order.sample(list(runners), len(runners)):
            t0 = time.perf_counter()
            runners[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=41)
    args = p.parse_args(argv)
    cases = {"small (B=32 x ~512, ~16k tokens)": (32, 512), "memory-sized (B=256 x ~16k, ~4.2M tokens)": (256, 16384)}
    print(
        f"# lossagg K={K} terms: torch {torch.__version__}, cpu ({cpu_description()}, {torch.get_num_threads()} threads, "
        f"lossagg CPU kernels: {lossagg._native.cpu_isa()}); medians of {args.rounds} interleaved rounds\n"
    )
    print("| case | pass | contender | median ms | x one_call time | GB/s of 4K·T+T bytes |")
    print("|---|---|---|---|---|---|")
    results = {}
    for case, (b, mean_len) in cases.items():
        c = make_case(b, mean_len)
        nbytes = 4 * K * c["total"] + c["total"]
        for pass_name, backward in (("fwd", False), ("fwd+bwd", True)):
            contenders = {"one_call": one_call, "handle_made": handle_made, "one_op": one_op, "three_calls": three_calls, "floor": floor}
            got = medians({name: runner(fn, c, backward) for name, fn in contenders.items()}, args.rounds)
            results[(case, pass_name)] = got
            for name, ms in got.items():
                gbps = nbytes / (ms * 1e-3) / 1e9 if name != "floor" else 4 * K * c["total"] / (ms * 1e-3) / 1e9
                if backward:  # forward and backward: the values read and their gradients written, 8K·T + T bytes
                    gbps = (8 * K * c["total"] + (c["total"] if name != "floor" else 0)) / (ms * 1e-3) / 1e9
                print(f"| {case} | {pass_name} | {name} | {ms:.3f} | {ms / got['one_call']:.2f} | {gbps:.1f} |")
    print("\n## Goals (ratios from this run)\n")
    print("| goal | measured | wanted | met |")
    print("|---|---|---|---|")
    small, big = cases
    r = results[(big, "fwd")]
    # bandwidths of the bytes each must read: 4K·T + T for the contenders, 4K·T for the floor (T cancels)
    one = (4 * K + 1) / r["one_call"] / (4 * K / r["floor"])
    three = (4 * K + 1) / r["three_calls"] / (4 * K / r["floor"])
    print(f"| fwd, one_call GB/s / floor GB/s, {big} | {one:.2f} | >= 0.90 | {'yes' if one >= 0.9 else 'no'} |")
    print(f"| fwd, three_calls GB/s / floor GB/s, {big} | {three:.2f} | for comparison (rereads the mask: at most 13/15) | |")
    for pass_name in ("fwd", "fwd+bwd"):
        for name in ("one_op", "one_call", "handle_made"):
            ratio = results[(small, pass_name)][name] / results[(small, pass_name)]["three_calls"]
            print(f"| {pass_name}, {name} time / three_calls time, {small} | {ratio:.2f} | <= 0.5 | {'yes' if ratio <= 0.5 else 'no'} |")
    r = results[(small, "fwd+bwd")]
    for name in ("one_op", "one_call", "handle_made"):  # the goal since the autograd engine's floor was measured (2026-12-03)
        ratio = r[name] / r["floor"]
        met = "yes" if ratio <= 1.15 else "no"
        print(f"| fwd+bwd, {name} time / the floor's (the autograd engine's three-leaf backward), {small} | {ratio:.2f} | <= 1.15 | {met} |")
    beyond = (r["one_op"] - r["floor"]) / (r["three_calls"] - r["floor"])
    print(f"| fwd+bwd, one_op / three_calls beyond the floor's own cost, {small} | {beyond:.2f} | for comparison | |")


if __name__ == "__main__":
    main()
