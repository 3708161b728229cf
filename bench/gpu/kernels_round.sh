#!/usr/bin/env bash
# One round of glmctl's decode-kernel work on the H200: each kernel's GPU tests, then its A/B
# benchmark, every step under its own time limit, the short tables printed last.
#
#   there (vLLM staged: `bash .stage/unpack.sh` first, in the same warm machine):
#     bash bench/gpu/kernels_round.sh            carry: out/bench/mhc_baseline.py (optional)
#
# Steps (budget ~150 s with Triton's JIT; each limited by ROUND_STEP_SECONDS, default 150):
#   mhc    tests/gpu/test_mhc_gpu.py, then bench/mhc.py (against out/bench/mhc_baseline.py, a copy of
#          the previous kernels/mhc_pre_post.py, when carried)
#   fp8    tests/gpu/test_fp8_linear_gpu.py, then bench/gpu/fp8_linear_bench.py (vs vLLM's Marlin FP8)
#   topk   tests/gpu/test_topk_gpu.py, then bench/gpu/topk_bench.py (new vs previous top-k)
#   kda    tests/gpu/test_kda_gpu.py, then bench/gpu/kda_bench.py (glmctl's one-launch KDA decode vs
#          vLLM's FLA kernels at 8x4 and 1x4 tokens)
# A step whose files are absent is skipped. ROUND_STEPS="fp8 mhc" runs only the named steps, in
# that order; ROUND_BUDGET (seconds, default 560) bounds the whole round: each test or bench gets
# at most what is left less 15 s, and none starts with under 30 s left, so one device call of
# 600 s always ends with the tables. Writes under $OUT: round.log (every test log) and each
# bench's JSON.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/round}
mkdir -p "$OUT"
# pyproject's package mapping by symlinks, as bench/gpu/vllm_lane.sh and rank_sim.sh make it
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
export PYTHONPATH=${PYTHONPATH:-/tmp/vsite}:$PWD
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 VLLM_USE_FLASHINFER_SAMPLER=0
LIMIT=${ROUND_STEP_SECONDS:-150}
BUDGET=${ROUND_BUDGET:-560}
STARTED=$(date +%s)
limit() {  # this part's time limit: the step limit, cut to what the round has left less 15 s
  local left=$(( BUDGET - ($(date +%s) - STARTED) - 15 ))
  [ "$left" -lt "$LIMIT" ] && echo "$left" || echo "$LIMIT"
}
LOG=$OUT/round.log
: > "$LOG"
TABLES=$OUT/.tables
: > "$TABLES"

step() {  # step NAME TEST BENCH [BENCH ARGS...]
  local name=$1 test=$2 bench=$3; shift 3
  if [ -f "$test" ]; then
    if [ "$(limit)" -lt 30 ]; then echo "$name tests skipped: the round's budget is spent"; return; fi
    echo "== $name: $test" >> "$LOG"
    timeout "$(limit)" python3 -m pytest -m gpu "$test" -q -rs -p no:cacheprovider >> "$LOG" 2>&1
    echo "$name tests exit $? ($(grep -E '[0-9]+ (passed|failed)' "$LOG" | tail -1))"
  fi
  if [ -f "$bench" ]; then
    if [ "$(limit)" -lt 30 ]; then echo "$name bench skipped: the round's budget is spent"; return; fi
    echo "== $name: $bench $*" >> "$LOG"
    timeout "$(limit)" python3 "$bench" "$@" > "$OUT/$name-bench.txt" 2>&1
    local rc=$?
    echo "$name bench exit $rc"
    { echo "-- $name (exit $rc)"; tail -15 "$OUT/$name-bench.txt"; } >> "$TABLES"
    cat "$OUT/$name-bench.txt" >> "$LOG"; rm -f "$OUT/$name-bench.txt"
  fi
}

python3 -c "import torch, triton; p = torch.cuda.get_device_properties(0); print(f'torch {torch.__version__}; triton {triton.__version__}; {p.name}, {p.multi_processor_count} SMs')"
base=()
[ -f out/bench/mhc_baseline.py ] && base=(--baseline out/bench/mhc_baseline.py)
declare -A STEP=(
  [mhc]="tests/gpu/test_mhc_gpu.py bench/mhc.py --out $OUT/mhc-h200.json --sweep ${base[*]:-}"
  [fp8]="tests/gpu/test_fp8_linear_gpu.py bench/gpu/fp8_linear_bench.py --out $OUT/fp8-linear-h200.json"
  [topk]="tests/gpu/test_topk_gpu.py bench/gpu/topk_bench.py --out $OUT/topk-h200.json"
  [kda]="tests/gpu/test_kda_gpu.py bench/gpu/kda_bench.py --out $OUT/kda-bench-h200.json"
)
for name in ${ROUND_STEPS:-mhc fp8 topk kda}; do
  [ -n "${STEP[$name]:-}" ] || { echo "unknown step $name (one of: ${!STEP[*]})"; continue; }
  # shellcheck disable=SC2086  # the table's entries are word lists (no spaces inside a word)
  step "$name" ${STEP[$name]}
done
grep -E "^(FAILED|ERROR)" "$LOG" | head -20
cat "$TABLES"; rm -f "$TABLES"
