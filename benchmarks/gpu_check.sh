#!/usr/bin/env bash
# The one prepared GPU run for a session that has the device machine (see its README):
# wheels for what the image lacks, build there, the CUDA tests, the CUDA benchmark.
# Outputs land under $OUT. Prepare here first:  bash ../shared/device/fetch-wheels.sh pyyaml pydantic cmake ninja
# Run there as:  bash benchmarks/gpu_check.sh   (carry: .whl)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  export PATH=/tmp/site/bin:$PATH  # cmake and ninja from their wheels, if the image lacks them
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
echo "== build" | tee "$OUT/summary.txt"
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc) LOSSAGG_BUILD_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
echo "== tests (every device-parametrised test, CUDA included)" | tee -a "$OUT/summary.txt"
python3 -m pytest tests -q -x -p no:cacheprovider --ignore=tests/test_demo.py --ignore=tests/test_distributed.py --ignore=tests/test_install.py \
  >"$OUT/tests.log" 2>&1
echo "pytest exit $?" | tee -a "$OUT/summary.txt"
tail -5 "$OUT/tests.log" | tee -a "$OUT/summary.txt"
echo "== sync check (no synchronisation once the plan is built; bandwidth at 16M tokens against a device copy)" | tee -a "$OUT/summary.txt"
timeout 300 python3 benchmarks/sync_check.py --device cuda >"$OUT/sync_check.md" 2>&1
echo "sync check exit $?" | tee -a "$OUT/summary.txt"
tail -4 "$OUT/sync_check.md" | tee -a "$OUT/summary.txt"
echo "== benchmark" | tee -a "$OUT/summary.txt"
timeout 300 python3 benchmarks/bench_reduce.py --device cuda --repeats 20 >"$OUT/bench_cuda.md" 2>&1
echo "bench exit $?" | tee -a "$OUT/summary.txt"
cat "$OUT/bench_cuda.md"
