#!/usr/bin/env bash
# The test command: set-up (torch and the packages, then the build), the C++ tests (ctest, against
# the library setup.py built), the configuration tests under the oldest supported Python, the peer
# packages (installed once, only when absent; in the background from when torch is there, while the
# library and the C++ tests build and the C++ and configuration tests run), and the pytest suite.
# Fails if pytest collects no tests.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/setup.sh --deps || exit 1

# the peers install (mostly downloads and unpacking) while the library and the C++ tests build and
# run; its lines are printed once it is done
mkdir -p build/logs
bash scripts/install_peers.sh > build/logs/peers-summary.txt 2>&1 &
peers=$!

bash scripts/setup.sh || { wait "$peers"; exit 1; }

bash scripts/ctest.sh || { wait "$peers"; exit 1; }

bash scripts/test_min_python.sh || { wait "$peers"; exit 1; }

wait "$peers"
cat build/logs/peers-summary.txt

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
