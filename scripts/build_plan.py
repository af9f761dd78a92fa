"""What the native build will compile, decided once for setup.py and scripts/setup.sh.

The CPU kernels are always built. The CUDA kernels are built when asked for
(``LOSSAGG_BUILD_CUDA=1``, or ``TORCH_CUDA_ARCH_LIST`` set) or when a GPU is visible, and
only if a CUDA toolkit and a CUDA build of torch are present; ``LOSSAGG_BUILD_CUDA=0``
skips them. A machine with no GPU that asks for nothing gets the CPU build, which takes
a fraction of the time (the demo and the CPU tests need nothing more).

Run as a script it prints one line saying what will be built and roughly how long it takes.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from find_cuda_home import find_cuda_home  # noqa: E402

# Measured on a 2-core machine (docs/benchmarks.md, "build times"): minutes per core-pair.
CPU_BUILD_MIN_2CORES = 1.5
CUDA_BUILD_MIN_PER_ARCH_2CORES = 3.0
# Asked for with no GPU visible and no TORCH_CUDA_ARCH_LIST: A100, H100/H200, B200 + PTX.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0+PTX"


def want_cuda(torch_module=None) -> tuple[bool, str]:
    """(build the CUDA kernels?, why)."""
    flag = os.environ.get("LOSSAGG_BUILD_CUDA", "auto").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False, "LOSSAGG_BUILD_CUDA=0"
    torch = torch_module
    if torch is None:
        import torch
    cuda_home = find_cuda_home()
    possible = cuda_home is not None and torch.version.cuda is not None
    if flag in ("1", "true", "yes", "on"):
        if not possible:
            sys.exit(f"LOSSAGG_BUILD_CUDA=1 but no CUDA build is possible: CUDA toolkit={cuda_home!r}, torch.version.cuda={torch.version.cuda!r}")
        return True, "LOSSAGG_BUILD_CUDA=1"
    if not possible:
        return False, "no CUDA toolkit or a CPU-only torch"
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return True, f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}"
    if torch.cuda.is_available():
        return True, "a GPU is visible"
    return False, "no GPU visible and none asked for (LOSSAGG_BUILD_CUDA=1 or TORCH_CUDA_ARCH_LIST builds them)"


def describe() -> str:
    cuda, why = want_cuda()
    cores = os.cpu_count() or 2
    scale = 2.0 / min(cores, 16)
    if not cuda:
        return f"lossagg: building the CPU kernels only ({why}); about {max(0.5, CPU_BUILD_MIN_2CORES * scale):.1f} min on {cores} cores"
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if not archs and why != "a GPU is visible":
        archs = DEFAULT_CUDA_ARCHS
    n_arch = len([a for a in archs.replace(",", ";").split(";") if a.strip()]) or 1
    minutes = CPU_BUILD_MIN_2CORES * scale + CUDA_BUILD_MIN_PER_ARCH_2CORES * n_arch * scale
    target = f"archs {archs}" if archs else "the visible GPU"
    return f"lossagg: building the CPU and CUDA kernels ({why}; {target}); about {minutes:.0f} min on {cores} cores"


if __name__ == "__main__":
    print(describe())
