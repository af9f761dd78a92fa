"""The session modes (docs/modes.md, "Sessions") against ``sample_mean`` and ``prompt_mean``, measured in the
same run, by two routes: the one call, ``lossagg.aggregate`` (one native call each: ``aggregate`` for
``sample_mean``, ``aggregate_planned`` for the modes with groups or sessions), and a plan (a
``lossagg.StepPlan`` built from the token counts and the labels, then ``lossagg.reduce`` with its
``sample_denoms``).

Forward and backward of one step of float32 per-token losses on the CPU: 1024 samples of 1024
tokens, a bool mask, prompt groups of 8 samples, sessions of 2 (n_samples_per_prompt 8, or 4 sessions for
the modes that count each group's sessions). The contenders (every mode by both routes) are timed
interleaved (one call each per round, in a fresh seeded order every round), after warm-up rounds;
medians and the ratio to ``sample_mean`` by the same route are printed.

Each backward allocates a fresh 4 MiB gradient. Left to its defaults, glibc's malloc hands such pages back to
the system and faults them in again at random, which added about 0.6 ms to whole runs of some contenders on a
2-core Xeon (bimodal medians, 0.4 or 1.0 ms for the same call). The script keeps freed memory in the process
(``mallopt``, glibc only; said in the output) so that every contender pays the same.

    python benchmarks/bench_sessions.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import random
import statistics
import time

import torch

import lossagg

MODES = ("sample_mean", "prompt_mean", "session_mean", "session_token_mean", "prompt_session_mean", "prompt_session_token_mean")


def keep_freed_memory() -> str:
    """glibc's malloc told to keep freed memory (no trimming, large blocks from the heap): what the output says."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        done = [libc.mallopt(m_trim_threshold, 1 << 30), libc.mallopt(m_top_pad, 64 << 20), libc.mallopt(m_mmap_threshold, 32 << 20)]
    except (OSError, AttributeError):
        return "allocator: as configured (not glibc)"
    return "allocator: glibc, freed memory kept (mallopt)" if all(done) else "allocator: glibc, mallopt refused"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    allocator = keep_freed_memory()
    torch.manual_seed(0)
    samples, tokens = 1024, 1 << 20
    cu = lossagg.cu_seqlens_from_lengths(torch.full((samples,), tokens // samples), dtype=torch.int64)
    values = torch.randn(tokens, requires_grad=True)
    mask = torch.rand(tokens) < 0.8
    groups = torch.arange(samples) // 8
    sessions = torch.arange(samples) // 2
    configs = {}
    for m in MODES:
        spec = lossagg.MODES[m]
        per_prompt = 4 if spec.needs_groups and spec.needs_sessions else 8 if spec.needs_groups else None
        configs[m] = lossagg.LossAggregationConfig(mode=m, n_samples_per_prompt=per_prompt)
    counts = lossagg.token_counts(mask, cu)  # the rollout's counts, as a trainer has them before the step

    def through_aggregate(m: str) -> None:
        lossagg.aggregate(configs[m], values, mask, cu_seqlens=cu, group_index=groups, session_index=sessions).backward()

    def through_a_plan(m: str) -> None:
        plan = lossagg.StepPlan(configs[m], counts, group_index=groups, session_index=sessions)
        lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=plan.sample_denoms).backward()

    routes = {"aggregate": through_aggregate, "plan": through_a_plan}
    times: dict[tuple[str, str], list[float]] = {(route, m): [] for route in routes for m in MODES}
    order = list(times)
    rng = random.Random(0)
    for r in range(args.warmup + args.rounds):
        rng.shuffle(order)
        for route, m in order:
            t0 = time.perf_counter()
            routes[route](m)
            elapsed = time.perf_counter() - t0
            values.grad = None
            if r >= args.warmup:
                times[route, m].append(elapsed)
    cpu = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {cpu}, {threads} threads, lossagg ISA {lossagg.cpu_isa()}, {samples} samples, {tokens} tokens; {allocator}")
    print(f"{'mode':26s} {'aggregate':>10s} {'ratio':>6s} {'plan':>10s} {'ratio':>6s}   (forward+backward, medians of {args.rounds} rounds)")
    for m in MODES:
        cells = []
        for route in routes:
            med = statistics.median(times[route, m])
            cells.append(f"{med * 1e3:7.2f} ms {med / statistics.median(times[route, 'sample_mean']):5.2f}x")
        print(f"{m:26s} {cells[0]} {cells[1]}")


if __name__ == "__main__":
    main()
