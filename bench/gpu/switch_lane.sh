#!/usr/bin/env bash
# The gpu lane with glmctl's decode-kernel switches on, and beside it each switch's kernel GPU tests:
# one device call says both whether the model stays correct inside real vLLM with the new kernels
# and, if a lane case fails, which kernel's own tests fail too.
#
#   there (vLLM staged: `bash .stage/unpack.sh` first, in the same warm machine), carry [".whl"]:
#     bash bench/gpu/switch_lane.sh                   timeout_s 600
#
# SWITCHES (default: every decode switch below) names the ones turned on, e.g. SWITCHES="fp8 mhc".
# The tests run in parallel processes beside the lane (Triton's JIT is CPU work; the machine has 16
# cores), each bounded by SWITCH_TEST_SECONDS (default 240); the lane keeps its own budget
# (VLLM_LANE_BUDGET, default 560 here). Writes under $OUT: the lane's files (vllm_lane.sh) and
# switch-tests.log; prints the tests' lines and then the lane's table last.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
declare -A ENV=(
  [fp8]="GLMCTL_FP8_LINEAR=glmctl GLMCTL_ROUTER_GEMM=glmctl"
  [mhc]="GLMCTL_MHC_DECODE=fused"
  [kda]="GLMCTL_KDA_DECODE=glmctl"
  [topk]="GLMCTL_INDEXER_TOPK=packed"
  [exl3]="GLMCTL_EXL3_DECODE=triton"
)
declare -A TEST=(
  [fp8]=tests/gpu/test_fp8_linear_gpu.py [mhc]=tests/gpu/test_mhc_gpu.py [kda]=tests/gpu/test_kda_gpu.py
  [topk]=tests/gpu/test_topk_gpu.py [exl3]=tests/gpu/test_exl3_decode.py
)
chosen=${SWITCHES:-fp8 mhc kda topk exl3}
for name in $chosen; do
  [ -n "${ENV[$name]:-}" ] || { echo "unknown switch $name (one of: ${!ENV[*]})"; exit 2; }
  # shellcheck disable=SC2163,SC2086  # each entry is NAME=VALUE words
  export ${ENV[$name]}
done
echo "switches on: $(env | grep -E '^GLMCTL_(FP8_LINEAR|ROUTER_GEMM|MHC_DECODE|KDA_DECODE|INDEXER_TOPK|EXL3_DECODE)=' | sort | tr '\n' ' ')"

# The kernels' own tests, in the background, in the staged environment the lane sets up for itself.
mkdir -p /tmp/switch-tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/switch-site .whl/*.whl \
  > /dev/null 2>&1 || echo "installing the carried wheels failed (exl3 tests will skip)"
pids=()
for name in $chosen; do
  (PYTHONPATH=/tmp/vsite:$PWD/.whl/ext:/tmp/switch-site:$PWD TRITON_CACHE_DIR=/tmp/switch-tests/triton-$name \
     timeout --kill-after=5 "${SWITCH_TEST_SECONDS:-240}" \
     python3 -m pytest -m gpu "${TEST[$name]}" -q -rs -x -p no:cacheprovider > "/tmp/switch-tests/$name.log" 2>&1
   echo "$name: exit $? ($(grep -E '[0-9]+ (passed|failed|skipped)' "/tmp/switch-tests/$name.log" | tail -1))" \
     > "/tmp/switch-tests/$name.line") &
  pids+=($!)
done

VLLM_LANE_BUDGET=${VLLM_LANE_BUDGET:-560} bash bench/gpu/vllm_lane.sh > "$OUT/switch-lane.txt" 2>&1
wait "${pids[@]}" 2>/dev/null
: > "$OUT/switch-tests.log"
for name in $chosen; do
  { echo "== $name"; cat "/tmp/switch-tests/$name.log"; } >> "$OUT/switch-tests.log"
done
grep -hE "^(FAILED|ERROR)" /tmp/switch-tests/*.log | cut -c1-200 | head -20
cat /tmp/switch-tests/*.line
tail -40 "$OUT/switch-lane.txt"
