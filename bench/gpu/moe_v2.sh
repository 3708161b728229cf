#!/usr/bin/env bash
# Routed experts at decode batch sizes on the H200: every EXL3 / FP8 path of bench/exl3.py vs the
# bytes it must move, exllamav3's own knobs, and Nsight Compute on the main kernels.
#
# Here, once (writes .whl/: the gpu wheels, the prebuilt exllamav3 extension, and vLLM 0.30's
# fused_moe.py from this checkout's .venv, which the FP8 rows run; vLLM itself is not needed there):
#   ../shared/tools/gpu-wheels.sh && bash bench/gpu/moe_v2.sh prep
# There (carry .whl):
#   OUT=... bash bench/gpu/moe_v2.sh explore   # ~150 s: parallel Triton warm-up, the full sweep at
#                                              # 1/8/32/48 tokens + prefill 2048/8192, exllamav3
#                                              # coop knobs, ncu at 8 and 32 tokens
#   OUT=... bash bench/gpu/moe_v2.sh final     # ~150 s: tests/gpu/test_exl3.py, then the chosen paths
# Each step has its own time limit (seconds, overridable: WARM_S BENCH_S KNOBS_S NCU_S TEST_S) and
# the script goes on after a failure. $OUT gets at most 5 files: run.log (every step's output),
# moe-bench.json (all rows, every tag) and .md, ncu.csv, ncu-summary.json; the compact table last.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
mode=${1:-explore}
if [ "$mode" = prep ]; then
  src=$(ls .venv/lib/python3*/site-packages/vllm/model_executor/layers/fused_moe/fused_moe.py | head -1)
  mkdir -p .whl/vllm && cp "$src" .whl/vllm/fused_moe.py && echo "copied $src -> .whl/vllm/fused_moe.py"
  exit 0
fi
export OUT=${OUT:-$ROOT/out/gpu}
W=/tmp/moe-work  # intermediate files; what comes back is collected into $OUT at the end
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/run.log") 2>&1
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v '/glmctl-') || { echo "installing the carried wheels failed"; exit 3; }
export PYTHONPATH=$ROOT/.whl/ext:/tmp/site:$ROOT PYTHONUNBUFFERED=1 EXL3_EXPANDABLE_SEGMENTS=0
export TRITON_CACHE_DIR=/tmp/moe-triton-cache VLLM_FUSED_MOE_PY=$ROOT/.whl/vllm/fused_moe.py
B="python3 bench/exl3.py"
step() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s, $(date +%T))"
  timeout --kill-after=5 "$secs" "$@"; echo "=== $name rc=$?"
}
{ python3 -c "import torch, triton, exllamav3_ext as e; print(torch.__version__, triton.__version__,
torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs;',
'exl3_moe groups', e.exl3_moe_max_concurrency(0))"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv,noheader; ncu --version | tail -1; } \
  2>&1

DECODE="exl3_coop,exl3_coop_lean,exl3_triton,fp8_torch,bf16_torch,fp8_vllm.vllm_default,fp8_vllm_k.vllm_default"
if [ "$mode" = explore ]; then
  # 1. Triton compiles in parallel processes (the on-disk cache serves the timed run)
  T="timeout --kill-after=3 ${WARM_S:-35}"
  step warm "$(( ${WARM_S:-35} + 5 ))" bash -c "
    $T $B --warm --tokens 1,8,32,48 --paths 'exl3_triton,exl3_triton.split8,exl3_triton.split4' > $W/warm1.log 2>&1 &
    $T $B --warm --tokens 8,32 --paths 'exl3_triton.split2,exl3_triton.split1,exl3_triton.split1_k128_w8,exl3_coop_lean' > $W/warm2.log 2>&1 &
    $T $B --warm --tokens 8,32 --paths 'exl3_triton.split2_n512,exl3_triton.split4_k128_w8' > $W/warm3.log 2>&1 &
    $T $B --warm --tokens 8,32 --paths 'fp8_vllm_k.n*' > $W/warm4.log 2>&1 &
    $T $B --warm --tokens 1,8,32,48,2048,8192 --paths 'fp8_vllm.vllm_default,fp8_vllm_k.vllm_default' > $W/warm5.log 2>&1 &
    wait; tail -n 3 $W/warm*.log"
  # 2. the sweep: every path at 1/8/32/48 tokens, the configs at 8/32, prefill chunks
  step bench "${BENCH_S:-55}" $B --tokens 1,8,32,48 --paths "$DECODE" \
    --sweep 'exl3_fused,exl3_triton.*,fp8_vllm_k.*' --sweep-tokens 8,32 \
    --prefill 2048,8192 --prefill-paths 'exl3_auto,fp8_torch,bf16_torch,fp8_vllm.vllm_default' --out "$W"
  # 3. exllamav3's coop knobs (read once per process): narrow tiles, forced split-k
  step knobs "${KNOBS_S:-25}" bash -c "
    EXL3_MOE_COOP_WIDE=0 $B --tokens 8,32 --paths exl3_coop_lean --prefill '' --tag wide0 --out $W | tail -n 4
    EXL3_MOE_COOP_KSPLIT=4 $B --tokens 1,8 --paths exl3_coop_lean --prefill '' --tag ksplit4 --out $W | tail -n 4"
  # 4. Nsight Compute on the main kernels at 8 and 32 tokens (one eager call each, after a marker)
  step ncu "${NCU_S:-35}" ncu --profile-from-start off --clock-control none \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum \
    -k 'regex:spin_kernel|exl3|_prologue_kernel|_gate_up_kernel|_down_kernel|_combine_kernel|_coop_inputs_kernel|fused_moe_kernel|gemm|cutlass' \
    --csv --page raw --log-file "$OUT/ncu.csv" \
    $B --profile --tokens 8,32 --paths 'exl3_coop_lean,exl3_triton,exl3_fused,fp8_vllm_k.vllm_default,fp8_torch' \
    > "$W/profile.log" 2>&1
  tail -n 5 "$W/profile.log"
  python3 bench/ncu_summary.py "$OUT/ncu.csv" "$W/profile.log" --json "$OUT/ncu-summary.json" | head -c 7000
elif [ "$mode" = final ]; then
  export GLMCTL_EXL3_RECORD="$W/exl3-gpu-tests.json"
  step tests "${TEST_S:-100}" bash -c "cd /tmp && python3 -m pytest -p no:cacheprovider --import-mode=importlib \
    --rootdir $ROOT -c $ROOT/pyproject.toml -m gpu -q -rs --durations=6 $ROOT/tests/gpu/test_exl3.py > $W/tests.log 2>&1"
  tail -n 25 "$W/tests.log"
  python3 - "$W/exl3-gpu-tests.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print(f"(no test record: {exc})"); sys.exit(0)
for k, v in (r.get("moe_vs_reference") or {}).items():
    print(f"{k:44s} vs deq {v['rel_error_vs_dequantised']:.2e}  vs bf16 {v['rel_error_vs_original_weights']:.3f}")
print("graph replay:", r.get("cuda_graph_replay_rel_error"), " tp2:", r.get("tp2_slices_vs_whole_rel_error"),
      " trellis mismatches:", r.get("trellis_reference_mismatches"))
PY
  step bench "${BENCH_S:-45}" $B --tokens 1,8,32,48 --paths "${FINAL_PATHS:-exl3_auto,$DECODE}" \
    --prefill 2048,8192 --prefill-paths 'exl3_auto,fp8_torch,bf16_torch,fp8_vllm.vllm_default' --out "$W"
else
  echo "usage: $0 prep|explore|final"; exit 2
fi
# Collect: every run's rows in one moe-bench.json (the first run's metadata), its table as .md
python3 - "$W" "$OUT" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/moe-bench*.json"))]
if runs:
    merged = dict(runs[0], rows=[r for run in runs for r in run["rows"]], partial=any(r.get("partial") for r in runs),
                  runs=[{k: run.get(k) for k in ("tag", "env", "notes", "agree", "bench_seconds", "partial")} for run in runs])
    json.dump(merged, open(f"{sys.argv[2]}/moe-bench.json", "w"), indent=1)
    open(f"{sys.argv[2]}/moe-bench.md", "w").write("\n\n".join(open(f).read() for f in sorted(glob.glob(f"{sys.argv[1]}/moe-bench*.md"))))
PY
grep -h "^note\|^agree" "$W"/moe-bench*.md 2>/dev/null | head -24
# The compact table: one line per path, us and fraction of copy bandwidth per token count
python3 - "$OUT" <<'PY'
import json, sys
try:
    rows = json.load(open(f"{sys.argv[1]}/moe-bench.json"))["rows"]
except Exception as exc:
    print(f"no bench rows: {exc}"); sys.exit(0)
sizes = sorted({r["tokens"] for r in rows})
by = {}
for r in rows:
    by.setdefault(r["path"] + (f" [{r['tag']}]" if r.get("tag") else ""), {})[r["tokens"]] = r
print("path".ljust(30) + "".join(f"{('T=' + str(t)):>17}" for t in sizes) + "   (us / frac_copy; MB must move at T=32)")
for name, cells in sorted(by.items()):
    line = name[:30].ljust(30)
    for t in sizes:
        r = cells.get(t)
        line += f"{r['us']:>10.1f}/{r['frac_copy']:.2f}" if r else " " * 17
    mb = cells.get(32, {}).get("bytes")
    print(line + (f"   {mb / 1e6:.0f} MB" if mb else ""))
PY
