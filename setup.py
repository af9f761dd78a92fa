"""Build of lossagg's native library, driven through CMake (CMakeLists.txt is the one build
definition: sources, flags, CUDA architectures, the C++ tests).

``pip install --no-build-isolation -e .`` (what ``make demo`` runs), ``pip install
--no-build-isolation .`` and ``make wheel`` all come here: CMake configures ``build/native``
(``LOSSAGG_BUILD_DIR``), ninja compiles every source once on every core (``MAX_JOBS``),
and ``liblossagg_ops.so`` is written into the ``lossagg`` package next to ``_build_info.py``,
which records the oldest torch it loads into and, with CUDA kernels, the CUDA major version
(both checked at import, lossagg/_native.py). The library uses the LibTorch stable ABI only
and no Python API, so a wheel is tagged ``py3-none-<platform>``: one CPU wheel serves every
Python >= 3.10 and every torch from the floor on; a CUDA wheel, every torch of its CUDA
major.
``scripts/test.sh`` then builds the C++ tests in the same tree against the same library.

Build isolation: lossagg compiles against the torch it will run with. Under pip's default
build isolation pip would install a second, different torch into a throw-away environment
and build against that one; so the build stops at once and asks for
``--no-build-isolation`` unless the torch it sees is the one of the environment that pip
installs into (README.md, "Install").

The CUDA kernels are built when ``scripts/build_plan.py`` says so (``LOSSAGG_BUILD_CUDA=1``
or ``TORCH_CUDA_ARCH_LIST``, or a visible GPU; ``LOSSAGG_BUILD_CUDA=0`` skips them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from build_plan import TORCH_FLOOR, check_build_isolation, cmake_args, describe, want_cuda  # noqa: E402

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1: the wheel package's
    from wheel.bdist_wheel import bdist_wheel


class CMakeBuild(build_ext):
    """Builds the one native library with CMake + ninja and puts it into the package."""

    def get_ext_filename(self, fullname: str) -> str:
        # a plain shared library (no Python module): lossagg/liblossagg_ops.so
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        check_build_isolation()
        import torch

        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        os.makedirs(out_dir, exist_ok=True)
        build_dir = os.environ.get("LOSSAGG_BUILD_DIR", os.path.join(ROOT, "build", "native"))
        cuda, why = want_cuda(torch)
        print(describe(), file=sys.stderr)
        configure = ["cmake", "-S", ROOT, "-B", build_dir, *cmake_args(torch, cuda)]
        subprocess.check_call(configure, stdout=subprocess.DEVNULL if os.environ.get("LOSSAGG_QUIET_CMAKE") else None)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "lossagg_ops", "-j", jobs])
        # the very file the C++ tests link (scripts/ctest.sh checks they are the same bytes)
        shutil.copy2(os.path.join(build_dir, "liblossagg_ops.so"), self.get_ext_fullpath(ext.name))
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if cuda else ""
        # an editable install copies the library into the source tree: the record goes there too
        targets = {out_dir, os.path.join(ROOT, "lossagg")} if (self.inplace or getattr(self, "editable_mode", False)) else {out_dir}
        for target in targets:
            self._write_build_info(target, torch, cuda, archs, why)

    @staticmethod
    def _write_build_info(folder, torch, cuda, archs, why):
        with open(os.path.join(folder, "_build_info.py"), "w") as f:
            f.write(
                '"""Written by setup.py: what the native library in this folder was built against."""\n\n'
                f"TORCH_VERSION = {torch.__version__!r}  # the torch whose headers compiled it\n"
                f"TORCH_FLOOR = {TORCH_FLOOR!r}  # the oldest torch it loads into (its stable ABI target)\n"
                f"TORCH_CUDA = {torch.version.cuda!r}\n"
                f"BUILT_WITH_CUDA = {cuda!r}\n"
                f"CUDA_MAJOR = {int(torch.version.cuda.split('.')[0]) if cuda and torch.version.cuda else None!r}  # of the CUDA kernels\n"
                f"CUDA_ARCHS = {archs!r}  # empty: the defaults of CMakeLists.txt, or none\n"
                f"WHY = {why!r}\n"
            )


class PlatformWheel(bdist_wheel):
    """``py3-none-<platform>``: the native library links no Python and only torch's stable C ABI."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


def _requirements() -> list[str]:
    """Any torch from the floor on: the library targets the floor's stable ABI."""
    return [f"torch>={TORCH_FLOOR}", "pydantic>=2.6", "pyyaml>=6", "tomli>=2; python_version < '3.11'"]


setup(
    ext_modules=[Extension("lossagg.liblossagg_ops", sources=[])],
    cmdclass={"build_ext": CMakeBuild, "bdist_wheel": PlatformWheel},
    install_requires=_requirements(),
)
