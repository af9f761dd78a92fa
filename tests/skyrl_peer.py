"""SkyRL 0.4.0's module of loss utilities (``skyrl.backends.skyrl_train.utils.ppo_utils``), for
the side-by-side tests; scripts/install_peers.sh installs SkyRL and checks it with :func:`ppo_utils`.

SkyRL 0.4.0 declares Python >= 3.12. The module itself runs on 3.11, but the ``__init__`` of
its parent package ``skyrl.backends`` imports the Tinker backend's interface, whose pydantic
models use ``typing.TypedDict`` (pydantic accepts that only from Python 3.12 on) and which the
module does not use. On Python < 3.12 the package ``skyrl.backends`` is therefore entered
without running that ``__init__`` (a bare package over the same directory, in
``sys.modules``); on 3.12 and later it is imported as it is.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys

PPO_UTILS = "skyrl.backends.skyrl_train.utils.ppo_utils"
TRAINER = "skyrl.train.trainer"


def _bare(package: str, folder: str) -> None:
    """``package`` entered without running its ``__init__`` (on Python < 3.12 only), over ``folder``."""
    if sys.version_info < (3, 12) and package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [folder]
        sys.modules[package] = importlib.util.module_from_spec(spec)


def ppo_utils():
    """SkyRL's ``ppo_utils`` module; ImportError when SkyRL or one of the module's imports is missing."""
    import skyrl

    _bare("skyrl.backends", os.path.join(os.path.dirname(skyrl.__file__), "backends"))
    return importlib.import_module(PPO_UTILS)


def trainer():
    """SkyRL's trainer module (``RayPPOTrainer``; it needs torchdata). On Python < 3.12 ``skyrl.train.generators`` is
    entered as a bare package too: its ``__init__`` imports the Tinker types as well."""
    import skyrl

    ppo_utils()
    _bare("skyrl.train.generators", os.path.join(os.path.dirname(skyrl.__file__), "train", "generators"))
    return importlib.import_module(TRAINER)
