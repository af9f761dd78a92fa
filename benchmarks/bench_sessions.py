"""The session modes (docs/modes.md, "Sessions") through the one call, ``lossagg.aggregate``, against
``sample_mean`` (the native one-pass program) and ``prompt_mean`` (planned in Python, as the session
modes are), measured in the same run.

Forward and backward of one step of float32 per-token losses on the CPU: 1024 samples of 1024
tokens, a bool mask, prompt groups of 8 samples, sessions of 2. The contenders are timed
interleaved (one call each per round, in a fresh seeded order every round), after warm-up rounds;
medians and the ratio to ``sample_mean`` are printed.

    python benchmarks/bench_sessions.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

import lossagg

MODES = ("sample_mean", "prompt_mean", "session_mean", "session_token_mean", "prompt_session_mean", "prompt_session_token_mean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    samples, tokens = 1024, 1 << 20
    cu = lossagg.cu_seqlens_from_lengths(torch.full((samples,), tokens // samples), dtype=torch.int64)
    values = torch.randn(tokens, requires_grad=True)
    mask = torch.rand(tokens) < 0.8
    groups = torch.arange(samples) // 8
    sessions = torch.arange(samples) // 2
    configs = {m: lossagg.LossAggregationConfig(mode=m) for m in MODES}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    order = list(MODES)
    rng = random.Random(0)
    for r in range(args.warmup + args.rounds):
        rng.shuffle(order)
        for m in order:
            t0 = time.perf_counter()
            j = lossagg.aggregate(configs[m], values, mask, cu_seqlens=cu, group_index=groups, session_index=sessions)
            j.backward()
            elapsed = time.perf_counter() - t0
            values.grad = None
            if r >= args.warmup:
                times[m].append(elapsed)
    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {cpu}, {torch.get_num_threads()} threads, lossagg ISA {lossagg.cpu_isa()}, {samples} samples, {tokens} tokens")
    base = statistics.median(times["sample_mean"])
    for m in MODES:
        med = statistics.median(times[m])
        print(f"{m:26s} {med * 1e3:8.2f} ms  {med / base:5.2f}x sample_mean")


if __name__ == "__main__":
    main()
