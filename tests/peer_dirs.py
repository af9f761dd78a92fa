"""A trainer installed in directories of its own for the side-by-side tests (miles: tests/miles_peer.py,
slime: tests/slime_peer.py): where its install script put it, how a test process enters it, and whether it
imports. Only the processes that test it put its directories first on ``sys.path``."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PeerDirs:
    """``name`` (as the messages say it) in ``dirs`` (``$<env_var>``, directories joined by ``os.pathsep``, points
    elsewhere), importing ``modules``; ``prelude`` is a statement run first (in this process by :meth:`enter`, and
    in a subprocess's ``-c`` code), ``check`` a guard run before entering, ``env`` what a subprocess needs set."""

    def __init__(
        self,
        name: str,
        folders: Sequence[str],
        env_var: str,
        modules: Sequence[str],
        installer: str,
        prelude: str = "",
        check: Callable[[Sequence[str]], None] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.name, self.modules, self.installer, self.prelude, self.check = name, tuple(modules), installer, prelude, check
        given = os.environ.get(env_var)
        self.dirs = given.split(os.pathsep) if given else [os.path.join(ROOT, "build", "peers", f) for f in folders]
        self.extra_env = dict(env or {})
        self.root = ROOT

    def enter(self) -> None:
        """Put the peer's directories first on this process's ``sys.path`` (after its prelude and check)."""
        if self.prelude:
            exec(self.prelude, {})  # noqa: S102 - a fixed statement of the test suite
        if self.check is not None:
            self.check(self.dirs)
        for key, value in self.extra_env.items():
            os.environ.setdefault(key, value)
        for d in reversed(self.dirs):
            if d not in sys.path:
                sys.path.insert(0, d)

    def env(self) -> dict[str, str]:
        """The environment of a subprocess that imports the peer."""
        out = dict(os.environ)
        out["PYTHONPATH"] = os.pathsep.join([*self.dirs, ROOT, out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        for key, value in self.extra_env.items():
            out.setdefault(key, value)
        return out

    @functools.cache  # noqa: B019 - one instance per peer, alive as long as the process
    def unavailable(self) -> str | None:
        """None when the peer imports in a subprocess; otherwise why not (the tests skip with it, or fail under CI)."""
        missing = [d for d in self.dirs if not os.path.isdir(d)]
        if missing:
            return f"{self.name} is not installed ({', '.join(missing)} missing); {self.installer} installs it"
        code = (self.prelude + "; " if self.prelude else "") + "import " + ", ".join(self.modules)
        try:
            done = subprocess.run([sys.executable, "-c", code], env=self.env(), capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return f"importing {self.name} took over 600 s"
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return f"{self.name} does not import from {self.dirs[0]}: {last}; {self.installer} installs it"
        return None
