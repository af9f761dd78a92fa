"""Loads the native library (liblossagg_ops.so); loading it registers ``torch.ops.lossagg.*``.

The library uses the LibTorch stable ABI only, so one build loads into every torch from the
release it targets on (``_build_info.TORCH_FLOOR``, 2.10), whatever torch built it. Before
loading, this process's torch is checked against that floor and, for a build with CUDA
kernels, against the CUDA major version it was compiled for (its kernels need that CUDA
runtime): a mismatch is one clear ImportError naming a remedy, instead of a loader error.
"""

from __future__ import annotations

import ctypes
import os

import torch

from lossagg.env import CPU_ISAS

REBUILD = "pip install --no-build-isolation .  (in a clone of lossagg; -e . for a development install, which `make demo` runs)"
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "liblossagg_ops.so")


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.15.0+cu132`` or ``2.16.0.dev20261201``."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ImportError(f"lossagg cannot read the torch version {version!r} (expected major.minor...)") from None


def _check_build(build_info, torch_version: str = torch.__version__, torch_cuda: str | None = torch.version.cuda) -> None:
    if build_info is None or not os.path.exists(LIBRARY_PATH):
        raise ImportError(f"lossagg's native library ({LIBRARY_PATH}) is not built. Build it with: {REBUILD}")
    floor = getattr(build_info, "TORCH_FLOOR", None)
    if floor is None:  # a library from before the stable ABI: welded to the torch that built it
        raise ImportError(f"lossagg's native library was built by an older lossagg for torch {build_info.TORCH_VERSION} only; rebuild it: {REBUILD}")
    if _release(torch_version) < _release(floor):
        raise ImportError(
            f"lossagg needs torch >= {floor}, but this process runs torch {torch_version}: pip install 'torch>={floor}' "
            "(lossagg's library loads into every torch from that release on)"
        )
    cuda_major = getattr(build_info, "CUDA_MAJOR", None)
    if build_info.BUILT_WITH_CUDA and cuda_major is not None:
        have = None if not torch_cuda else int(torch_cuda.split(".")[0])
        if have != cuda_major:
            running = f"a CUDA {torch_cuda} build of torch" if have is not None else "a CPU-only build of torch"
            raise ImportError(
                f"lossagg's native library holds CUDA kernels for CUDA {cuda_major}, but this process runs {running} ({torch_version}); "
                f"install the lossagg wheel built for {'CUDA ' + str(have) if have is not None else 'the CPU'}, or rebuild it here: "
                f"{REBUILD}" + ("" if have is not None else " with LOSSAGG_BUILD_CUDA=0")
            )


try:
    from lossagg import _build_info
except ImportError:
    _build_info = None
_check_build(_build_info)
torch.ops.load_library(LIBRARY_PATH)
_lib = ctypes.CDLL(LIBRARY_PATH)
for _name, _res, _args in (
    ("lossagg_built_with_cuda", ctypes.c_int, []),
    ("lossagg_set_device_checks", None, [ctypes.c_int]),
    ("lossagg_device_checks_enabled", ctypes.c_int, []),
    ("lossagg_cpu_isa", ctypes.c_char_p, []),
    ("lossagg_cpu_best_isa", ctypes.c_char_p, []),
    ("lossagg_set_cpu_isa", ctypes.c_int, [ctypes.c_char_p]),
    ("lossagg_torch_floor", ctypes.c_char_p, []),
    ("lossagg_denom_factor_codes", ctypes.c_char_p, []),
):
    getattr(_lib, _name).restype = _res
    getattr(_lib, _name).argtypes = _args


def built_with_cuda() -> bool:
    """True when the CUDA kernels were compiled into the native library."""
    return bool(_lib.lossagg_built_with_cuda())


def torch_floor() -> str:
    """The oldest torch (``major.minor``) the native library loads into: its stable ABI target."""
    return _lib.lossagg_torch_floor().decode()


def denom_factor_codes() -> dict[int, str]:
    """The native denominator program's factor codes and their symbols (csrc/denom_program.h),
    as the library was compiled: the table :data:`lossagg.denom_program.CODES` must equal."""
    pairs = (item.split(":", 1) for item in _lib.lossagg_denom_factor_codes().decode().split(","))
    return {int(code): symbol for code, symbol in pairs}


def set_device_checks(enabled: bool) -> None:
    """Turn on the input checks that need a device-to-host copy on CUDA.

    ``cu_seqlens`` monotonicity and end, and ``sample_denoms`` being finite and > 0,
    are always checked on the CPU. On CUDA they cost a sync, so they are opt-in (also
    with ``LOSSAGG_CHECK_INPUTS=1`` in the environment).
    """
    _lib.lossagg_set_device_checks(1 if enabled else 0)


def device_checks_enabled() -> bool:
    return bool(_lib.lossagg_device_checks_enabled())


def cpu_isa() -> str:
    """The vector instruction set the CPU kernels use now: ``"avx512"``, ``"avx2"`` or ``"baseline"``.

    The widest the CPU supports, unless capped with :func:`set_cpu_isa` or the
    ``LOSSAGG_CPU_ISA`` environment variable. Results are bitwise the same on every one.
    """
    return _lib.lossagg_cpu_isa().decode()


def cpu_best_isa() -> str:
    """The widest vector instruction set this CPU supports for the CPU kernels."""
    return _lib.lossagg_cpu_best_isa().decode()


def set_cpu_isa(isa: str) -> None:
    """Cap the CPU kernels' instruction set: ``"auto"`` (no cap), ``"avx512"``, ``"avx2"`` or ``"baseline"``.

    A cap above what the CPU has uses the CPU's best. For tests and benchmarks: the results
    do not change, only the speed.
    """
    if isa not in CPU_ISAS:
        raise ValueError(f"isa must be one of {', '.join(CPU_ISAS)}, got {isa!r}")
    _lib.lossagg_set_cpu_isa(isa.encode())
