#!/usr/bin/env bash
# pyproject.toml promises Python >= 3.10. This runs the configuration tests (which need
# neither torch nor the native library) under the oldest Python it finds, in a venv of
# its own (build/py-min, kept between runs). Prints why when no such interpreter exists.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
min=$(sed -n 's/^requires-python = ">=\([0-9.]*\)"/\1/p' pyproject.toml)
py=""
for cand in "${LOSSAGG_MIN_PYTHON:-}" "$HOME"/.pyenv/versions/"$min".*/bin/python "python$min"; do
  # a pyenv shim may exist and still refuse to run: try it
  if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys' >/dev/null 2>&1; then
    py=$(command -v "$cand"); break
  fi
done
if [ -z "$py" ]; then
  echo "min-python: no Python $min interpreter found (set LOSSAGG_MIN_PYTHON): not checked"
  exit 0
fi
venv=build/py-min
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import pydantic, yaml, pytest" 2>/dev/null; then
  make_venv() { rm -rf "$venv" && "$py" -m venv "$venv" && PY="$venv/bin/python" pip_install "pydantic>=2.6" "pyyaml>=6" "pytest>=8" "tomli>=2; python_version < '3.11'"; }
  run_step "min-python: made $venv with pydantic, PyYAML and pytest" min-python-venv make_venv
fi
echo "min-python: $("$venv/bin/python" --version) (no torch): the configuration tests"
PYTHONPATH=. "$venv/bin/python" -m pytest tests/test_config.py --noconftest -q -p no:cacheprovider
