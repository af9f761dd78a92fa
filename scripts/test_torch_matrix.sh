#!/usr/bin/env bash
# The torch matrix: ONE wheel, built once, tested under several torch releases.
#
# 1. Builds the CPU wheel once, in the interpreter that runs this script (PYTHON, else
#    python3; it needs torch and the build tools: `make setup` installs them), into
#    build/matrix/dist, in a build tree of its own (build/matrix/native), so the in-place
#    build of `make setup` (which may hold CUDA kernels, as in CI) is left as it is. The CPU
#    wheel is the one that serves every torch from the floor on, CPU or CUDA builds alike; a
#    wheel with CUDA kernels serves the torches of its CUDA major only (checked at import),
#    and torch 2.10.0 and 2.15.0 from the registry are built for different CUDA majors.
# 2. For each torch in LOSSAGG_MATRIX_TORCH (default "2.10.0 2.15.0": the floor and the
#    current release) makes a fresh venv build/matrix/torch-<ver> (removed first), installs
#    torch==<ver> from the registry (PIP_CONSTRAINT=/dev/null lifts this machine's cap) and
#    what the tests import, then the wheel *with* its dependencies; pip must leave torch at
#    <ver> (checked before installing, with pip's dry run, and after).
# 3. Runs the tests that matter for the ABI (LOSSAGG_MATRIX_TESTS: ops, autograd/gradcheck,
#    torch.compile/opcheck/fakes, config) from a copy of tests/, docs/, examples/ and
#    README.md in a temporary folder outside the checkout, so that `lossagg` comes from the
#    wheel installed in the venv (tests/conftest.py checks it: LOSSAGG_TEST_INSTALLED_UNDER).
#
# One line per step with its time (scripts/steps.sh; pip's and pytest's output in
# build/logs/matrix-*.log, printed in full on failure), then one line per torch:
#   matrix: torch X: N passed, M skipped (T s)        T: that torch's venv, installs and tests
# Exits non-zero when any torch fails; the others still run. pip's download cache is shared
# Disk: a torch venv is large (7 GB for torch 2.10.0 with its CUDA 12.8 packages, 5.4 GB for
# 2.15.0 with CUDA 13.2's; downloads of 3.9 and 2.6 GB), so the matrix holds one at a time: each
# venv is removed once its tests have run (its logs stay in build/logs/), and pip keeps no copy
# of what it downloads (PIP_NO_CACHE_DIR: on this project's machines the registry's proxy sends
# no caching headers, so a cached copy would never be reused anyway). A CI run that kept both
# venvs and the cache ran out of disk. LOSSAGG_MATRIX_KEEP_VENVS=1 keeps the venvs (to rerun a
# test by hand). LOSSAGG_MATRIX_WHEEL=path tests that wheel instead of building one.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
PY=${PYTHON:-python3}
. scripts/steps.sh

versions=${LOSSAGG_MATRIX_TORCH:-2.10.0 2.15.0}
tests=${LOSSAGG_MATRIX_TESTS:-tests/test_ops.py tests/test_ops_bad_input.py tests/test_ops_edge_cases.py tests/test_fresh_import.py \
tests/test_config.py tests/test_step.py tests/test_docs.py tests/test_golden.py}
test_deps=("pydantic>=2.6" "pyyaml>=6" "pytest>=8" "hypothesis>=6" "numpy")
matrix=build/matrix
# the wheel's torch requirement, as its METADATA states it
requires_torch() {
  "$PY" -c "import re, sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); m = next(n for n in z.namelist() if n.endswith('.dist-info/METADATA')); print(', '.join(re.findall(r'^Requires-Dist: (torch\\b.*)$', z.read(m).decode(), re.M)))" "$1"
}

# --- the wheel, built once ------------------------------------------------------------------
if [ -n "${LOSSAGG_MATRIX_WHEEL:-}" ]; then
  wheel=$(realpath "$LOSSAGG_MATRIX_WHEEL") || exit 1
  echo "matrix: testing the given wheel $wheel"
else
  if ! "$PY" -c "import torch, setuptools, wheel" 2>/dev/null; then
    echo "matrix: $PY has no torch or no setuptools/wheel to build with: run \`make setup\` (or scripts/setup.sh) first" >&2
    exit 1
  fi
  build_wheel() {
    rm -rf "$matrix/dist" \
      && LOSSAGG_BUILD_CUDA=0 LOSSAGG_BUILD_DIR="$ROOT/$matrix/native" \
        "$PY" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -w "$matrix/dist" .
  }
  run_step "matrix: built the CPU wheel with torch $("$PY" -c 'import torch; print(torch.__version__)')" matrix-wheel build_wheel || exit 1
  wheels=("$matrix"/dist/lossagg-*.whl)
  if [ "${#wheels[@]}" -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
    echo "matrix: expected one wheel in $matrix/dist, found: ${wheels[*]}" >&2
    exit 1
  fi
  wheel=$ROOT/${wheels[0]}
  echo "matrix: $(basename "$wheel"), $(du -h "$wheel" | cut -f1), requires $(requires_torch "$wheel")"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/lossagg-matrix.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT

# --- one torch --------------------------------------------------------------------------------
# test_one VERSION: prints the summary line; returns non-zero on any failure.
test_one() {
  local ver=$1 start=$SECONDS venv="$ROOT/$matrix/torch-$1" tag="matrix-torch-$1"
  local vpy="$venv/bin/python" before after where report
  export PIP_CONSTRAINT=/dev/null  # this machine caps torch at the release it keeps on disk
  export PIP_NO_CACHE_DIR=1        # a multi-GB download kept twice, never reused (see the top)

  make_venv() { rm -rf "$venv" && "$PY" -m venv "$venv"; }
  run_step "matrix: torch $ver: made a fresh venv $matrix/torch-$ver" "$tag-venv" make_venv || return 1
  PY=$vpy run_step "matrix: torch $ver: installed torch==$ver ${test_deps[*]}" "$tag-torch" \
    pip_install "torch==$ver" "${test_deps[@]}" || return 1
  before=$("$vpy" -c "import torch; print(torch.__version__)") || return 1
  echo "matrix: torch $ver: torch.__version__ before the wheel: $before"

  # What would pip do to torch? (a dry run resolves from metadata: nothing is downloaded
  # but the wheels' metadata, so a wheel that pins another torch fails here in seconds)
  report="$work/$tag-report.json"
  if ! PY=$vpy run_step "matrix: torch $ver: resolved the wheel's dependencies (pip install --dry-run)" "$tag-dry-run" \
    pip_install --dry-run --quiet --report "$report" "$wheel"; then
    return 1
  fi
  local replaces
  replaces=$("$vpy" -c "import json, sys; r = json.load(open(sys.argv[1])); print(' '.join(i['metadata']['name'] + '==' + i['metadata']['version'] for i in r['install'] if i['metadata']['name'].lower() == 'torch'))" "$report") || return 1
  if [ -n "$replaces" ]; then
    echo "matrix: torch $ver: FAILED: installing $(basename "$wheel") would replace torch $before with $replaces (its Requires-Dist: $(requires_torch "$wheel"))" >&2
    return 1
  fi
  PY=$vpy run_step "matrix: torch $ver: installed the wheel with its dependencies" "$tag-wheel" pip_install "$wheel" || return 1
  after=$("$vpy" -c "import torch; print(torch.__version__)") || return 1
  echo "matrix: torch $ver: torch.__version__ after the wheel: $after"
  if [ "$before" != "$after" ]; then
    echo "matrix: torch $ver: FAILED: pip changed torch from $before to $after" >&2
    return 1
  fi

  # the tests, from a copy outside the checkout: lossagg can only come from the venv
  local dir="$work/torch-$ver"
  mkdir -p "$dir" && cp -r tests docs examples README.md "$dir"/ || return 1
  find "$dir" -name __pycache__ -prune -exec rm -rf {} +
  printf '[pytest]\naddopts = -ra\n' > "$dir/pytest.ini"
  where=$(cd "$dir" && env -u PYTHONPATH "$vpy" -c "import os, lossagg; print(os.path.realpath(lossagg.__file__))" 2>"$work/$tag-import.err")
  if [ -z "$where" ]; then
    cat "$work/$tag-import.err" >&2
    echo "matrix: torch $ver: FAILED: import lossagg (output above)" >&2
    return 1
  fi
  echo "matrix: torch $ver: lossagg imported from $where"
  case "$where" in
    "$(realpath "$venv")"/*) ;;
    *) echo "matrix: torch $ver: FAILED: lossagg was imported from $where, not from the venv $venv" >&2; return 1 ;;
  esac
  local junit="$work/$tag-junit.xml" rc=0
  run_pytest() {
    # shellcheck disable=SC2086  # the test list is split on spaces
    (cd "$dir" && env -u PYTHONPATH LOSSAGG_TEST_INSTALLED_UNDER="$venv" \
      "$vpy" -m pytest -p no:cacheprovider --rootdir "$dir" -c "$dir/pytest.ini" --junitxml "$junit" $tests "$@")
  }
  run_step "matrix: torch $ver: pytest (log: $LOSSAGG_LOG_DIR/$tag-pytest.log)" "$tag-pytest" run_pytest || rc=$?
  if [ ! -f "$junit" ]; then
    echo "matrix: torch $ver: FAILED: pytest wrote no results (exit status $rc)" >&2
    return 1
  fi
  local counts
  counts=$("$vpy" - "$junit" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
out = f"{passed} passed, {n['skipped']} skipped"
if n["failures"] or n["errors"]:
    out += f", {n['failures']} failed, {n['errors']} errors"
print(out)
PYEOF
  ) || counts="results unreadable"
  summarized=1
  if [ "$rc" -eq 0 ] && [ "${counts%% *}" -gt 0 ] 2>/dev/null; then
    echo "matrix: torch $ver: $counts ($((SECONDS - start)) s)"
  else
    echo "matrix: torch $ver: FAILED: $counts, pytest's exit status $rc ($((SECONDS - start)) s)"
    return 1
  fi
}

failed=()
for ver in $versions; do
  start=$SECONDS summarized=0
  if ! test_one "$ver"; then
    failed+=("$ver")
    [ "$summarized" -eq 1 ] || echo "matrix: torch $ver: FAILED ($((SECONDS - start)) s)"
  fi
  # one torch venv on disk at a time (see the top); the logs stay
  if [ "${LOSSAGG_MATRIX_KEEP_VENVS:-0}" != 1 ]; then
    rm -rf "$ROOT/$matrix/torch-$ver"
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "matrix: FAILED under torch ${failed[*]}" >&2
  exit 1
fi
echo "matrix: passed under torch $versions"
