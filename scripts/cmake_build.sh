#!/usr/bin/env bash
# Builds the ops with CMake (liblossagg_ops.so, for libtorch users) and runs ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${LOSSAGG_CMAKE_BUILD:-build/cmake}

args=(-DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')")
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
  # A CUDA build of torch: its CMake package needs the toolkit and nvrtc.
  cuda_home=$("$PY" scripts/find_cuda_home.py)
  cuda_home=${CUDA_HOME:-$cuda_home}
  nvrtc=$("$PY" - <<'PYEOF'
import glob, os, sys
import nvidia
for root in nvidia.__path__:
    hits = sorted(glob.glob(os.path.join(root, "cu*", "lib", "libnvrtc.so.*")) + glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so.*")))
    hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
    if hits:
        print(hits[0]); sys.exit(0)
PYEOF
  ) || true
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  [ -n "$cuda_home" ] && args+=(-DCUDA_TOOLKIT_ROOT_DIR="$cuda_home" -DCUDAToolkit_ROOT="$cuda_home")
  [ -n "$nvrtc" ] && args+=(-DCUDA_nvrtc_LIBRARY="$nvrtc")
fi
mkdir -p "$(dirname "$BUILD")"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD" "${generator[@]}" "${args[@]}" -DLOSSAGG_CUDA="${LOSSAGG_CMAKE_CUDA:-OFF}" >"$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)"
ctest --test-dir "$BUILD" --output-on-failure
