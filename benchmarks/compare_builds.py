"""Two builds of lossagg timed side by side: the one imported here and a baseline package.

Each build runs in its own long-lived worker process (two builds of the same ops cannot
share a process); the parent asks them in turn, one timed call per (build, case, pass) per
round, the order alternating every round, and reports medians and the ratio
baseline / this build. Cases: reduce on B=1024 x ~512 packed tokens, float32 values, with
a bool, an int64 and a float32 mask, and on T=16 tokens (B=2, bool mask: the fixed cost of
a call, Python wrapper and autograd included); forward and forward+backward.

    python benchmarks/compare_builds.py --baseline /path/to/folder/holding/old/lossagg [--rounds 41] [--cases large,small]

The baseline folder holds an importable `lossagg` package with its built library (e.g. a
copy of the package folder of an older build).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time, torch
import lossagg
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
n, mean = 1024, 512
lengths = torch.randint(mean // 2, mean * 3 // 2 + 1, (n,), generator=g)
cu = torch.zeros(n + 1, dtype=torch.int32); cu[1:] = torch.cumsum(lengths, 0)
total = int(cu[-1])
values = torch.randn(total, generator=g)
keep = torch.rand(total, generator=g) < 0.9
small_cu = torch.tensor([0, 7, 16], dtype=torch.int32)
small = (torch.randn(16, generator=g), torch.rand(16, generator=g) < 0.9, small_cu, torch.tensor([7.0, 9.0]))
batches = {name: (values, m, cu, 1.0 + lengths.float()) for name, m in (("bool", keep), ("int64", keep.long()), ("float32", keep.float()))}
batches["T=16 bool"] = small
def fwd(b):
    v, m, c, d = b
    return lossagg.reduce(v, m, cu_seqlens=c, sample_denoms=d)
def fwd_bwd(b):
    v, m, c, d = b
    v = v.detach().requires_grad_(True)
    lossagg.reduce(v, m, cu_seqlens=c, sample_denoms=d).backward()
for b in batches.values():
    for _ in range(20):
        fwd(b); fwd_bwd(b)
print("ready", lossagg.__file__, lossagg.cpu_isa(), flush=True)
for line in sys.stdin:
    batch, pass_name = line.rsplit(" ", 1)
    f = fwd if pass_name.strip() == "fwd" else fwd_bwd
    reps = 200 if batch.startswith("T=16") else 1  # a small call is timed over 200 calls
    b = batches[batch]
    t0 = time.perf_counter()
    for _ in range(reps):
        f(b)
    t1 = time.perf_counter()
    print(f"{(t1 - t0) * 1e3 / reps:.6f}", flush=True)
"""


def start(label: str, pythonpath: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    # the two workers take turns: an idle worker's OpenMP threads must sleep, not spin on
    # the cores the other one is timing
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
    ready = proc.stdout.readline().split()
    if not ready or ready[0] != "ready":
        raise SystemExit(f"worker failed to start (PYTHONPATH={pythonpath})")
    print(f"# {label}: {ready[1]} (CPU kernels: {ready[2]})")
    return proc


def ask(proc: subprocess.Popen, mask: str, pass_name: str) -> float:
    proc.stdin.write(f"{mask} {pass_name}\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="folder holding the baseline lossagg package")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--cases", default="large,small", help="large (B=1024 x ~512, three mask dtypes), small (T=16), or both")
    args = parser.parse_args(argv)
    kinds = set(args.cases.split(","))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    builds = {"baseline": start("baseline", os.path.abspath(args.baseline)), "this build": start("this build", here)}
    batches = (["bool", "int64", "float32"] if "large" in kinds else []) + (["T=16 bool"] if "small" in kinds else [])
    cases = [(m, p) for m in batches for p in ("fwd", "fwd+bwd")]
    times = {(b, c): [] for b in builds for c in cases}
    order = list(builds)
    for r in range(args.rounds):
        for case in cases:
            for b in order if r % 2 == 0 else reversed(order):
                times[(b, case)].append(ask(builds[b], *case))
    for proc in builds.values():
        proc.stdin.close()
        proc.wait()
    print(f"# reduce, float32 values: B=1024 x ~512 packed (mask dtype) and T=16 (B=2); medians of {args.rounds} interleaved rounds (ms per call)\n")
    print("| batch (mask) | pass | baseline | this build | baseline / this build |")
    print("|---|---|---:|---:|---:|")
    for case in cases:
        old = statistics.median(times[("baseline", case)])
        new = statistics.median(times[("this build", case)])
        print(f"| {case[0]} | {case[1]} | {old:.4f} | {new:.4f} | {old / new:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
