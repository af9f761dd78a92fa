#!/usr/bin/env bash
# Installs what lossagg needs and builds it in place. Safe to run again: it skips the
# native build when the compiled library is newer than every source.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  # torch 2.14.1 (CUDA 13.0 build) is what lossagg is developed and tested against;
  # any torch >= 2.4 works. Override with LOSSAGG_TORCH_SPEC.
  "$PY" -m pip install -q --disable-pip-version-check "${LOSSAGG_TORCH_SPEC:-torch==2.14.1}"
fi
"$PY" -m pip install -q --disable-pip-version-check \
  "pydantic>=2.6" "pyyaml>=6" "pytest>=8" "hypothesis>=6" "matplotlib>=3.8" ninja "setuptools>=64" wheel \
  "tomli>=2; python_version < '3.11'"

# Rebuild when a source is newer than the library or the build settings changed.
stamp_file=build/.lossagg-build-settings
plan=$("$PY" scripts/build_plan.py)
settings="torch=$("$PY" -c 'import torch; print(torch.__version__)') plan=$plan cuda_home=${CUDA_HOME:-auto}"
so=$(ls lossagg/_C*.so 2>/dev/null | head -n1 || true)
if [ -n "$so" ] && [ -z "$(find csrc setup.py scripts/find_cuda_home.py scripts/build_plan.py -newer "$so" -type f | head -n1)" ] \
   && [ "$(cat "$stamp_file" 2>/dev/null)" = "$settings" ] && "$PY" -c "import lossagg" 2>/dev/null; then
  echo "lossagg: native library up to date ($so)"
else
  echo "$plan"
  start=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e .
  mkdir -p build && echo "$settings" > "$stamp_file"
  echo "lossagg: built in $(( $(date +%s) - start )) s"
fi
"$PY" -c "import lossagg; print('lossagg', lossagg.__version__, '| CUDA kernels built:', lossagg.built_with_cuda())"
