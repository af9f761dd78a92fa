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

import os
import sys

from peer_dirs import PeerDirs


def _not_after_megatron_core(dirs) -> None:
    """miles' own megatron must be the first imported in the process."""
    megatron = sys.modules.get("megatron")
    if megatron is not None and not any(os.path.abspath(getattr(megatron, "__file__", "") or "").startswith(d) for d in dirs):
        raise RuntimeError("megatron-core was imported in this process before miles' own megatron: miles is tested in processes of its own")


#: what the tests import of miles
MODULES = ("miles.utils.arguments", "miles.backends.megatron_utils.model", "miles.backends.training_utils.loss")
PEER = PeerDirs("miles-rl 0.0.2", ("miles", "miles-deps"), "LOSSAGG_MILES_PATH", MODULES, "scripts/install_peers.sh", check=_not_after_megatron_core)
ROOT, DIRS, enter, env, unavailable = PEER.root, PEER.dirs, PEER.enter, PEER.env, PEER.unavailable
