"""The plan's cost in two builds of lossagg: building a :class:`lossagg.StepPlan` from token counts (one process),
making a :class:`lossagg.DeferredPlan` and closing one (one process, its micro-batch run beforehand), every built-in mode at
64 and 4,096 samples (benchmarks/bench_plan.py's steps), with one ``lossagg.reduce`` of a 16-token micro-batch as
the per-call floor, in this checkout's build and in a baseline's.

Each build runs in a process of its own (two builds of the same ops cannot share one), three runs each in
alternating order; each figure is the best of its runs: a build or a make is ``timeit``'s best of 7 repeats of 300 calls,
a close the best single call over 5 x 200 fresh plans.

    python benchmarks/compare_plan_builds.py --baseline /path/to/folder/holding/old/lossagg [--runs 3]

The baseline folder holds an importable ``lossagg`` package with its built library (e.g. a ``git worktree`` of an
older commit built with ``python setup.py build_ext --inplace``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKER = r"""
import json, sys, timeit, torch
sys.path.insert(0, BENCHMARKS)
import bench_plan, lossagg
def best(f, number=300, repeat=7):
    return min(timeit.repeat(f, number=number, repeat=repeat)) / number * 1e6
out = {}
x, m = torch.randn(16), torch.ones(16, dtype=torch.bool)
cu16, d16 = torch.tensor([0, 4, 8, 12, 16]), torch.full((4,), 4.0, dtype=torch.float64)
out["reduce, 16 tokens"] = best(lambda: lossagg.reduce(x, m, cu_seqlens=cu16, sample_denoms=d16))
for mode in lossagg.MODES:
    config = bench_plan.config_for(mode)
    for n in (64, 4096):
        counts, groups, sessions = bench_plan.step_samples(n)
        labels = bench_plan.labels_for(mode, groups, sessions)
        out[f"build {mode} {n}"] = best(lambda: lossagg.StepPlan(config, counts, **labels))
        # a DeferredPlan made (the labels' half of its close is done here where the mode reads sessions), then closed
        out[f"make {mode} {n}"] = best(lambda: lossagg.DeferredPlan(config, n, **labels))
        make = bench_plan.deferred_close(config, counts, labels)
        t = []
        for _ in range(5):
            plans = [make() for _ in range(200)]
            t.append(min(timeit.repeat(lambda: plans.pop().close(), number=1, repeat=200)) * 1e6)
        out[f"close {mode} {n}"] = min(t)
print(json.dumps(out))
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a folder holding the baseline's importable lossagg package, built")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.baseline, "lossagg", "__init__.py")):
        p.error(f"--baseline must be a folder holding a lossagg package, got {args.baseline!r}")
    builds = {"baseline": args.baseline, "this build": ROOT}
    results: dict[str, list[dict]] = {name: [] for name in builds}
    for r in range(args.runs):
        for name in list(builds) if r % 2 == 0 else list(builds)[::-1]:
            env = dict(os.environ, PYTHONPATH=builds[name])
            code = f"BENCHMARKS = {HERE!r}\n" + WORKER
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=HERE)
            if done.returncode:
                sys.exit(f"the {name}'s worker failed:\n{done.stderr[-3000:]}")
            results[name].append(json.loads(done.stdout))
    print("| what | baseline (µs) | this build (µs) | baseline / this build |")
    print("|---|---:|---:|---:|")
    for key in results["this build"][0]:
        b = min(run[key] for run in results["baseline"])
        n = min(run[key] for run in results["this build"])
        print(f"| {key} | {b:.1f} | {n:.1f} | {b / n:.2f}x |")


if __name__ == "__main__":
    main()
