#!/usr/bin/env bash
# Installs what lossagg needs and builds it in place (pip install -e, which drives CMake:
# setup.py), into whichever Python runs it (PYTHON, else python3: a virtualenv's when one is
# active). Safe to run again: it skips the build when the library is newer than every source
# and the build settings are unchanged. One line per step; pip's and the build's own output
# is in build/logs/ (printed in full when a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
. scripts/steps.sh

if ! "$PY" -c "import torch" 2>/dev/null; then
  # torch 2.14.1 (CUDA 13.0 build) is what lossagg is developed against; the library
  # loads into any torch >= 2.10 (make test-torch-matrix). Override with LOSSAGG_TORCH_SPEC.
  spec=${LOSSAGG_TORCH_SPEC:-torch==2.14.1}
  run_step "setup: installed $spec" setup-torch pip_install "$spec"
fi
# what the package, the demo and the tests import, and the build tools (cmake, ninja)
missing=$("$PY" - <<'PYEOF'
import importlib.metadata, importlib.util, shutil
# pytest below 9.2: pytest-xdist 3.8 sends the tests of one xdist_group to one worker by rewriting each test's
# node id, which pytest 9.2 no longer reads (tests/conftest.py refuses a run whose groups did not hold)
need = {"pydantic": "pydantic>=2.6", "yaml": "pyyaml>=6", "pytest": "pytest>=8,<9.2", "hypothesis": "hypothesis>=6",
        "xdist": "pytest-xdist>=3", "matplotlib": "matplotlib>=3.8", "setuptools": "setuptools>=64", "wheel": "wheel", "numpy": "numpy"}
out = [spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None]
if importlib.util.find_spec("pytest") and tuple(int(p) for p in importlib.metadata.version("pytest").split(".")[:2]) >= (9, 2):
    out.append(need["pytest"])
out += [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
print(" ".join(out))
PYEOF
)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  run_step "setup: installed $missing" setup-packages pip_install $missing
fi

# `setup.sh --deps`: only the packages above (scripts/test.sh starts the peers' install after them, beside the build)
[ "${1:-}" = "--deps" ] && exit 0

# Rebuild when a source is newer than the library or the build settings changed.
stamp_file=build/.lossagg-build-settings
plan=$("$PY" scripts/build_plan.py)
settings="python=$("$PY" -c 'import sys; print(sys.prefix)') torch=$("$PY" -c 'import torch; print(torch.__version__)') plan=$plan cuda_home=${CUDA_HOME:-auto} archs=${TORCH_CUDA_ARCH_LIST:-}"
so=lossagg/liblossagg_ops.so
if [ -f "$so" ] && [ -z "$(find csrc CMakeLists.txt setup.py scripts/find_cuda_home.py scripts/build_plan.py -newer "$so" -type f | head -n1)" ] \
   && [ "$(cat "$stamp_file" 2>/dev/null)" = "$settings" ] && "$PY" -c "import lossagg" 2>/dev/null; then
  echo "setup: native library up to date ($so)"
else
  echo "$plan"
  LOSSAGG_QUIET_CMAKE=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    run_step "setup: built the native library and installed lossagg in place (pip install -e .)" setup-build pip_install --no-build-isolation -e .
  mkdir -p build && echo "$settings" > "$stamp_file"
fi
"$PY" -c "import lossagg; print('setup: lossagg', lossagg.__version__, 'in', __import__('sys').prefix, '| CUDA kernels built:', lossagg.built_with_cuda())"
