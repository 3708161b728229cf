#!/usr/bin/env bash
# DSA kernels v2 on the H200 stand-in: an exploratory sweep with Nsight Compute, or the final
# GPU tests + benchmark. From the repository root of a checkout; carry .peers/ (the public
# peers' files, see bench/kernels_peers.py); writes at most 8 files under $OUT; prints a short
# table last. Each step has its own time limit; the whole stays within about 150 s.
#
#   there:  bash bench/gpu/kernels_v2.sh explore     sweep every candidate config (default
#                                                    codegen, then with Hopper's wgmma off, as
#                                                    Ada compiles), then ncu on the main kernels
#           bash bench/gpu/kernels_v2.sh final       gpu tests, then the benchmark with peers
#           DISABLE_MMA_V3=1 bash ... final          the same with Ada's instructions (the
#                                                    shipped defaults were chosen with them)
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-explore}
OUT=${OUT:-$PWD/out/kernels_v2}
mkdir -p "$OUT"
[ -e glmctl/kernels ] || ln -s ../kernels glmctl/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
LOG=$OUT/$MODE.log
PEERS=()
[ -d .peers ] && PEERS=(--peers .peers)
{
  python3 -c "import torch, triton; p = torch.cuda.get_device_properties(0); print(f'torch {torch.__version__}; triton {triton.__version__}; {p.name}, {p.multi_processor_count} SMs')"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,clocks.max.sm --format=csv,noheader
  echo "peers: ${PEERS[*]:-none}; ncu: $(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || echo none)"
} > "$LOG" 2>&1

warm() {  # tag, kernels: compile the sweep's variants in 8 parallel processes (Triton's cache;
          # each holds one unfilled latent cache at a time, <= 2 GiB of GPU memory)
  local pids=() n=8 i
  for i in $(seq 0 $((n - 1))); do
    timeout 45 python3 bench/kernels.py --shard "$i/$n" --sweep-kernels "$2" \
      > "/tmp/kv2-warm-$1-$i.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  grep -h "^warm" /tmp/kv2-warm-"$1"-*.log | head -5 >> "$LOG"
}

if [ "$MODE" = explore ]; then
  started=$(date +%s)
  # Both codegens compile at once (16 processes, 16 cores). DISABLE_MMA_V3=1 keeps Hopper to
  # the mma.sync + cp.async instructions Ada has (no wgmma): the codegen our users get.
  warm default decode,indexer,topk & w1=$!
  (export DISABLE_MMA_V3=1; warm ada decode,indexer) & w2=$!
  wait $w1 $w2
  echo "warm done after $(( $(date +%s) - started )) s" >> "$LOG"
  timeout 36 python3 bench/kernels.py --sweep-only --deadline 29 --out "$OUT/sweep.json" \
    >> "$LOG" 2>&1; echo "sweep exit $?" >> "$LOG"
  DISABLE_MMA_V3=1 timeout 30 python3 bench/kernels.py --sweep-only --deadline 23 \
    --sweep-kernels decode,indexer --out "$OUT/sweep-ada.json" >> "$LOG" 2>&1
  echo "sweep (wgmma off) exit $?" >> "$LOG"
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  if [ -x "$NCU" ]; then
    timeout 35 "$NCU" --clock-control none --nvtx --nvtx-include "profile/" \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --csv --page raw \
      python3 bench/kernels.py --ncu \
      --ncu-configs "${NCU_CONFIGS:-hm-n16-w4-s3-reload-x3,hn-n32-w4-s1-x3,hn-n32-w4-s2-reload}" \
      > "$OUT/ncu-raw.csv" 2>> "$LOG"; echo "ncu exit $?" >> "$LOG"
    python3 bench/kernels_ncu.py "$OUT/ncu-raw.csv" > "$OUT/ncu-summary.txt" 2>> "$LOG"
  else
    echo "ncu: not found" >> "$LOG"
  fi
  echo "explore took $(( $(date +%s) - started )) s" >> "$LOG"
  grep -E "failed|Error" "$LOG" | head -6
  tail -4 "$LOG"
  echo "=== ncu, one launch each (us, DRAM/memory % of peak, achieved occupancy, stalls)"
  cat "$OUT/ncu-summary.txt" 2>/dev/null
  echo "=== wgmma off (Ada's instructions): fastest config per case"
  cat "$OUT/sweep-ada.txt" 2>/dev/null
  echo "=== default codegen: fastest config per case"
  cat "$OUT/sweep.txt" 2>/dev/null
elif [ "$MODE" = final ]; then
  # Three pytest processes at once (compiles dominate; sharing the GPU only slows the tests).
  T=tests/gpu/test_kernels_gpu.py
  pids=()
  for k in "sparse_mla" "indexer or topk" "not sparse_mla and not indexer and not topk"; do
    timeout "${TEST_SECONDS:-80}" python3 -m pytest -m gpu "$T" -q -rs -p no:cacheprovider \
      -k "$k" > "/tmp/kv2-test-${#pids[@]}.log" 2>&1 &
    pids+=($!)
  done
  rcs=""
  for p in "${pids[@]}"; do wait "$p"; rcs="$rcs $?"; done
  cat /tmp/kv2-test-*.log > "$OUT/gpu-tests.log"
  echo "gpu tests exit codes:$rcs" | tee -a "$LOG"
  grep -hE "passed|failed|error" /tmp/kv2-test-*.log | grep -E "^[0-9=]" | tail -3
  grep -hE "^(FAILED|ERROR)" /tmp/kv2-test-*.log | head -10
  timeout "${BENCH_SECONDS:-65}" python3 bench/kernels.py "${PEERS[@]}" \
    --deadline $(( ${BENCH_SECONDS:-65} - 8 )) --out "$OUT/kernels-h200-latest.json" \
    >> "$LOG" 2>&1
  echo "bench exit $?" | tee -a "$LOG"
  grep -E "failed" "$LOG" | head -5
  cat "$OUT/kernels-h200-latest.txt" 2>/dev/null || tail -20 "$LOG"
else
  echo "usage: bash bench/gpu/kernels_v2.sh explore|final"; exit 2
fi
