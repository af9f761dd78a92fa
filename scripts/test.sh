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

# two workers when pytest-xdist is there; the multi-process engine tests share one of them
# (xdist_group "engines") while the other runs the rest
xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n "${LOSSAGG_PYTEST_WORKERS:-2}" --dist loadgroup)
"$PY" -m pytest tests "${xdist[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
