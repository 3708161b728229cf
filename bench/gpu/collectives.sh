#!/usr/bin/env bash
# The collectives' gpu lane and benchmark in one go (one device call). Run from the repository root
# on a CUDA machine:  OUT=/some/dir bash bench/gpu/collectives.sh
# Stages run under their own time limits and the script carries on after a failure, so one call
# always brings back every log; the short table comes last.
set -u
OUT=${OUT:-out/gpu-collectives}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 GLMCTL_CACHE="$OUT/cache" GLMCTL_HARNESS_TRACEBACK_S=${GLMCTL_HARNESS_TRACEBACK_S:-100}
PY=${PY:-python3}
SMOKE_S=${COLL_SMOKE_S:-45}
TEST_S=${COLL_TEST_S:-110}
BENCH_S=${COLL_BENCH_S:-75}
BENCH_MB=${COLL_BENCH_MAX_MB:-256}
stage() { echo; echo "=== $1 ($(date +%T))"; }
# run "$@" in its own process group and kill the whole group (spawned ranks included) after $1 s
limit() {
  local t=$1; shift
  setsid "$@" & local pid=$!
  ( sleep "$t"; kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null ) &
  local watcher=$!
  wait "$pid"; local rc=$?
  kill "$watcher" 2>/dev/null
  return $rc
}
{
  stage probe
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  df -h /dev/shm; nproc; ulimit -l
  # a container-sized /dev/shm cannot hold a 256 MiB x 5 segment; this machine is ours alone
  if [ "$(df --output=avail -k /dev/shm | tail -1)" -lt 8000000 ]; then
    mount -o remount,size=16G /dev/shm && df -h /dev/shm
  fi
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  stage smoke
  limit "$SMOKE_S" $PY bench/gpu/collectives_smoke.py; echo "smoke rc=$?"
  stage "gpu tests"
  limit "$TEST_S" $PY -m pytest -q -rA -m gpu -p no:cacheprovider --timeout "$TEST_S" -s \
    tests/gpu/test_collectives_faults.py tests/gpu/test_collectives_graphs.py \
    tests/gpu/test_collectives_correctness.py > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -n 80 "$OUT/gpu-tests.log"
  stage bench
  limit "$BENCH_S" $PY bench/collectives.py --max-mb "$BENCH_MB" --out "$OUT"
  echo "bench rc=$?"
  cp "$OUT"/cache/calibration/collectives-*.json "$OUT/" 2>/dev/null
  rm -rf "$OUT/cache"
  ls /dev/shm | grep glmctl-coll && echo "LEFTOVER SEGMENTS" || echo "no leftover segments"
} 2>&1 | tee "$LOG"
