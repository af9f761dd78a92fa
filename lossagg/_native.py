"""Loads the compiled library; importing it registers ``torch.ops.lossagg.*``."""

from __future__ import annotations

import torch  # noqa: F401  (the extension links against libtorch)

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
