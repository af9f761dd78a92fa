"""Environment variables lossagg reads, checked where a bad value can be reported cleanly.

Nothing here imports torch: the ``lossagg`` command checks them before anything else and
prints one line; the CPU ops raise the same message at their first call (never at import).
"""

from __future__ import annotations

import os

CPU_ISAS = ("auto", "avx512", "avx2", "baseline")


def check_cpu_isa_env() -> None:
    """Raise ValueError naming LOSSAGG_CPU_ISA when it holds an unknown name."""
    value = os.environ.get("LOSSAGG_CPU_ISA", "")
    if value not in ("", *CPU_ISAS):
        raise ValueError(f"LOSSAGG_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {value!r}")
