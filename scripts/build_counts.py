"""How big the native build is, against its limits (issue 60): the lossagg functions compiled into the
CPU-only library, and, with ``--cuda``, the CUDA kernels per architecture (scripts/cuda_report.py's count).

The library itself is stripped, so the functions are counted in the objects it is linked from: the
``lossagg_ops`` objects of a CMake tree (default: build/native, the tree ``make test`` builds for the C++
tests from the same sources as the library), every defined text or weak symbol whose demangled name holds
``lossagg::``, each name once (an inline function emitted in several objects is one function). Where the tree
also compiled the CUDA kernels (``TORCH_CUDA_ARCH_LIST``), the kernels are counted from the host entries nvcc
gives each kernel instantiation in that object (one per kernel, whatever the architectures); ``--cuda`` instead
compiles them for sm_90 and counts what ptxas reports (scripts/cuda_report.py), with no CUDA build needed here.
scripts/ctest.sh runs this after it builds the tree.

    python scripts/build_counts.py [--tree build/native] [--cuda]

Exit status 1 when a count is over its limit, 2 when there is nothing to count.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYMBOL_LIMIT, KERNEL_LIMIT = 700, 64


def lossagg_symbols(tree: str) -> set[str]:
    """The demangled lossagg functions defined in the CPU objects of ``tree``'s lossagg_ops target."""
    objects = []
    for folder, _, files in os.walk(os.path.join(tree, "CMakeFiles", "lossagg_ops.dir")):
        objects += [os.path.join(folder, f) for f in files if f.endswith(".o") and not f.endswith(".cu.o")]
    names: set[str] = set()
    for obj in objects:
        out = subprocess.run(["nm", "-C", "--defined-only", obj], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[1] in ("t", "T", "w", "W") and "lossagg::" in parts[2]:
                names.add(parts[2])
    return names


def cuda_kernels(tree: str) -> int | None:
    """Kernel instantiations compiled into the tree's ops_cuda.cu object (None when it has none): the host
    entries ``lossagg::cuda::*_kernel<...>`` nvcc defines for each, their clones (``.cold``) left out."""
    obj = os.path.join(tree, "CMakeFiles", "lossagg_ops.dir", "csrc", "cuda", "ops_cuda.cu.o")
    cache = os.path.join(tree, "CMakeCache.txt")
    # an object left by an earlier CUDA build of a tree now configured without CUDA is not counted
    if not os.path.exists(obj) or not os.path.exists(cache) or "LOSSAGG_CUDA:BOOL=ON" not in open(cache).read():
        return None
    out = subprocess.run(["nm", "--defined-only", obj], capture_output=True, text=True, check=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in ("t", "T") and re.match(r"_ZN7lossagg4cudaL?\d+\w*_kernelI", parts[2]) and "." not in parts[2]:
            names.add(parts[2])
    return len(names)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", default=os.path.join(ROOT, "build", "native"), help="a CMake tree that built lossagg_ops (default build/native)")
    p.add_argument("--cuda", action="store_true", help="also compile the CUDA kernels for sm_90 and count them (scripts/cuda_report.py)")
    args = p.parse_args(argv)
    symbols = lossagg_symbols(args.tree)
    if not symbols:
        print(f"build-counts: no lossagg_ops objects under {args.tree}: build it first (make test builds build/native)", file=sys.stderr)
        return 2
    over = len(symbols) > SYMBOL_LIMIT
    print(f"lossagg functions in the CPU-only library: {len(symbols)} (limit {SYMBOL_LIMIT}) from {args.tree}")
    compiled = cuda_kernels(args.tree)
    if compiled is not None and not args.cuda:
        over = over or compiled > KERNEL_LIMIT
        print(f"CUDA kernels compiled into {args.tree}: {compiled} per architecture (limit {KERNEL_LIMIT})")
    if args.cuda:
        done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "cuda_report.py")], capture_output=True, text=True)
        found = re.search(r"(\d+) kernels for sm_(\d+)", done.stdout)
        if done.returncode != 0 or not found:
            print(f"build-counts: the CUDA report failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            return 2
        kernels = int(found.group(1))
        over = over or kernels > KERNEL_LIMIT
        print(f"CUDA kernels for sm_{found.group(2)}: {kernels} (limit {KERNEL_LIMIT})")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
