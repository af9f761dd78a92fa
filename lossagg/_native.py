"""Loads the compiled library; importing it registers ``torch.ops.lossagg.*``."""

from __future__ import annotations

import os

import torch  # noqa: F401  (the extension links against libtorch)

CPU_ISAS = ("auto", "avx512", "avx2", "baseline")
_env_isa = os.environ.get("LOSSAGG_CPU_ISA", "")
if _env_isa not in ("", *CPU_ISAS):
    raise ValueError(f"LOSSAGG_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {_env_isa!r}")

try:
    from lossagg import _C
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "lossagg's native library (lossagg._C) is not built. Install the package with `pip install --no-build-isolation -e .` (see README.md)."
    ) from exc


def built_with_cuda() -> bool:
    """True when the CUDA kernels were compiled into the native library."""
    return bool(_C.built_with_cuda())


def set_device_checks(enabled: bool) -> None:
    """Turn on the input checks that need a device-to-host copy on CUDA.

    ``cu_seqlens`` monotonicity and end, and ``sample_denoms`` being finite and > 0,
    are always checked on the CPU. On CUDA they cost a sync, so they are opt-in (also
    with ``LOSSAGG_CHECK_INPUTS=1`` in the environment).
    """
    _C.set_device_checks(bool(enabled))


def device_checks_enabled() -> bool:
    return bool(_C.device_checks_enabled())


def cpu_isa() -> str:
    """The vector instruction set the CPU kernels use now: ``"avx512"``, ``"avx2"`` or ``"baseline"``.

    The widest the CPU supports, unless capped with :func:`set_cpu_isa` or the
    ``LOSSAGG_CPU_ISA`` environment variable. Results are bitwise the same on every one.
    """
    return str(_C.cpu_isa())


def cpu_best_isa() -> str:
    """The widest vector instruction set this CPU supports for the CPU kernels."""
    return str(_C.cpu_best_isa())


def set_cpu_isa(isa: str) -> None:
    """Cap the CPU kernels' instruction set: ``"auto"`` (no cap), ``"avx512"``, ``"avx2"`` or ``"baseline"``.

    A cap above what the CPU has uses the CPU's best. For tests and benchmarks: the results
    do not change, only the speed.
    """
    if isa not in CPU_ISAS:
        raise ValueError(f"isa must be one of {', '.join(CPU_ISAS)}, got {isa!r}")
    _C.set_cpu_isa(isa)
