"""A fixed corpus of op calls whose outputs are recorded as hashes (tests/golden/cpu_ops.json).

The corpus covers every admitted dtype combination (4 value dtypes x 10 mask dtypes x 4
denominator dtypes), the three offset/layout kinds (packed with int32 and int64
``cu_seqlens``, padded rows), K = 1 and K = 3, and segment lengths that reach every CPU
summation path (windows of <= 16 tokens, short runs, 32 lanes, pieces of a segment longer
than 16,384 tokens), with -0.0 values and NaN/inf under zero mask entries. Inputs come from
NumPy's PCG64 with fixed seeds (stable across versions), so the same corpus is rebuilt
anywhere.

The hashes were recorded from the build before the kernel types were reduced (issue 17:
denominators, offsets and rare masks converted at the op boundary); tests/test_golden.py
checks that every output and gradient still has the same bits, on every instruction set
the CPU has.

    python tests/golden.py --record     # rewrite the recorded hashes (only for a deliberate change)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys

import numpy as np
import torch

GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "cpu_ops.json")

VALUE_DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16}
MASK_DTYPES = {
    "bool": torch.bool,
    "u8": torch.uint8,
    "i8": torch.int8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
}
DENOM_DTYPES = VALUE_DTYPES

# Segment lengths of the packed layouts: every CPU path (window <= 16, short 17..63, lanes
# >= 64, empty segments) and, in "long", one segment cut into pieces (> 16,384 tokens).
SHORT_LENGTHS = [0, 1, 5, 16, 17, 40, 63, 64, 65, 200, 3, 0, 8, 1000, 16, 9, 130, 2, 70]
LONG_LENGTHS = [7, 300, 20000, 0, 33, 16, 1500, 64]
LAYOUTS = {
    "short_i32": ("packed", SHORT_LENGTHS, torch.int32),
    "short_i64": ("packed", SHORT_LENGTHS, torch.int64),
    "long_i32": ("packed", LONG_LENGTHS, torch.int32),
    "long_i64": ("packed", LONG_LENGTHS, torch.int64),
    "padded_short": ("padded", (9, 45), None),
    "padded_long": ("padded", (2, 17000), None),
}


def record(path: str, corpus, script: str) -> None:
    """The ``--record`` entry point of a recorder of step results (tests/golden_plan.py, golden_program.py,
    golden_micro_batch.py): its corpus written to ``path``, keyed by the torch that made it."""
    if "--record" not in sys.argv:
        sys.exit(f"usage: python {script} --record")
    results = corpus()
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "cases": results}, f, indent=0, sort_keys=True)
    print(f"recorded {len(results)} results to {path}")


def _digest(t: torch.Tensor) -> str:
    shape = tuple(t.shape)
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() + str(tuple(shape)).encode() + str(t.dtype).encode()).hexdigest()[:20]


def _mask(rng: np.random.Generator, name: str, n: int) -> torch.Tensor:
    keep = rng.random(n) < 0.7
    if name == "bool":
        return torch.from_numpy(keep)
    if name in ("u8", "i8", "i16", "i32", "i64"):
        w = np.where(keep, rng.choice([1, 1, 1, 2, 3], size=n), 0)
        if name != "u8":
            w = np.where(rng.random(n) < 0.05, -1, w)
        return torch.from_numpy(w.astype(np.int64)).to(MASK_DTYPES[name])
    w = np.where(keep, 0.25 + rng.random(n), 0.0)
    if name == "f64":  # weights that round to 0 or lose bits in float32
        w = np.where(rng.random(n) < 0.05, 1e-50, w)
        w = np.where(rng.random(n) < 0.05, 1.0 + 2.0**-40, w)
    return torch.from_numpy(w).to(MASK_DTYPES[name])


def _values(rng: np.random.Generator, shape, dtype: torch.dtype, keep: np.ndarray) -> torch.Tensor:
    # math.exp (the C library's, as NumPy computes exp where it has no AVX-512 kernel), not
    # np.exp: NumPy's AVX-512 exp rounds some float64 results differently, which would change
    # the inputs from one CPU to the next.
    x = rng.standard_normal(shape) * np.fromiter(map(math.exp, rng.uniform(-3, 3, size=shape).ravel()), dtype=np.float64).reshape(shape)
    flat = x.reshape(-1, keep.size)
    flat[:, rng.random(keep.size) < 0.03] = -0.0
    special = (~keep) & (rng.random(keep.size) < 0.1)
    flat[:, special] = np.where(rng.random(int(special.sum())) < 0.5, np.nan, np.inf)
    return torch.from_numpy(flat.reshape(shape)).to(dtype)


def corpus_hashes() -> dict[str, dict[str, str]]:
    """{case: {op: hash}} for the whole corpus, on the current ISA and thread count."""
    ops = torch.ops.lossagg
    out: dict[str, dict[str, str]] = {}
    for li, (layout_name, (kind, shape, cu_dtype)) in enumerate(LAYOUTS.items()):
        if kind == "packed":
            cu = torch.tensor(np.concatenate([[0], np.cumsum(shape)]), dtype=cu_dtype)
            token_shape = (int(cu[-1]),)
            num_segments = len(shape)
        else:
            cu = None
            token_shape = shape
            num_segments = shape[0]
        n_tokens = int(np.prod(token_shape))
        for vi, (vname, vdtype) in enumerate(VALUE_DTYPES.items()):
            for mi, mname in enumerate(MASK_DTYPES):
                rng = np.random.default_rng([20261201, li, vi, mi])
                mask = _mask(rng, mname, n_tokens).reshape(token_shape)
                keep = mask.reshape(-1).ne(0).numpy()
                values = _values(rng, token_shape, vdtype, keep)
                values3 = _values(rng, (3, *token_shape), vdtype, keep)
                acc = torch.float64 if vdtype == torch.float64 else torch.float32
                g1 = torch.from_numpy(rng.standard_normal(num_segments)).to(acc)
                g3 = torch.from_numpy(rng.standard_normal((3, num_segments))).to(acc)
                h = {
                    "segment_sum": _digest(ops.segment_sum(values, mask, cu)),
                    "segment_sum_k3": _digest(ops.segment_sum(values3, mask, cu)),
                    "segment_sum_backward": _digest(ops.segment_sum_backward(g1, mask, cu, vdtype)),
                    "segment_sum_backward_k3": _digest(ops.segment_sum_backward(g3, mask, cu, vdtype)),
                    "token_counts": _digest(ops.token_counts(mask, cu)),
                }
                for di, (dname, ddtype) in enumerate(DENOM_DTYPES.items()):
                    drng = np.random.default_rng([20261201, li, vi, mi, di, 7])
                    denoms = torch.from_numpy(1.0 + 40.0 * drng.random(num_segments)).to(ddtype)
                    grad = torch.tensor(0.7 + drng.random(), dtype=acc)
                    h[f"reduce_d{dname}"] = _digest(ops.reduce(values, mask, cu, denoms))
                    h[f"reduce_backward_d{dname}"] = _digest(ops.reduce_backward(grad, mask, cu, denoms, vdtype))
                # the autograd path end to end (forward + backward through the registered autograd)
                v = values.clone().requires_grad_(True)
                denoms = torch.full((num_segments,), 3.0, dtype=torch.float32)
                ops.reduce(v, mask, cu, denoms).backward()
                h["autograd_reduce_grad"] = _digest(v.grad)
                out[f"{layout_name}/{vname}/{mname}"] = h
    return out


if __name__ == "__main__":
    import lossagg  # noqa: F401  (registers the ops)

    if "--record" not in sys.argv:
        sys.exit("usage: python tests/golden.py --record")
    os.makedirs(os.path.dirname(GOLDEN_PATH), exist_ok=True)
    hashes = corpus_hashes()
    with open(GOLDEN_PATH, "w") as f:
        json.dump({"isa": lossagg.cpu_isa(), "torch": torch.__version__, "cases": hashes}, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"recorded {sum(len(v) for v in hashes.values())} hashes of {len(hashes)} cases to {GOLDEN_PATH}")
