"""lossagg: exact, split-invariant aggregation of per-token policy-gradient losses."""

from lossagg._native import built_with_cuda, device_checks_enabled, set_device_checks
from lossagg.ops import reduce, segment_sum

__version__ = "0.1.0"

__all__ = [
    "built_with_cuda",
    "device_checks_enabled",
    "reduce",
    "segment_sum",
    "set_device_checks",
]
