#!/usr/bin/env bash
# The C++ tests, against the library setup.py built: the same CMake tree (build/native),
# reconfigured with the tests on. The library itself is not compiled again (same flags);
# only the two test programs are. The tests run on every core (ctest -j):
#   lossagg_cpp_test            the ops through the dispatcher, as a libtorch user calls them
#   lossagg_cuda_host_test_*    the CUDA kernels' source run on the CPU, in shards
# then scripts/build_counts.py: the build's size against its limits (fails the step when over).
# LOSSAGG_TEST_TIER=full runs the emulated CUDA test's full tier (1200 generated cases and 200
# invalid tables; the default tier is 200 and 60, about half a minute on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
BUILD=${LOSSAGG_BUILD_DIR:-build/native}
[ -f "$BUILD/CMakeCache.txt" ] || { echo "ctest: no build in $BUILD (run scripts/setup.sh first)" >&2; exit 1; }
cases=200 bad_tables=60
[ "${LOSSAGG_TEST_TIER:-default}" = "full" ] && cases=1200 bad_tables=200
run_step "ctest: configured the C++ tests ($cases emulated CUDA cases)" ctest-configure \
  cmake -S . -B "$BUILD" -DLOSSAGG_BUILD_TESTS=ON -DLOSSAGG_CUDA_HOST_CASES=$cases -DLOSSAGG_CUDA_HOST_BAD_TABLES=$bad_tables
run_step "ctest: built the C++ tests" ctest-build cmake --build "$BUILD" -j "$(nproc)"
# the library the C++ tests link is the file Python loads
cmp -s "$BUILD/liblossagg_ops.so" lossagg/liblossagg_ops.so \
  || { echo "ctest: $BUILD/liblossagg_ops.so differs from lossagg/liblossagg_ops.so (rebuild with scripts/setup.sh)" >&2; exit 1; }
echo "ctest: emulated CUDA test with $cases cases and $bad_tables invalid tables (${LOSSAGG_TEST_TIER:-default} tier)"
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)"
# the build's size against its limits (lossagg functions in the CPU-only library, CUDA kernels when compiled)
"${PYTHON:-python3}" scripts/build_counts.py --tree "$BUILD"
