#!/usr/bin/env bash
# Routed experts at decode batch sizes on the H200: every EXL3 / FP8 path of bench/exl3.py vs the
# bytes it must move, exllamav3's own knobs, and Nsight Compute on the main kernels.
#
# Here, once (writes .whl/: the gpu wheels, the prebuilt exllamav3 extension, and vLLM 0.30's
# fused_moe.py from this checkout's .venv, which the FP8 rows run; vLLM itself is not needed there):
#   ../shared/tools/gpu-wheels.sh && bash bench/gpu/moe_v2.sh prep
# There (carry .whl; the whole script stops itself before TOTAL_S, default 560 s):
#   OUT=... bash bench/gpu/moe_v2.sh final     # ~430 s: gpu tests (the Triton path in its own
#                                              # process), the Triton path alone (and, if it faults,
#                                              # compute-sanitizer on one call), every other path at
#                                              # 1/8/32/48 tokens + prefill 2048/8192, ncu
#   OUT=... bash bench/gpu/moe_v2.sh explore   # ~200 s: parallel Triton warm-up, the config sweep,
#                                              # exllamav3 coop knobs, ncu at 8 and 32 tokens
# Any path that faults ("an illegal memory access") poisons its CUDA context, so each step that
# can fault runs in its own process and the rows of the others survive. Each step has its own
# time limit (seconds, overridable: WARM_S BENCH_S PREFILL_S TRITON_S SAN_S KNOBS_S NCU_S TEST_S TTEST_S),
# cut to what is left of TOTAL_S. $OUT gets at most 7 files: run.log (every step's output),
# moe-bench.json (all rows, every tag) and .md, ncu.csv, ncu-summary.json, the two test records.
# Printed last: each step's exit status, then one line per path: us / fraction of copy bandwidth
# at each token count, and the MB a call must move at 32 tokens.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
mode=${1:-final}
if [ "$mode" = prep ]; then
  src=$(ls .venv/lib/python3*/site-packages/vllm/model_executor/layers/fused_moe/fused_moe.py | head -1)
  mkdir -p .whl/vllm && cp "$src" .whl/vllm/fused_moe.py && echo "copied $src -> .whl/vllm/fused_moe.py"
  exit 0
fi
TOTAL_S=${TOTAL_S:-560}
RESERVE_S=15  # collection and the table
export OUT=${OUT:-$ROOT/out/gpu}
W=/tmp/moe-work  # intermediate files; what comes back is collected into $OUT at the end
rm -rf "$W"; mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/run.log") 2>&1
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v '/glmctl-') || { echo "installing the carried wheels failed"; exit 3; }
export PYTHONPATH=$ROOT/.whl/ext:/tmp/site:$ROOT PYTHONUNBUFFERED=1 EXL3_EXPANDABLE_SEGMENTS=0
export TRITON_CACHE_DIR=/tmp/moe-triton-cache VLLM_FUSED_MOE_PY=$ROOT/.whl/vllm/fused_moe.py
B="python3 bench/exl3.py"
step() {  # name seconds command...: runs with the smaller of its limit and what is left
  local name=$1 secs=$2 left rc; shift 2
  left=$(( TOTAL_S - RESERVE_S - SECONDS ))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 5 ]; then echo "=== $name skipped (no time left)"; echo "$name=skip" >> "$W/status"; return 0; fi
  echo "=== $name (limit ${secs}s, at ${SECONDS}s)"
  timeout --kill-after=5 "$secs" "$@"; rc=$?
  echo "=== $name rc=$rc (at ${SECONDS}s)"; echo "$name=$rc" >> "$W/status"  # a file: steps run in subshells too
  return $rc
}
{ python3 -c "import torch, triton, exllamav3_ext as e; print(torch.__version__, triton.__version__,
torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs;',
'exl3_moe groups', e.exl3_moe_max_concurrency(0))"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv,noheader; ncu --version | tail -1; } \
  2>&1
NCU="ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy
  --section LaunchStats --section WarpStateStats --metrics dram__bytes_read.sum,dram__bytes_write.sum
  -k regex:spin_kernel|exl3|_prologue_kernel|_gate_up_kernel|_down_kernel|_combine_kernel|_coop_inputs_kernel|fused_moe_kernel|gemm|cutlass
  --csv --page raw --log-file $OUT/ncu.csv"
PYTEST="python3 -m pytest -p no:cacheprovider --import-mode=importlib --rootdir $ROOT -c $ROOT/pyproject.toml -m gpu -q -rs"
OTHERS="exl3_auto,exl3_coop,exl3_coop_lean,exl3_fused,fp8_torch,bf16_torch,fp8_vllm.vllm_default,fp8_vllm_k.vllm_default"
PREFILL=(--prefill 2048,8192 --prefill-paths 'exl3_auto,fp8_torch,bf16_torch,fp8_vllm.vllm_default')

if [ "$mode" = final ]; then
  # 1. gpu tests: everything but the Triton path, then the Triton path in its own process
  ( cd /tmp && export GLMCTL_EXL3_RECORD="$OUT/exl3-gpu-tests.json" && step tests "${TEST_S:-100}" \
      $PYTEST --durations=4 -k "not triton" "$ROOT/tests/gpu/test_exl3.py" > "$W/tests.log" 2>&1 )
  tail -n 6 "$W/tests.log"
  ( cd /tmp && export GLMCTL_EXL3_RECORD="$OUT/exl3-gpu-tests-triton.json" && step tests_triton "${TTEST_S:-60}" \
      $PYTEST -k triton "$ROOT/tests/gpu/test_exl3.py" > "$W/tests-triton.log" 2>&1 )
  grep -E "passed|failed|error|illegal|Error" "$W/tests-triton.log" | tail -n 6
  # 2. the Triton path alone (its configs at 8 and 32 tokens too); on a fault, one call under
  #    compute-sanitizer names the kernel and the address
  if ! step triton "${TRITON_S:-90}" $B --tokens 1,8,32,48 --paths exl3_triton \
      --sweep 'exl3_triton.split2,exl3_triton.split4,exl3_triton.split1' --sweep-tokens 8,32 --prefill '' \
      --tag triton --out "$W"; then
    step sanitizer "${SAN_S:-60}" compute-sanitizer --tool memcheck --print-limit 4 \
      $B --warm --tokens 8 --paths exl3_triton 2>&1 | grep -v "^=========     " | head -n 40
  fi
  # 3. every other path (vLLM's kernels last: their cold Triton compiles), then the prefill chunks
  step bench "${BENCH_S:-110}" $B --tokens 1,8,32,48 --paths "${FINAL_PATHS:-$OTHERS}" --prefill '' --out "$W"
  step prefill "${PREFILL_S:-45}" $B --tokens '' --paths '' "${PREFILL[@]}" --tag prefill --out "$W"
  # 4. Nsight Compute: the auto path and the Triton path at 8 and 32 tokens (Triton last: it may fault)
  step ncu "${NCU_S:-50}" $NCU $B --profile --tokens 8,32 --paths 'exl3_auto,fp8_vllm_k.vllm_default,exl3_triton' \
    > "$W/profile.log" 2>&1
  tail -n 3 "$W/profile.log"
elif [ "$mode" = explore ]; then
  # 1. Triton compiles in parallel processes (the on-disk cache serves the timed run)
  T="timeout --kill-after=3 ${WARM_S:-35}"
  step warm "$(( ${WARM_S:-35} + 5 ))" bash -c "
    $T $B --warm --tokens 1,8,32,48 --paths 'exl3_triton,exl3_triton.split8,exl3_triton.split4,exl3_triton.split16_d4' > $W/warm1.log 2>&1 &
    $T $B --warm --tokens 8,32 --paths 'exl3_triton.split2,exl3_triton.split1,exl3_triton.split4_k128,exl3_triton.split4_w8' > $W/warm2.log 2>&1 &
    $T $B --warm --tokens 8,32 --paths 'exl3_triton.split4_n256,exl3_triton.split4_s2,exl3_triton.split8_s2,exl3_triton.split8_d2' > $W/warm3.log 2>&1 &
    $T $B --warm --tokens 8,32 --paths 'fp8_vllm_k.n*' > $W/warm4.log 2>&1 &
    $T $B --warm --tokens 1,8,32,48,2048,8192 --paths 'fp8_vllm.vllm_default,fp8_vllm_k.vllm_default' > $W/warm5.log 2>&1 &
    wait; tail -n 3 $W/warm*.log"
  # 2. the Triton configs alone (a fault costs only these rows), then everything else
  step triton "${TRITON_S:-60}" $B --tokens 1,8,32,48 --paths exl3_triton --sweep 'exl3_triton.*' \
    --sweep-tokens 8,32 --prefill '' --tag triton --out "$W"
  step bench "${BENCH_S:-60}" $B --tokens 1,8,32,48 --paths "$OTHERS" --sweep 'fp8_vllm_k.*' --sweep-tokens 8,32 \
    "${PREFILL[@]}" --out "$W"
  # 3. exllamav3's coop knobs (read once per process): narrow tiles, forced split-k
  step knobs "${KNOBS_S:-25}" bash -c "
    EXL3_MOE_COOP_WIDE=0 $B --tokens 8,32 --paths exl3_coop_lean --prefill '' --tag wide0 --out $W | tail -n 4
    EXL3_MOE_COOP_KSPLIT=4 $B --tokens 1,8 --paths exl3_coop_lean --prefill '' --tag ksplit4 --out $W | tail -n 4"
  step ncu "${NCU_S:-35}" $NCU $B --profile --tokens 8,32 \
    --paths 'exl3_coop_lean,exl3_fused,fp8_vllm_k.vllm_default,fp8_torch,exl3_triton' > "$W/profile.log" 2>&1
  tail -n 3 "$W/profile.log"
else
  echo "usage: $0 prep|final|explore"; exit 2
fi
[ -s "$OUT/ncu.csv" ] && python3 bench/ncu_summary.py "$OUT/ncu.csv" "$W/profile.log" --json "$OUT/ncu-summary.json" \
  > /dev/null 2>&1
# Collect: every run's rows in one moe-bench.json (the first run's metadata), its table as .md
python3 - "$W" "$OUT" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/moe-bench*.json"))]
if runs:
    main = next((r for r in runs if not r.get("tag")), runs[0])
    merged = dict(main, rows=[r for run in runs for r in run["rows"]], partial=any(r.get("partial") for r in runs),
                  runs=[{k: run.get(k) for k in ("tag", "copy_bw_bytes_per_s", "env", "notes", "agree", "bench_seconds",
                                                 "partial")} for run in runs])
    json.dump(merged, open(f"{sys.argv[2]}/moe-bench.json", "w"), indent=1)
    open(f"{sys.argv[2]}/moe-bench.md", "w").write("\n\n".join(open(f).read() for f in sorted(glob.glob(f"{sys.argv[1]}/moe-bench*.md"))))
PY
grep -h "^note\|^agree" "$W"/moe-bench*.md 2>/dev/null | head -16
echo "steps: $(tr '\n' ' ' < "$W/status")(rc 124/137: its time limit; 134 or 1 after 'illegal memory access': a fault)"
# The compact table, last: one line per path, us / fraction of copy bandwidth per token count
python3 - "$OUT" <<'PY'
import json, sys
try:
    rows = json.load(open(f"{sys.argv[1]}/moe-bench.json"))["rows"]
except Exception as exc:
    print(f"no bench rows: {exc}"); sys.exit(0)
sizes = sorted({r["tokens"] for r in rows})
by = {}
for r in rows:
    tag = r.get("tag") if r.get("tag") not in ("", "triton", "prefill") else ""
    by.setdefault(r["path"] + (f" [{tag}]" if tag else ""), {})[r["tokens"]] = r
print("path".ljust(30) + "".join(f"{('T=' + str(t)):>15}" for t in sizes) + "   (us/frac_copy; MB at T=32)")
for name, cells in sorted(by.items()):
    line = name[:30].ljust(30)
    for t in sizes:
        r = cells.get(t)
        line += f"{r['us']:>10.1f}/{r['frac_copy']:.2f}" if r else " " * 15
    mb = cells.get(32, {}).get("bytes")
    print(line + (f"   {mb / 1e6:.0f}" if mb else ""))
PY
