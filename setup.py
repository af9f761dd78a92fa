"""Build of the lossagg native library (``lossagg._C``).

The CPU kernels are always built. The CUDA kernels in ``csrc/cuda`` are built when a
CUDA toolkit is found and the installed torch is a CUDA build; set
``LOSSAGG_BUILD_CUDA=0`` to skip them or ``=1`` to require them. Without
``TORCH_CUDA_ARCH_LIST`` the CUDA kernels target the visible GPU, or
``DEFAULT_CUDA_ARCHS`` when none is visible.
"""

from __future__ import annotations

import glob
import os
import sys

# A CUDA build for sm_80 (A100), sm_90 (H100/H200), sm_100 (B200) plus PTX for newer
# chips. TORCH_CUDA_ARCH_LIST overrides it.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0+PTX"


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
from find_cuda_home import find_cuda_home  # noqa: E402

_cuda_home = find_cuda_home()
if _cuda_home:
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported.
    os.environ["CUDA_HOME"] = _cuda_home

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    flag = os.environ.get("LOSSAGG_BUILD_CUDA", "auto").lower()
    available = _cuda_home is not None and torch.version.cuda is not None
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        if not available:
            sys.exit(
                "LOSSAGG_BUILD_CUDA=1 but no CUDA build is possible: "
                f"CUDA toolkit={_cuda_home!r}, torch.version.cuda={torch.version.cuda!r}"
            )
        return True
    return available


def _extension():
    rel = lambda paths: sorted(os.path.relpath(p, ROOT) for p in paths)  # noqa: E731
    sources = rel(
        glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp"))
    )
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden", "-fopenmp"]  # OpenMP: at::parallel_for
    if not _want_cuda():
        print("lossagg: building the CPU kernels only", file=sys.stderr)
        return CppExtension(
            "lossagg._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
        # With a GPU visible torch builds for it; without one, for the default list.
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    print(
        f"lossagg: building CPU and CUDA kernels (CUDA_HOME={_cuda_home}, "
        f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', 'the visible GPU')})",
        file=sys.stderr,
    )
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
