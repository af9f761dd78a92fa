"""Speed and memory of lossagg.reduce / segment_sum against the ways trainers do it today.

One run measures every contender on the same packed batches:

  lossagg      torch.ops.lossagg.reduce (this library)
  loop         a per-sample Python loop over slices (how many trainers do it)
  vectorised   the best pure-PyTorch formulation: where(mask) * repeat_interleave(1/d)
  segment_red  torch.segment_reduce(sum) on the masked values, then / d
  floor        forward: values.sum() (one read of the values);
               CUDA: also a device-to-device copy of values+mask, for achieved GB/s

It prints medians (ms), ratios against lossagg and the peak extra memory each
contender allocates as tensors (tracked through a dispatch mode, so it counts every
intermediate tensor, not allocator caching).

    python benchmarks/bench_reduce.py                 # CPU table (docs/benchmarks.md)
    python benchmarks/bench_reduce.py --device cuda   # GPU table
"""

from __future__ import annotations

import argparse
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


def f_vectorised(b, values):
    weights = torch.repeat_interleave(1.0 / b["denoms"], b["lengths"], output_size=b["total"])
    return (torch.where(b["mask"], values, 0).float() * weights).sum()


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


def median_ms(fn, device, repeats, warmup=5):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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


def bench_case(name, b, device, repeats, contenders, passes, table=None, values_key="values"):
    table = CONTENDERS if table is None else table
    rows = []
    for cname in contenders:
        fn = table[cname]
        for pass_name in passes:
            if pass_name != "fwd" and cname == "floor":
                continue
            if pass_name == "fwd":
                with torch.no_grad():
                    run = lambda fn=fn: fn(b, b[values_key])  # noqa: E731
                    ms = median_ms(run, device, repeats)
                    mem = peak_extra_bytes(run)
            elif pass_name == "bwd":
                run = bwd_only(fn, b, values_key)
                ms = median_ms(run, device, repeats)
                mem = peak_extra_bytes(run)
            else:
                run = fwd_bwd(fn, b, values_key)
                ms = median_ms(run, device, repeats)
                mem = peak_extra_bytes(run)
            rows.append((name, pass_name, cname, ms, mem))
    return rows


def print_table(rows, bytes_by_pass, total_by_case, copy_gbps=None):
    """Medians, ratios to lossagg; on CUDA also achieved GB/s against the copy bandwidth."""
    ours = {(r[0], r[1]): r[3] for r in rows if r[2] == "lossagg"}
    header = "| case | pass | contender | median ms | x lossagg time | peak extra MiB |"
    if copy_gbps:
        header += " GB/s | % of copy |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for case, pass_name, cname, ms, mem in rows:
        ratio = ms / ours[(case, pass_name)]
        line = f"| {case} | {pass_name} | {cname} | {ms:.3f} | {ratio:.2f} | {mem / 2**20:.2f} |"
        if copy_gbps:
            gbytes = bytes_by_pass[pass_name] * total_by_case[case] / 1e9
            gbps = gbytes / (ms / 1e3)
            line += f" {gbps:.0f} | {100 * gbps / copy_gbps:.0f}% |" if cname == "lossagg" else " | |"
        print(line)
    print()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = p.parse_args(argv)
    device = args.device
    repeats = args.repeats or (9 if device == "cpu" else 30)
    print(f"# lossagg benchmark: torch {torch.__version__}, device={device}", end="")
    if device == "cuda":
        print(f" ({torch.cuda.get_device_name()})", end="")
    else:
        print(f" ({cpu_description()}, {torch.get_num_threads()} threads)", end="")
    print()

    copy_gbps = None
    if device == "cuda":
        x = torch.empty(512 << 20, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        ms = median_ms(lambda: y.copy_(x), device, repeats)
        copy_gbps = 2 * x.numel() / 1e9 / (ms / 1e3)
        del x, y
        print(f"# device-to-device copy: {copy_gbps:.0f} GB/s (read + write of 512 MiB)")

    # bytes moved per token: values float32 (4) + bool mask (1); backward reads the mask
    # and writes a float32 gradient
    bytes_by_pass = {"fwd": 5, "bwd": 5, "fwd+bwd": 10}
    all_passes = ["fwd", "bwd", "fwd+bwd"]

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

    print("## reduce, small calls and tiny segments (packed)\n")
    small_cases = [("B=64 x ~64", 64, 64), ("B=1M x ~4", 1 << 20, 4)]
    if args.quick:
        small_cases = [("B=64 x ~64", 64, 64)]
    rows, totals = [], {}
    for name, n, mean_len in small_cases:
        b = make_packed(n, mean_len, device)
        totals[name] = b["total"]
        rows += bench_case(name, b, device, repeats, ["lossagg", "vectorised", "segment_red"], all_passes)
    print_table(rows, bytes_by_pass, totals, copy_gbps)

    print("## reduce, large inputs (B=64)\n")
    big = [4 << 20, 16 << 20] if device == "cpu" else [1 << 16, 1 << 20, 16 << 20, 64 << 20]
    if args.quick:
        big = [1 << 20]
    rows, totals = [], {}
    for tokens in big:
        n = 64
        b = make_packed(n, tokens // n, device)
        name = f"{b['total'] / 2**20:.2f}M tokens"
        totals[name] = b["total"]
        contenders = ["lossagg", "vectorised", "floor"] + (["segment_red"] if device == "cuda" else [])
        rows += bench_case(name, b, device, repeats, contenders, all_passes)
    print_table(rows, bytes_by_pass, totals, copy_gbps)

    print("## segment_sum of K=4 metrics (packed, B=256)\n")
    rows, totals = [], {}
    sizes = [1 << 19] if args.quick else ([1 << 19, 4 << 20] if device == "cpu" else [1 << 16, 1 << 20, 16 << 20])
    for tokens in sizes:
        n = 256
        b = make_packed(n, tokens // n, device)
        b["metrics"] = torch.randn(4, b["total"], device=device)
        name = f"K=4, {b['total'] / 2**20:.2f}M tokens"
        totals[name] = b["total"]
        rows += bench_case(name, b, device, repeats, list(SEGMENT_SUM_CONTENDERS), ["fwd"], SEGMENT_SUM_CONTENDERS, "metrics")
    print_table(rows, {"fwd": 4 * 4 + 1}, totals, copy_gbps)


if __name__ == "__main__":
    main()
