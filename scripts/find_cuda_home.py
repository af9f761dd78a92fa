"""Finds the CUDA toolkit root for builds (scripts/build_plan.py, used by setup.py).

Run as a script it prints the root, or nothing when there is no toolkit.
"""

from __future__ import annotations

import glob
import os
import shutil


def toolkit_root(nvcc: str) -> str | None:
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
            return toolkit_root(token)
    return None


def find_cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = toolkit_root(nvcc)
        if root:
            return root
    for candidate in ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    return None


if __name__ == "__main__":
    print(find_cuda_home() or "")
