# The commands people type. `make demo` and `make test` do all the set-up themselves.
PY ?= python3

.PHONY: demo test test-torch-matrix planted-bugs setup bench lint ctest cuda-report wheel clean

demo: setup
	$(PY) -m lossagg demo

test:
	bash scripts/test.sh

# One wheel, built once here, installed with its dependencies into fresh venvs with torch 2.10.0
# (the floor) and 2.15.0 (LOSSAGG_MATRIX_TORCH), where the ops, autograd, compile and config
# tests run against it (scripts/test_torch_matrix.sh). Needs torch and the build tools here.
test-torch-matrix:
	bash scripts/test_torch_matrix.sh

# Each adapter's and each mode's known bugs planted one at a time in a scratch copy, and the tests
# that must catch each run (scripts/planted_bugs.py; CI's full tier runs it). After `make test`.
planted-bugs: setup
	$(PY) scripts/planted_bugs.py

setup:
	bash scripts/setup.sh

bench: setup
	$(PY) benchmarks/bench_reduce.py

ctest: setup
	bash scripts/ctest.sh

# The CUDA kernels' resources as ptxas reports them for sm_90 (no GPU needed): a table of
# kernels, registers, spills, shared memory and occupancy (docs/benchmarks.md).
cuda-report: setup
	$(PY) scripts/cuda_report.py

# dist/lossagg-*.whl: the CPU kernels (plus CUDA for TORCH_CUDA_ARCH_LIST when asked for,
# scripts/build_plan.py), stripped, requiring the torch release it was built against.
wheel: setup
	rm -rf dist && $(PY) -m pip wheel --no-build-isolation --no-deps -q -w dist .
	@ls -l dist/*.whl

# ruff (check + format) and clang-format at pinned versions (scripts/lint.sh installs them);
# .ci/run and .pre-commit-config.yaml run the same
lint:
	bash scripts/lint.sh

clean:
	rm -rf build dist lossagg/liblossagg_ops.so lossagg/_build_info.py *.egg-info
