#!/usr/bin/env bash
# The lint every commit must pass (`make lint`, .ci/run, and .pre-commit-config.yaml run
# this): ruff (check + format) on the Python, clang-format on the C++ and CUDA sources, at
# pinned versions installed here when missing, so everyone sees the same verdict. One
# column limit for both languages: 150 (pyproject.toml's ruff line-length, .clang-format's
# ColumnLimit). Fails on any finding; never skips a language.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
. scripts/steps.sh
RUFF_VERSION=0.17.6
CLANG_FORMAT_VERSION=20.1.8

have() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$1') == '$2' else 1)" 2>/dev/null; }
have ruff "$RUFF_VERSION" || run_step "lint: installed ruff $RUFF_VERSION" lint-ruff pip_install "ruff==$RUFF_VERSION"
have clang-format "$CLANG_FORMAT_VERSION" \
  || run_step "lint: installed clang-format $CLANG_FORMAT_VERSION" lint-clang-format pip_install "clang-format==$CLANG_FORMAT_VERSION"
bin=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')

python_files=(lossagg tests benchmarks examples docs scripts setup.py)
cpp_files=$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.cpp' 'tests/cuda_host/*.h' 'tests/cuda_host/*.cpp')
# shellcheck disable=SC2086
"$bin/ruff" check "${python_files[@]}" \
  && "$bin/ruff" format --check --quiet "${python_files[@]}" \
  && "$bin/clang-format" --dry-run --Werror $cpp_files \
  && echo "lint: ruff $RUFF_VERSION (check, format) and clang-format $CLANG_FORMAT_VERSION: clean"
