"""Speed and memory of lossagg.reduce / segment_sum against the ways trainers do it today.

One run measures every contender on the same packed batches:

  lossagg      torch.ops.lossagg.reduce (this library)
  loop         a per-sample Python loop over slices (how many trainers do it)
  vectorised   the best pure-PyTorch formulation: where(mask) * repeat_interleave(1/d)
  segment_red  torch.segment_reduce(sum) on the masked values, then / d
  floor        forward: values.sum() (one read of the values);
               CUDA: also a device-to-device copy of values+mask, for achieved GB/s

Contenders of a case are timed interleaved, pass by pass (one call of each per round, in a
fresh seeded random order every round) and each figure is the median of the rounds, so a slow spell of a
shared machine hits every contender alike. It prints medians (ms), ratios against lossagg,
GB/s where the bytes moved are clear, and the peak extra memory each contender allocates as
tensors (tracked through a dispatch mode, so it counts every intermediate tensor, not
allocator caching). The last table checks the speed targets, each a ratio measured in
this run.

    python benchmarks/bench_reduce.py                 # CPU table (docs/benchmarks.md)
    python benchmarks/bench_reduce.py --device cuda   # GPU table
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lossagg


def cpu_description() -> str:
    """The CPU's model name and the widest vector ISA it reports, read from the machine."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        import platform

        model = platform.processor() or model
    isa = next((name for name, flag in (("AVX-512", "avx512f"), ("AVX2", "avx2"), ("SSE4.2", "sse4_2")) if flag in flags), "baseline")
    return f"{model}, {isa}"


# --------------------------------------------------------------------------- batches
def make_packed(num_samples: int, mean_len: int, device: str, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (num_samples,), generator=g)
    cu = torch.zeros(num_samples + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    values = torch.randn(total, generator=g).to(dtype)
    mask = torch.rand(total, generator=g) < 0.9
    denoms = 1.0 + lengths.to(torch.float32)
    return dict(
        values=values.to(device),
        mask=mask.to(device),
        cu=cu.to(device),
        lengths=lengths.to(device),
        lengths_list=lengths.tolist(),
        denoms=denoms.to(device),
        total=total,
    )


# ------------------------------------------------------------------------ contenders
def f_lossagg(b, values):
    return lossagg.reduce(values, b["mask"], cu_seqlens=b["cu"], sample_denoms=b["denoms"])


def f_loop(b, values):
    total = values.new_zeros((), dtype=torch.float32)
    for i, (v, m) in enumerate(zip(values.split(b["lengths_list"]), b["mask"].split(b["lengths_list"]), strict=True)):
        total = total + torch.where(m, v, 0).float().sum() / b["denoms"][i]
    return total


def masked(mask, values):
    """values where the mask keeps them, times the mask's weight when it has one (as the ops read a mask)."""
    if mask.dtype == torch.bool:
        return torch.where(mask, values, 0).float()
    kept = torch.where(mask != 0, values, 0).float()
    return kept * mask if mask.is_floating_point() else kept


def f_vectorised(b, values):
    weights = torch.repeat_interleave(1.0 / b["denoms"], b["lengths"], output_size=b["total"])
    return (masked(b["mask"], values) * weights).sum()


def f_segment_reduce(b, values):
    sums = torch.segment_reduce(torch.where(b["mask"], values, 0).float(), "sum", lengths=b["lengths"])
    return (sums / b["denoms"]).sum()


def f_floor(b, values):
    return values.sum()


def s_lossagg(b, values):
    return lossagg.segment_sum(values, b["mask"], b["cu"])


def s_loop(b, values):
    parts = [
        torch.where(m, v, 0).float().sum(-1) for v, m in zip(values.split(b["lengths_list"], -1), b["mask"].split(b["lengths_list"]), strict=True)
    ]
    return torch.stack(parts, -1)


def s_vectorised(b, values):
    seg = torch.repeat_interleave(torch.arange(b["lengths"].numel(), device=values.device), b["lengths"], output_size=b["total"])
    out = values.new_zeros((values.shape[0], b["lengths"].numel()), dtype=torch.float32)
    return out.index_add_(1, seg, torch.where(b["mask"], values, 0).float())


def s_segment_reduce(b, values):
    data = torch.where(b["mask"], values, 0).float().T
    return torch.segment_reduce(data, "sum", lengths=b["lengths"], axis=0).T


def s_floor(b, values):
    return values.sum(-1)


SEGMENT_SUM_CONTENDERS = {
    "lossagg": s_lossagg,
    "loop": s_loop,
    "vectorised": s_vectorised,
    "segment_red": s_segment_reduce,
    "floor": s_floor,
}

CONTENDERS = {
    "lossagg": f_lossagg,
    "loop": f_loop,
    "vectorised": f_vectorised,
    "segment_red": f_segment_reduce,
    "floor": f_floor,
}


# --------------------------------------------------------------------------- timing
def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# Rounds for the cases whose medians feed a bandwidth target: a median of 15 single calls
# moved by +-0.08 between runs on the 2-core machine (the calls follow whichever contender
# ran before them, and that decides what is still in the caches); 61 rounds settle it.
TARGET_ROUNDS = 61


def interleaved_medians(runners: dict, device, repeats, warmup=3, seed=0) -> dict:
    """Median ms of each runner, timed one call per round, the runners in a fresh random order
    every round (seeded): each follows every other about equally often, so none always runs
    right after the one that leaves the cache coldest (a fixed rotation keeps the same
    predecessor for each runner in every round)."""
    names = list(runners)
    order = random.Random(seed)
    for name in names:
        for _ in range(warmup):
            runners[name]()
    sync(device)
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name in order.sample(names, len(names)):
            t0 = time.perf_counter()
            runners[name]()
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of tensors created (and still alive) while the mode is active."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _track(self, t):
        if not isinstance(t, torch.Tensor) or t._base is not None:
            return
        key = t.untyped_storage().data_ptr()
        if key in self._seen or t.untyped_storage().nbytes() == 0:
            return
        self._seen.add(key)
        n = t.untyped_storage().nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t.untyped_storage(), self._release, key, n)

    def _release(self, key, n):
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            self._track(t)
        return out


def peak_extra_bytes(fn):
    with PeakTensorBytes() as mode:
        fn()
    return mode.peak


def fwd_bwd(fn, b, values_key="values"):
    values = b[values_key].detach().requires_grad_(True)

    def run():
        values.grad = None
        out = fn(b, values)
        out.backward(torch.ones_like(out))

    return run


def bwd_only(fn, b, values_key="values"):
    values = b[values_key].detach().requires_grad_(True)
    out = fn(b, values)
    grad = torch.ones_like(out)
    return lambda: torch.autograd.grad(out, values, grad, retain_graph=True)


def runner(fn, b, pass_name, values_key="values"):
    if pass_name == "fwd":

        def run():
            with torch.no_grad():
                return fn(b, b[values_key])

        return run
    if pass_name == "bwd":
        return bwd_only(fn, b, values_key)
    return fwd_bwd(fn, b, values_key)


def bench_case(name, b, device, repeats, contenders, passes, table=None, values_key="values"):
    """Rows (case, pass, contender, median ms, peak extra bytes); the contenders of each pass interleaved."""
    table = CONTENDERS if table is None else table
    runners = {
        (cname, pass_name): runner(table[cname], b, pass_name, values_key)
        for pass_name in passes
        for cname in contenders
        if not (pass_name != "fwd" and cname == "floor")
    }
    medians = {}
    for pass_name in passes:  # the contenders of one pass against each other (a backward's writes would cool the cache for the next one)
        medians.update(interleaved_medians({key: run for key, run in runners.items() if key[1] == pass_name}, device, repeats))
    return [(name, pass_name, cname, medians[(cname, pass_name)], peak_extra_bytes(run)) for (cname, pass_name), run in runners.items()]


def print_table(rows, bytes_by_pass, total_by_case, copy_gbps=None):
    """Medians, ratios to lossagg and the GB/s of lossagg and of the floor (bytes it must move)."""
    ours = {(r[0], r[1]): r[3] for r in rows if r[2] == "lossagg"}
    header = "| case | pass | contender | median ms | x lossagg time | GB/s | peak extra MiB |"
    if copy_gbps:
        header += " % of copy |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for case, pass_name, cname, ms, mem in rows:
        ratio = ms / ours[(case, pass_name)]
        per_token = bytes_by_pass.get((cname, pass_name), bytes_by_pass.get(pass_name)) if cname in ("lossagg", "floor") else None
        gbps = per_token * total_by_case[case] / 1e9 / (ms / 1e3) if per_token else None
        line = f"| {case} | {pass_name} | {cname} | {ms:.3f} | {ratio:.2f} | {f'{gbps:.1f}' if gbps else ''} | {mem / 2**20:.2f} |"
        if copy_gbps:
            line += f" {100 * gbps / copy_gbps:.0f}% |" if gbps and cname == "lossagg" else " |"
        print(line)
    print()


def lookup(rows, case, pass_name, cname):
    return next(r[3] for r in rows if r[0] == case and r[1] == pass_name and r[2] == cname)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = p.parse_args(argv)
    device = args.device
    repeats = args.repeats or (15 if device == "cpu" else 30)
    print(f"# lossagg benchmark: torch {torch.__version__}, device={device}", end="")
    if device == "cuda":
        print(f" ({torch.cuda.get_device_name()})", end="")
    else:
        print(f" ({cpu_description()}, {torch.get_num_threads()} threads, lossagg CPU kernels: {lossagg.cpu_isa()})", end="")
    print(f"; medians of {repeats} interleaved rounds, {max(repeats, TARGET_ROUNDS)} for the cases behind a bandwidth target\n")

    copy_gbps = None
    if device == "cuda":
        x = torch.empty(512 << 20, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        ms = interleaved_medians({"copy": lambda: y.copy_(x)}, device, repeats)["copy"]
        copy_gbps = 2 * x.numel() / 1e9 / (ms / 1e3)
        del x, y
        print(f"# device-to-device copy: {copy_gbps:.0f} GB/s (read + write of 512 MiB)\n")

    # bytes per token lossagg must move: float32 values (4) + bool mask (1); the backward
    # reads the mask and writes a float32 gradient; the floor (values.sum()) reads 4
    bytes_by_pass = {"fwd": 5, "bwd": 5, "fwd+bwd": 10, ("floor", "fwd"): 4}
    all_passes = ["fwd", "bwd", "fwd+bwd"]
    targets = []

    print("## reduce, RL micro-batches (packed, uneven lengths)\n")
    rl_cases = [("B=256 x ~2k", 256, 2048), ("B=1024 x ~512", 1024, 512), ("B=64 x ~16k", 64, 16384)]
    if args.quick:
        rl_cases = [("B=64 x ~512", 64, 512)]
    rows, totals = [], {}
    for name, n, mean_len in rl_cases:
        b = make_packed(n, mean_len, device)
        totals[name] = b["total"]
        rows += bench_case(name, b, device, repeats, list(CONTENDERS), all_passes)
    print_table(rows, bytes_by_pass, totals, copy_gbps)
    main_case = rl_cases[1][0] if len(rl_cases) > 1 else rl_cases[0][0]
    best = min(lookup(rows, main_case, "fwd+bwd", c) for c in ("vectorised", "segment_red"))
    ratio = best / lookup(rows, main_case, "fwd+bwd", "lossagg")
    targets.append((f"fwd+bwd, best vectorised torch / lossagg, {main_case}", ratio, ">= 8", lambda x: x >= 8))

    print("## reduce, small calls and tiny segments (packed)\n")
    small_cases = [("B=64 x ~64", 64, 64), ("B=1M x ~4", 1 << 20, 4)]
    if args.quick:
        small_cases = [("B=64 x ~64", 64, 64), ("B=64k x ~4", 1 << 16, 4)]
    rows, totals = [], {}
    for name, n, mean_len in small_cases:
        b = make_packed(n, mean_len, device)
        totals[name] = b["total"]
        rows += bench_case(name, b, device, repeats, ["lossagg", "vectorised", "segment_red"], all_passes)
    print_table(rows, bytes_by_pass, totals, copy_gbps)
    tiny = small_cases[1][0]
    for pass_name in ("fwd", "fwd+bwd"):
        speedup = lookup(rows, tiny, pass_name, "segment_red") / lookup(rows, tiny, pass_name, "lossagg")
        targets.append((f"{pass_name}, segment_reduce / lossagg, {tiny}", speedup, ">= 2", lambda x: x >= 2))

    print("## reduce, large inputs (B=64)\n")
    big = [1 << 20, 4 << 20, 16 << 20] if device == "cpu" else [1 << 16, 1 << 20, 16 << 20, 64 << 20]
    if args.quick:
        big = [1 << 20]
    rows, totals = [], {}
    for tokens in big:
        n = 64
        b = make_packed(n, tokens // n, device)
        name = f"{b['total'] / 2**20:.2f}M tokens"
        totals[name] = b["total"]
        contenders = ["lossagg", "vectorised", "floor"] + (["segment_red"] if device == "cuda" else [])
        rows += bench_case(name, b, device, max(repeats, TARGET_ROUNDS), contenders, all_passes)
        # bandwidth against the floor's: lossagg moves 5 B per token (value + mask), the floor 4
        ratio = (5 / 4) * lookup(rows, name, "fwd", "floor") / lookup(rows, name, "fwd", "lossagg")
        if tokens >= 4 << 20:
            targets.append((f"fwd, lossagg GB/s / values.sum() GB/s, {name}", ratio, ">= 0.95", lambda x: x >= 0.95))
    print_table(rows, bytes_by_pass, totals, copy_gbps)

    print("## aggregate(config, ...) without sample_denoms vs the raw op (packed)\n")
    print("`aggregate` counts the rollout tokens, plans the denominators and reduces; `raw` is `lossagg.reduce` given them.\n")
    b = make_packed(*((64, 512) if args.quick else (1024, 512)), device)
    front = f"B={b['lengths'].numel()} x ~512"
    rows = []
    for mode in ("sample_mean", "token_mean"):
        cfg = lossagg.LossAggregationConfig(mode=mode)
        denoms = lossagg.StepPlan.from_mask(cfg, b["mask"], b["cu"]).sample_denoms.to(device)
        table = {
            "lossagg": lambda bb, v, d=denoms: lossagg.reduce(v, bb["mask"], cu_seqlens=bb["cu"], sample_denoms=d),
            "aggregate": lambda bb, v, c=cfg: lossagg.aggregate(c, v, bb["mask"], cu_seqlens=bb["cu"]),
        }
        # calls of ~0.1 ms: many rounds, so that the medians settle
        rows += bench_case(f"{front}, {mode}", b, device, max(repeats, 101), list(table), ["fwd", "fwd+bwd"], table)
    print_table(rows, bytes_by_pass, {f"{front}, {m}": b["total"] for m in ("sample_mean", "token_mean")}, copy_gbps)
    for mode in ("sample_mean", "token_mean"):
        case = f"{front}, {mode}"
        for pass_name in ("fwd", "fwd+bwd"):
            ratio = lookup(rows, case, pass_name, "aggregate") / lookup(rows, case, pass_name, "lossagg")
            targets.append((f"{pass_name}, aggregate / raw op, {case}", ratio, "<= 1.1", lambda x: x <= 1.1))

    print("## reduce by mask dtype (packed, B=1024 x ~512)\n")
    print("The kernels read bool, uint8, int64 and float32 masks as given (float32 values); the bytes moved per token are 4 + the mask's.\n")
    base = make_packed(64 if args.quick else 1024, 512, device)
    for mask_dtype, mask_bytes in ((torch.bool, 1), (torch.int64, 8), (torch.float32, 4)):
        b = dict(base, mask=base["mask"].to(mask_dtype))
        name = f"mask={str(mask_dtype).replace('torch.', '')}"
        rows = bench_case(name, b, device, repeats, ["lossagg", "vectorised"], all_passes)
        print_table(rows, {"fwd": 4 + mask_bytes, "bwd": 4 + mask_bytes, "fwd+bwd": 2 * (4 + mask_bytes)}, {name: b["total"]}, copy_gbps)

    print("## segment_sum of K stacked metrics (packed)\n")
    print("B=1024 x ~512 (the aggregate batch: cache-sized for K=1) and B=256 x ~16k (memory-sized); the floor is `values.sum(-1)` over [K, T].\n")
    rows, totals, seg_bytes = [], {}, {}
    shapes = [(64, 512)] if args.quick else [(1024, 512), (256, 16384)]
    for n, mean_len in shapes:
        b0 = make_packed(n, mean_len, device)
        for k in (1, 16):
            b = dict(b0, metrics=torch.randn(k, b0["total"], device=device))
            name = f"K={k}, B={n} x ~{mean_len}, {b['total'] / 2**20:.2f}M tokens"
            totals[name] = b["total"]
            contenders = ["lossagg", "floor"] + (["vectorised", "segment_red"] if k == 1 and n == 1024 else [])
            rows += bench_case(name, b, device, max(repeats, TARGET_ROUNDS), contenders, ["fwd"], SEGMENT_SUM_CONTENDERS, "metrics")
            seg_bytes[name] = 4 * k + 1
    for name in totals:  # with the per-case byte counts
        print_table([r for r in rows if r[0] == name], {"fwd": seg_bytes[name], ("floor", "fwd"): seg_bytes[name] - 1}, totals, copy_gbps)
    for name in totals:
        ours = seg_bytes[name] / lookup(rows, name, "fwd", "lossagg")
        floor = (seg_bytes[name] - 1) / lookup(rows, name, "fwd", "floor")
        targets.append((f"segment_sum GB/s / floor GB/s, {name}", ours / floor, ">= 0.90", lambda x: x >= 0.90))

    print("## Targets (ratios from this run)\n")
    print("| target | measured | wanted | met |")
    print("|---|---|---|---|")
    for what, value, wanted, ok in targets:
        print(f"| {what} | {value:.2f} | {wanted} | {'yes' if ok(value) else 'no'} |")
    print()


if __name__ == "__main__":
    main()
