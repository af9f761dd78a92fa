"""slime (THUDM/slime at commit 624b824) for the side-by-side tests: where scripts/install_slime.sh put
it, and how a test process enters it.

slime is not on the package registry; its source is ``../shared/peers/slime-624b824.tar.gz``, which
scripts/install_slime.sh unpacks into ``build/peers/slime`` (its import-time needs that are not
already installed, sglang's argument classes among them, with ``--no-deps`` into
``build/peers/slime-deps``). Only the processes that test slime put those directories first on
``sys.path`` (:func:`enter`): the spawned ranks of tests/test_slime_train.py and the
subprocesses it starts. slime imports megatron-core's ``megatron.training``, whose model builders
use ``typing.override`` (Python >= 3.12); on an older Python :func:`enter` gives ``typing`` the
``typing_extensions`` one before anything imports megatron (an attribute of this process's
``typing`` module, no file changed). ``LOSSAGG_SLIME_PATH`` (directories joined by ``os.pathsep``)
points elsewhere.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = (
    os.environ["LOSSAGG_SLIME_PATH"].split(os.pathsep)
    if os.environ.get("LOSSAGG_SLIME_PATH")
    else [os.path.join(ROOT, "build", "peers", "slime"), os.path.join(ROOT, "build", "peers", "slime-deps")]
)
#: what the tests import of slime
MODULES = (
    "slime.utils.arguments",
    "slime.backends.megatron_utils.model",
    "slime.backends.megatron_utils.loss",
    "slime.utils.dp_schedule",
    "slime.utils.accelerator",
)
#: the statement that :func:`enter` runs first, for a subprocess's ``-c`` code too
TYPING = "import typing, typing_extensions; typing.override = getattr(typing, 'override', typing_extensions.override)"


def enter() -> None:
    """Put slime's directories first on this process's ``sys.path``, with ``typing.override`` in place."""
    exec(TYPING, {})  # noqa: S102 - a fixed statement of this module
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # slime wraps its policy loss in torch.compile: 2 cores, one compile per world
    for d in reversed(DIRS):
        if d not in sys.path:
            sys.path.insert(0, d)


def env() -> dict[str, str]:
    """The environment of a subprocess that imports slime (its code runs :data:`TYPING` first)."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([*DIRS, ROOT, out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out.setdefault("TORCHDYNAMO_DISABLE", "1")
    return out


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None when slime imports in a subprocess; otherwise why not (the tests say it and fail under CI)."""
    missing = [d for d in DIRS if not os.path.isdir(d)]
    if missing:
        return f"slime 624b824 is not installed ({', '.join(missing)} missing); scripts/install_slime.sh installs it"
    code = TYPING + "; import " + ", ".join(MODULES)
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "importing slime took over 600 s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"slime 624b824 does not import from {DIRS[0]}: {last}; scripts/install_slime.sh installs it"
    return None
