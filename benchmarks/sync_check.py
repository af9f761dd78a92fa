"""Does a micro-batch's reduction wait on the host once the plan is built? And how close is the reduction to the
memory bus?

1. Every built-in mode (with a second term, KL on the default reducer), packed and padded: a ``StepPlan`` built
   from token counts on the device, then three micro-batches, each ``plan.micro_batch(...)``, ``plan.loss(...)``
   and the backward. On a GPU they run under ``torch.cuda.set_sync_debug_mode("error")``: any synchronisation
   (a read back to the host, a blocking copy, an op whose output size depends on the data) raises, and is
   reported with where it happened. On the CPU (the half CI runs, tests/test_sync_free.py) the same calls run
   under a dispatch mode that records every read of a tensor's value by the host (``aten::_local_scalar_dense``:
   ``.item()``, ``bool()``, ``int()``) and every op whose output size depends on the data (``nonzero``,
   ``masked_select``, ``unique``, ...): the operations that synchronise on a GPU, as far as Python issues them
   (what the native ops do inside is seen only on the GPU).
2. The reduction's bandwidth at >= 16M tokens (float32 values, bool mask): the micro-batch's ``plan.loss``
   forward reads 5 bytes a token, a device copy of the values moves 8; the ratio of the two achieved rates,
   medians of interleaved rounds (benchmarks/bench_reduce.py's harness).

    python benchmarks/sync_check.py --device cuda     # on a GPU (benchmarks/gpu_check.sh runs it)
    python benchmarks/sync_check.py --device cpu --tokens 4194304

Exit status 1 when a micro-batch synchronised (or read the host) after its plan was built.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_reduce  # noqa: E402  (the harness: interleaved medians, the CPU's description)

import lossagg  # noqa: E402

#: The ops that make a GPU wait: a value read by the host, and outputs whose size depends on the data.
HOST_READS = ("_local_scalar_dense",)
DATA_SIZED = ("nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "masked_scatter")
SAMPLES, MICRO_BATCHES = 12, 3


class HostReads(TorchDispatchMode):
    """Records every host read and data-sized op issued while active, with the lossagg line that issued it."""

    def __init__(self):
        super().__init__()
        self.found: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS or name in DATA_SIZED:
            frames = [f for f in traceback.extract_stack() if f"{os.sep}lossagg{os.sep}" in f.filename]
            where = f"{frames[-1].filename.rsplit(os.sep + 'lossagg' + os.sep, 1)[-1]}:{frames[-1].lineno}" if frames else "outside lossagg"
            self.found[f"{name} at {where}"] += 1
        return func(*args, **(kwargs or {}))


def config_for(mode: str) -> lossagg.LossAggregationConfig:
    spec = lossagg.MODES[mode]
    n = 2 if (spec.needs_groups and spec.needs_sessions) else 4
    return lossagg.LossAggregationConfig(
        mode=mode, n_samples_per_prompt=n, terms={"kl": {"coefficient": 0.1}}, **({"divisor": 64.0} if spec.needs_divisor else {})
    )


def step(device, padded: bool, seed: int = 0):
    """A step of :data:`SAMPLES` samples (one empty), prompt groups of 4, sessions of 2: counts, labels and each
    micro-batch's layout and values, all on ``device``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (SAMPLES,), generator=g)
    masks = [torch.rand(int(n), generator=g) < 0.8 for n in lengths]
    masks[3].zero_()
    counts = torch.stack([m.sum() for m in masks]).to(device)
    labels = {"group_index": (torch.arange(SAMPLES) // 4).to(device), "session_index": (torch.arange(SAMPLES) // 2).to(device)}
    per = SAMPLES // MICRO_BATCHES
    batches = []
    for k in range(MICRO_BATCHES):
        rows = masks[k * per : (k + 1) * per]
        if padded:
            width = max(m.numel() for m in rows)
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for i, m in enumerate(rows):
                mask[i, : m.numel()] = m
            cu = None
        else:
            mask = torch.cat(rows)
            cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor([m.numel() for m in rows]), 0, out=cu[1:])
        values = {name: torch.randn(mask.shape, generator=g) for name in ("pg", "kl")}
        batches.append((slice(k * per, (k + 1) * per), mask.to(device), None if cu is None else cu.to(device), values))
    return counts, labels, batches


def check_modes(device: str = "cpu", modes=None) -> dict[tuple[str, str], list[str]]:
    """(mode, layout) -> what synchronised in its micro-batches after the plan was built (empty: nothing)."""
    dev = torch.device(device)
    out = {}
    for mode in modes or lossagg.MODES:
        spec = lossagg.MODES[mode]
        for layout in ("packed", "padded"):
            counts, labels, batches = step(dev, layout == "padded")
            kwargs = {k: v for k, v in labels.items() if (k == "group_index" and spec.needs_groups) or (k == "session_index" and spec.needs_sessions)}
            plan = lossagg.StepPlan(config_for(mode), counts, **kwargs)
            found = []
            for k, (samples, mask, cu, values) in enumerate(batches):
                leaves = {name: v.to(dev).requires_grad_(True) for name, v in values.items()}
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        plan.loss(leaves, plan.micro_batch(samples, mask, cu)).backward()
                    except RuntimeError as exc:
                        found.append(f"micro-batch {k}: {str(exc).splitlines()[0]} ({traceback.extract_tb(exc.__traceback__)[-1]})")
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                else:
                    reads = HostReads()
                    with reads:
                        plan.loss(leaves, plan.micro_batch(samples, mask, cu)).backward()
                    found += [f"micro-batch {k}: {what} (x{count})" for what, count in reads.found.items()]
            out[(mode, layout)] = found
    return out


def bandwidth(device: str, tokens: int, rounds: int) -> dict[str, float]:
    """Achieved GB/s of the micro-batch's forward reduction (values and mask read once: 5 B a token) and of a device
    copy of the values (8 B a token), and their ratio."""
    dev = torch.device(device)
    b = bench_reduce.make_packed(1024, max(tokens // 1024, 1), device)
    values, mask, cu = b["values"], b["mask"], b["cu"]
    plan = lossagg.StepPlan.from_mask(lossagg.LossAggregationConfig(mode="token_mean"), mask, cu)
    mb = plan.micro_batch(slice(None), mask, cu)
    dst = torch.empty_like(values)
    t = bench_reduce.interleaved_medians({"reduce": lambda: plan.loss(values, mb), "copy": lambda: dst.copy_(values)}, dev, rounds)
    n = values.numel()
    gbs = {"reduce": 5 * n / (t["reduce"] * 1e-3) / 1e9, "copy": 8 * n / (t["copy"] * 1e-3) / 1e9}
    return {
        "tokens": n,
        "reduce_ms": t["reduce"],
        "copy_ms": t["copy"],
        **{f"{k}_gbs": v for k, v in gbs.items()},
        "ratio": gbs["reduce"] / gbs["copy"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=16 * 2**20)
    p.add_argument("--rounds", type=int, default=21)
    args = p.parse_args(argv)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({bench_reduce.cpu_description()}, {torch.get_num_threads()} threads)"
    how = 'torch.cuda.set_sync_debug_mode("error")' if args.device == "cuda" else "host reads and data-sized ops recorded by a dispatch mode"
    print(f"# sync check: torch {torch.__version__}, {where}; {how}\n")
    found = check_modes(args.device)
    print("| mode | layout | after the plan is built |")
    print("|---|---|---|")
    bad = 0
    for (mode, layout), what in found.items():
        bad += bool(what)
        print(f"| {mode} | {layout} | {'; '.join(what) if what else 'no synchronisation'} |")
    r = bandwidth(args.device, args.tokens, args.rounds)
    print(
        f"\nbandwidth at {r['tokens']:,} tokens: the reduction {r['reduce_gbs']:.1f} GB/s ({r['reduce_ms']:.3f} ms), a device copy "
        f"{r['copy_gbs']:.1f} GB/s ({r['copy_ms']:.3f} ms): {r['ratio']:.2f} of the copy's rate"
    )
    print(f"\n{bad} of {len(found)} cases synchronised after the plan was built")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
