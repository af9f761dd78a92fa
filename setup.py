"""Build of the lossagg native library (``lossagg._C``).

The CPU kernels are always built. The CUDA kernels in ``csrc/cuda`` are built when a
CUDA toolkit is found and the installed torch is a CUDA build; set
``LOSSAGG_BUILD_CUDA=0`` to skip them or ``=1`` to require them. Without
``TORCH_CUDA_ARCH_LIST`` the CUDA kernels target ``DEFAULT_CUDA_ARCHS``.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

# A CUDA build for sm_80 (A100), sm_90 (H100/H200), sm_100 (B200) plus PTX for newer
# chips. TORCH_CUDA_ARCH_LIST overrides it.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0+PTX"


def _toolkit_root(nvcc: str) -> str | None:
    """The toolkit folder of an nvcc, seeing through symlinks and small wrapper scripts."""
    nvcc = os.path.realpath(nvcc)
    root = os.path.dirname(os.path.dirname(nvcc))
    if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
        return root
    try:  # a wrapper script that execs the real nvcc
        with open(nvcc, encoding="utf-8", errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return None
    for token in text.split():
        if token.endswith("/bin/nvcc") and os.path.exists(token):
            return _toolkit_root(token)
    return None


def _find_cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = _toolkit_root(nvcc)
        if root:
            return root
    for candidate in ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    return None


_cuda_home = _find_cuda_home()
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
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    print(
        f"lossagg: building CPU and CUDA kernels (CUDA_HOME={_cuda_home}, "
        f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})",
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
