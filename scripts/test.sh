#!/usr/bin/env bash
# The test command: set-up, the CMake build of the ops with its C++ test (ctest), the
# configuration tests under the oldest supported Python, and the pytest suite. Fails if
# pytest collects no tests.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/setup.sh || exit 1

bash scripts/cmake_build.sh || exit 1

bash scripts/test_min_python.sh || exit 1

bash scripts/install_peers.sh

"$PY" -m pytest tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
