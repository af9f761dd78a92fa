"""What the native build will compile and how CMake is configured, decided once for
setup.py and the scripts.

The CPU kernels are always built. The CUDA kernels are built when asked for
(``LOSSAGG_BUILD_CUDA=1``, or ``TORCH_CUDA_ARCH_LIST`` set) or when a GPU is visible, and
only if a CUDA toolkit and a CUDA build of torch are present; ``LOSSAGG_BUILD_CUDA=0``
skips them. The CUDA architectures default to CMakeLists.txt's list when
``TORCH_CUDA_ARCH_LIST`` is not set.

Run as a script it prints one line saying what will be built and roughly how long it takes.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from find_cuda_home import find_cuda_home  # noqa: E402

# Measured on a 2-core machine (README.md, "Timings"): minutes on 2 cores.
CPU_BUILD_MIN_2CORES = 1.0
CUDA_BUILD_MIN_PER_ARCH_2CORES = 1.0

REBUILD = "pip install --no-build-isolation -e . (or: make demo)"


def import_torch():
    """torch, or one clear error: lossagg builds against the torch it will run with."""
    try:
        import torch
    except ImportError:
        sys.exit(
            "lossagg: building needs torch installed in the environment it will run in, and pip's build "
            "isolation hides it. Install torch first, then: pip install --no-build-isolation .  "
            "(or -e . for a development install; `make demo` does all of this)"
        )
    return torch


def check_build_isolation() -> None:
    """Stop at once when the torch found is one that pip installed into an isolated build env."""
    torch = import_torch()
    path = os.path.abspath(getattr(torch, "__file__", "") or "")
    if "pip-build-env" in path or os.sep + "build-env-" in path:
        sys.exit(
            f"lossagg: the torch found ({torch.__version__} at {path}) lives in pip's isolated build environment, "
            "not in the environment lossagg will run in, and a library built against it would not load there. "
            "Build with: pip install --no-build-isolation ."
        )


def want_cuda(torch_module=None) -> tuple[bool, str]:
    """(build the CUDA kernels?, why)."""
    flag = os.environ.get("LOSSAGG_BUILD_CUDA", "auto").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False, "LOSSAGG_BUILD_CUDA=0"
    torch = torch_module if torch_module is not None else import_torch()
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


def _nvrtc_library() -> str | None:
    """libnvrtc of the pip-installed CUDA runtime (CMake's Torch package asks for it)."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        hits = sorted(
            glob.glob(os.path.join(root, "cu*", "lib", "libnvrtc.so.*")) + glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so.*"))
        )
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[0]
    return None


#: The oldest torch the library loads into: the LibTorch stable ABI version it targets
#: (CMakeLists.txt's LOSSAGG_TORCH_FLOOR; the wheel requires torch >= it).
TORCH_FLOOR = "2.10"


def cmake_args(torch, cuda: bool) -> list[str]:
    """The CMake configure arguments for this environment (generator, torch, CUDA)."""
    args = [
        f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
        f"-DLOSSAGG_CUDA={'ON' if cuda else 'OFF'}",
        f"-DLOSSAGG_TORCH_FLOOR={TORCH_FLOOR}",
    ]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if not cuda:
        # torch's headers and libraries from Python: no CMake Torch package, so no CUDA
        # toolkit needed for a CPU-only build even with a CUDA build of torch
        root = os.path.dirname(torch.__file__)
        includes = [os.path.join(root, "include"), os.path.join(root, "include", "torch", "csrc", "api", "include")]
        args += [
            f"-DLOSSAGG_TORCH_INCLUDE_DIRS={';'.join(includes)}",
            f"-DLOSSAGG_TORCH_LIBRARY_DIR={os.path.join(root, 'lib')}",
            f"-DLOSSAGG_TORCH_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        ]
        return args
    if torch.version.cuda:
        # a CUDA build of torch: its CMake package needs the toolkit and nvrtc, even for
        # the CPU kernels
        cuda_home = os.environ.get("CUDA_HOME") or find_cuda_home()
        if cuda_home:
            args += [f"-DCUDAToolkit_ROOT={cuda_home}", f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home}"]
            if cuda:
                args.append(f"-DCMAKE_CUDA_COMPILER={os.path.join(cuda_home, 'bin', 'nvcc')}")
        nvrtc = _nvrtc_library()
        if nvrtc:
            args.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc}")
    return args


def describe() -> str:
    cuda, why = want_cuda()
    cores = os.cpu_count() or 2
    scale = 2.0 / min(cores, 16)
    if not cuda:
        return f"lossagg: building the CPU kernels only ({why}); about {max(0.5, CPU_BUILD_MIN_2CORES * scale):.1f} min on {cores} cores"
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    n_arch = len([a for a in archs.replace(",", ";").split(";") if a.strip()]) or 3
    minutes = CPU_BUILD_MIN_2CORES * scale + CUDA_BUILD_MIN_PER_ARCH_2CORES * n_arch * scale
    target = f"archs {archs}" if archs else "the default archs of CMakeLists.txt"
    return f"lossagg: building the CPU and CUDA kernels ({why}; {target}); about {minutes:.0f} min on {cores} cores"


if __name__ == "__main__":
    print(describe())
