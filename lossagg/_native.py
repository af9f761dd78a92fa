"""Loads the native library (liblossagg_ops.so); loading it registers ``torch.ops.lossagg.*``.

Before loading, the torch of this process is compared with the one the library was built
against (``_build_info.py``, written by setup.py): a library built for another torch would
fail with an undefined symbol or worse, so a mismatch is one clear ImportError instead.
"""

from __future__ import annotations

import ctypes
import os

import torch

from lossagg.env import CPU_ISAS

REBUILD = "pip install --no-build-isolation -e .  (in a clone; `make demo` runs it) or pip install --no-build-isolation --force-reinstall lossagg"
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "liblossagg_ops.so")


def _check_build(build_info) -> None:
    if build_info is None or not os.path.exists(LIBRARY_PATH):
        raise ImportError(f"lossagg's native library ({LIBRARY_PATH}) is not built. Build it with: {REBUILD}")
    if build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"lossagg's native library was built against torch {build_info.TORCH_VERSION}, but this process runs "
            f"torch {torch.__version__}; a C++ extension only loads with the torch it was compiled for. Rebuild with: {REBUILD}"
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
    ("lossagg_torch_version", ctypes.c_char_p, []),
):
    getattr(_lib, _name).restype = _res
    getattr(_lib, _name).argtypes = _args


def built_with_cuda() -> bool:
    """True when the CUDA kernels were compiled into the native library."""
    return bool(_lib.lossagg_built_with_cuda())


def built_against_torch() -> str:
    """The torch version the native library was compiled against."""
    return _lib.lossagg_torch_version().decode()


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
