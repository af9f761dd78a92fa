"""miles-rl 0.0.2 for the side-by-side tests: where scripts/install_peers.sh put it, and how a test
process enters it.

miles vendors its own ``megatron`` package (and parts of ``sglang``), so it is installed with
``--no-deps --target build/peers/miles`` (its import-time needs into ``build/peers/miles-deps``),
never into site-packages, where it would overwrite megatron-core's files. Only the processes that
test miles put those two directories first on ``sys.path`` (:func:`enter`): the spawned ranks of
tests/test_miles_train.py and the subprocesses it starts. ``LOSSAGG_MILES_PATH`` (directories
joined by ``os.pathsep``) points elsewhere.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = (
    os.environ["LOSSAGG_MILES_PATH"].split(os.pathsep)
    if os.environ.get("LOSSAGG_MILES_PATH")
    else [os.path.join(ROOT, "build", "peers", "miles"), os.path.join(ROOT, "build", "peers", "miles-deps")]
)
#: what the tests import of miles
MODULES = ("miles.utils.arguments", "miles.backends.megatron_utils.model", "miles.backends.training_utils.loss")


def enter() -> None:
    """Put miles' directories first on this process's ``sys.path`` (before any ``megatron`` import)."""
    if "megatron" in sys.modules and not any(os.path.abspath(getattr(sys.modules["megatron"], "__file__", "") or "").startswith(d) for d in DIRS):
        raise RuntimeError("megatron-core was imported in this process before miles' own megatron: miles is tested in processes of its own")
    for d in reversed(DIRS):
        if d not in sys.path:
            sys.path.insert(0, d)


def env() -> dict[str, str]:
    """The environment of a subprocess that imports miles."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([*DIRS, ROOT, out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return out


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None when miles imports in a subprocess; otherwise why not (the tests skip with it)."""
    missing = [d for d in DIRS if not os.path.isdir(d)]
    if missing:
        return f"miles-rl 0.0.2 is not installed ({', '.join(missing)} missing); scripts/install_peers.sh installs it"
    code = "import " + ", ".join(MODULES)
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "importing miles-rl 0.0.2 took over 600 s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"miles-rl 0.0.2 does not import from {DIRS[0]}: {last}; scripts/install_peers.sh installs it"
    return None
