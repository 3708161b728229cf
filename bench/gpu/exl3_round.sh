#!/usr/bin/env bash
# One round of glmctl's EXL3 decode-batch kernels on a GPU, <= 150 s: the kernels' GPU tests,
# the decode-rate bench (bench/exl3_decode_rate.py), then the A/B against exllamav3's coop
# kernel (bench/exl3.py, CUDA graphs) at 2, 8 and 32 tokens, uniform routing and routing over
# 16 L2-resident experts; the short table last.
#
#   there (torch + Triton installed; vLLM is not needed):   bash bench/gpu/exl3_round.sh
#   carry .whl/ (its ext/exllamav3_ext.so is exllamav3 1.6.5's prebuilt extension; see
#   ../shared/tools/gpu-wheels.sh): without it the coop rows and exllamav3's rates are notes.
#
# Each step runs under its own time limit (EXL3_ROUND_SECONDS="tests rate uniform hot", default
# "48 30 42 20"); EXL3_ROUND_SWEEP names the extra Triton configs timed at 8 and 32 tokens.
# Writes under $OUT (default ./out/exl3-round): exl3-decode-tests.{xml,log}, exl3-decode-record.json,
# exl3-decode-rate.{json,log}, moe-bench-{uniform,hot16}.{json,md,log}.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/exl3-round}
mkdir -p "$OUT"
# pyproject's package mapping by symlinks, as bench/gpu/kernels_round.sh makes it
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
export PYTHONPATH=${PYTHONPATH:-/tmp/vsite}:$PWD:$PWD/.whl/ext
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 EXL3_EXPANDABLE_SEGMENTS=0
export GLMCTL_EXL3_RECORD="$OUT/exl3-decode-record.json"
read -r T_TESTS T_RATE T_UNIFORM T_HOT <<< "${EXL3_ROUND_SECONDS:-48 30 42 20}"
SWEEP=${EXL3_ROUND_SWEEP:-exl3_triton.split4_k128,exl3_triton.split4_s2}

python3 - <<'PY'
import importlib.util, torch, triton
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}; triton {triton.__version__}; {p.name}, {p.multi_processor_count} SMs")
if importlib.util.find_spec("exllamav3_ext") is None:
    print("exllamav3_ext not importable (carry .whl/): the A/B steps and exllamav3's rates will be missing")
PY

timeout "$T_TESTS" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/exl3-decode-tests.xml" \
    tests/gpu/test_exl3_decode.py > "$OUT/exl3-decode-tests.log" 2>&1
echo "tests exit $? ($(grep -E '[0-9]+ (passed|failed)' "$OUT/exl3-decode-tests.log" | tail -1))"

timeout "$T_RATE" python3 bench/exl3_decode_rate.py --out "$OUT" > "$OUT/exl3-decode-rate.log" 2>&1
echo "decode-rate bench exit $?"

timeout "$T_UNIFORM" python3 bench/exl3.py --tokens 2,8,32 --paths exl3_coop_lean,exl3_triton --prefill "" \
    --sweep "$SWEEP" --sweep-tokens 8,32 --no-launches --tag uniform --out "$OUT" > "$OUT/moe-bench-uniform.log" 2>&1
echo "A/B uniform exit $?"

timeout "$T_HOT" python3 bench/exl3.py --tokens 2,8,32 --paths exl3_coop_lean,exl3_triton --prefill "" \
    --hot-experts 16 --no-launches --tag hot16 --out "$OUT" > "$OUT/moe-bench-hot16.log" 2>&1
echo "A/B hot16 exit $?"

grep -hE "^(FAILED|ERROR)|Error" "$OUT/exl3-decode-tests.log" "$OUT/exl3-decode-rate.log" | head -12
python3 bench/exl3_decode_rate.py --summary "$OUT"
