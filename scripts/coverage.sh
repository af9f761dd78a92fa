#!/usr/bin/env bash
# Line and branch coverage of lossagg/ by the tests of a tier (LOSSAGG_TEST_TIER: default or full),
# the subprocesses and the worlds included (coverage.py's patches: subprocess for the spawned ones, fork and
# _exit for the forked ranks, which end in os._exit), on two xdist
# workers as `make test` runs them. Run `make test` once first (the build and the peers).
#
#   bash scripts/coverage.sh                 # the default tier -> build/coverage/coverage.json
#   bash scripts/coverage.sh --compare B.json
#       also lists the lines and branches of lossagg/ that B.json (another run over the same code,
#       e.g. the full tier's) covers and this run does not (scripts/coverage_compare.py)
#
# Prints one line: lines covered/total and branches covered/total (pytest's own result above it).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
PY=${PYTHON:-python3}
compare=""
if [ "${1:-}" = "--compare" ]; then compare=$(realpath "$2"); shift 2; fi
out=$PWD/build/coverage
rm -rf "$out" && mkdir -p "$out"
"$PY" -c "import coverage" 2>/dev/null || run_step "coverage: installed coverage 7.18.0" coverage-install pip_install "coverage==7.18.0" || exit 1
cat > "$out/rc" <<RC
[run]
branch = True
parallel = True
source = lossagg
patch =
    subprocess
    fork
    _exit
data_file = $out/.coverage
RC
export COVERAGE_RCFILE=$out/rc
start=$SECONDS
"$PY" -m coverage run -m pytest tests -q -p no:cacheprovider -n "${LOSSAGG_PYTEST_WORKERS:-2}" --dist loadgroup "$@"
rc=$?
"$PY" -m coverage combine -q && "$PY" -m coverage json -q -o "$out/coverage.json" || exit 1
"$PY" - "$out/coverage.json" "${LOSSAGG_TEST_TIER:-default}" $((SECONDS - start)) <<'PYEOF'
import json, sys
t = json.load(open(sys.argv[1]))["totals"]
print(f"coverage: {sys.argv[2]} tier: lines {t['covered_lines']}/{t['num_statements']} ({100 * t['covered_lines'] / t['num_statements']:.1f}%), "
      f"branches {t['covered_branches']}/{t['num_branches']} ({100 * t['covered_branches'] / t['num_branches']:.1f}%) of lossagg/ ({sys.argv[3]} s)")
PYEOF
[ -n "$compare" ] && { "$PY" scripts/coverage_compare.py "$compare" "$out/coverage.json" || rc=1; }
exit "$rc"
