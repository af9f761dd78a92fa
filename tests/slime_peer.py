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

from peer_dirs import PeerDirs

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
# slime wraps its policy loss in torch.compile: 2 cores, one compile per world
PEER = PeerDirs(
    "slime 624b824",
    ("slime", "slime-deps"),
    "LOSSAGG_SLIME_PATH",
    MODULES,
    "scripts/install_slime.sh",
    prelude=TYPING,
    env={"TORCHDYNAMO_DISABLE": "1"},
)
ROOT, DIRS, enter, env, unavailable = PEER.root, PEER.dirs, PEER.enter, PEER.env, PEER.unavailable
