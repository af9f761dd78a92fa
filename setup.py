"""Build of the lossagg native library (``lossagg._C``).

The CPU kernels are always built; whether the CUDA kernels are is decided by
``scripts/build_plan.py`` (asked for with ``LOSSAGG_BUILD_CUDA=1`` or
``TORCH_CUDA_ARCH_LIST``, or a GPU is visible; ``LOSSAGG_BUILD_CUDA=0`` skips them).
Without ``TORCH_CUDA_ARCH_LIST`` the CUDA kernels target the visible GPU.
"""

from __future__ import annotations

import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
from build_plan import DEFAULT_CUDA_ARCHS, describe, want_cuda  # noqa: E402
from find_cuda_home import find_cuda_home  # noqa: E402

_cuda_home = find_cuda_home()
if _cuda_home:
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported.
    os.environ["CUDA_HOME"] = _cuda_home

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extension():
    rel = lambda paths: sorted(os.path.relpath(p, ROOT) for p in paths)  # noqa: E731
    sources = rel(
        glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp"))
    )
    # OpenMP: at::parallel_for. -ffp-contract=off: no a*b+c fused into one rounding, so the
    # AVX-512 build (which has FMA) adds exactly as the AVX2 and baseline builds do.
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden", "-fopenmp", "-ffp-contract=off"]
    print(describe(), file=sys.stderr)
    if not want_cuda(torch)[0]:
        return CppExtension(
            "lossagg._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    sources += rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    return CUDAExtension(
        "lossagg._C",
        sources,
        define_macros=[("LOSSAGG_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"],
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
)
