#!/usr/bin/env bash
# The test command: set-up (build), the C++ tests (ctest, against the library setup.py
# built), the configuration tests under the oldest supported Python, the peer packages
# (installed once, only when absent), and the pytest suite. Fails if pytest collects no
# tests.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/setup.sh || exit 1

bash scripts/ctest.sh || exit 1

bash scripts/test_min_python.sh || exit 1

bash scripts/install_peers.sh

"$PY" -m pytest tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
