#!/usr/bin/env bash
# One device call without staging vLLM (~5 minutes): every glmctl kernel's GPU tests against its
# torch reference (the comparisons with vLLM's kernels skip); the EXL3 decode A/B at 4 and 32
# tokens in CUDA graphs (exllamav3's coop_lean vs glmctl's Triton decode) and the prefill A/B at
# 2,048 and 8,192 tokens (exl3_moe vs glmctl's Triton prefill, each path's distance from the
# first); the prefill's per-kernel profile at 2,048 tokens. The bench and profile run under
# DISABLE_MMA_V3=1 (Triton then gives Hopper the mma.sync code an sm_89 node runs; exllamav3's
# CUDA kernels are unaffected). For when device time is short: staging vLLM costs ~3 calls first.
#
#   there, carry [".whl"]:   bash bench/gpu/quick_round.sh          timeout_s 420
#
# QUICK_TESTS_SECONDS (default 150) bounds the tests, QUICK_BENCH_SECONDS (150) the bench,
# QUICK_PROFILE_SECONDS (45) the profile; 0 skips the tests or the profile (after switch_lane.sh,
# which runs the kernels' tests, in the same call). QUICK_DECODE_TOKENS / QUICK_DECODE_PATHS and
# QUICK_PREFILL_TOKENS / QUICK_PREFILL_PATHS narrow the A/Bs. Writes under $OUT: quick-tests.log,
# moe-bench.{json,md}, prefill-bench.log, prefill-profile.txt, exl3-decode-record.json; prints
# the tables last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/quick}
mkdir -p "$OUT"
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1 || echo "installing the carried wheels failed (exllamav3 rows will be missing)"
export PYTHONPATH=/tmp/site:$PWD:$PWD/.whl/ext PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
export GLMCTL_EXL3_RECORD=$OUT/exl3-decode-record.json
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if [ "${QUICK_TESTS_SECONDS:-150}" -gt 0 ]; then
  timeout "${QUICK_TESTS_SECONDS:-150}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
    tests/gpu/test_exl3_decode.py tests/gpu/test_mhc_gpu.py tests/gpu/test_topk_gpu.py tests/gpu/test_kda_gpu.py \
    tests/gpu/test_fp8_linear_gpu.py > "$OUT/quick-tests.log" 2>&1
  echo "tests exit $? ($(grep -E '[0-9]+ (passed|failed)' "$OUT/quick-tests.log" | tail -1))"
fi

# Ada's instructions: the 64-slot prefill products reach wgmma's M on Hopper, which an sm_89 node lacks
export DISABLE_MMA_V3=1
timeout "${QUICK_BENCH_SECONDS:-150}" python3 bench/exl3.py --tokens "${QUICK_DECODE_TOKENS:-4,32}" \
  --paths "${QUICK_DECODE_PATHS:-exl3_coop_lean,exl3_triton}" --prefill "${QUICK_PREFILL_TOKENS:-2048,8192}" \
  --prefill-paths "${QUICK_PREFILL_PATHS:-exl3_auto,exl3_prefill_triton,exl3_prefill_triton.prefill_r64_combine,exl3_prefill_triton.prefill_r32,bf16_torch}" \
  --no-launches --out "$OUT" > "$OUT/prefill-bench.log" 2>&1
echo "prefill bench exit $?"
if [ "${QUICK_PROFILE_SECONDS:-45}" -gt 0 ]; then
  timeout "${QUICK_PROFILE_SECONDS:-45}" python3 bench/gpu/exl3_prefill_profile.py 2048 triton,recon \
    > "$OUT/prefill-profile.txt" 2>&1
  echo "prefill profile exit $?"
fi

grep -sE "^(FAILED|ERROR)" "$OUT/quick-tests.log" | cut -c1-200 | head -20
grep -sE "^== |_kernel|exl3_moe_kernel|Self CUDA time total" "$OUT/prefill-profile.txt" | cut -c1-40,100-150 | head -20
grep -E '"mode": "(eager|cuda-graph)"' "$OUT/prefill-bench.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(f\"{r['path']:<42} {r['tokens']:>5} {r['mode']:<10} {r['us']:>9.1f} us  copy {r.get('frac_copy') or 0:.3f}  err {r.get('rel_err_vs_first_exl3', float('nan')):.2e}\")"
