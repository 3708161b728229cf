#!/usr/bin/env bash
# The kernels' GPU lane and benchmark in one call, for a CUDA machine with no package index.
#
#   there:  bash bench/gpu/kernels.sh          (from the repository root; writes under $OUT)
#
# glmctl is not installed there: a symlink glmctl/kernels -> ../kernels (in this throw-away copy)
# puts kernels/ at glmctl.kernels, as pyproject's package-dir mapping does. Runs
# tests/gpu/test_kernels_gpu.py, then
# bench/kernels.py; prints the benchmark table last. Budgets: TEST_SECONDS, BENCH_SECONDS.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/kernels}
mkdir -p "$OUT"
[ -e glmctl/kernels ] || ln -s ../kernels glmctl/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
python3 - <<'PY' 2>&1 | tee "$OUT/kernels-env.txt"
import torch, triton, glmctl.kernels
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}; triton {triton.__version__}; {p.name}, {p.multi_processor_count} SMs")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,clocks.max.sm --format=csv,noheader \
  | tee -a "$OUT/kernels-env.txt"
timeout "${TEST_SECONDS:-130}" python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -rs \
  -p no:cacheprovider --junitxml="$OUT/kernels-gpu-tests.xml" > "$OUT/kernels-gpu-tests.log" 2>&1
echo "gpu tests exit $?"
grep -E "passed|failed|error" "$OUT/kernels-gpu-tests.log" | tail -3
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/kernels-gpu-tests.log" | head -20
python3 bench/kernels.py --out "$OUT/kernels-bench.json" --deadline "${BENCH_SECONDS:-130}" \
  > "$OUT/kernels-bench.log" 2>&1
echo "bench exit $?"
grep -E "^sweep|^prefill|failed" "$OUT/kernels-bench.log" | tail -60
cat "$OUT/kernels-bench.txt" 2>/dev/null || tail -30 "$OUT/kernels-bench.log"
