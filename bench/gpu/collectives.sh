#!/usr/bin/env bash
# The collectives' gpu lane and benchmark in one go (one device call). Run from the repository root
# on a CUDA machine:  OUT=/some/dir bash bench/gpu/collectives.sh
# Stages run under their own time limits and the script carries on after a failure, so one call
# always brings back every log; the short tables come last. Plain mode (COLL_MPS=0) stays under
# ~200 s: smoke (COLL_SMOKE=0 skips it), the gpu tests (collectives + the vLLM call path of
# glmctl.plugin.distributed.tp_communicator), the benchmark.
set -u
OUT=${OUT:-out/gpu-collectives}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 GLMCTL_CACHE="$OUT/cache" GLMCTL_HARNESS_TRACEBACK_S=${GLMCTL_HARNESS_TRACEBACK_S:-100}
PY=${PY:-python3}
SMOKE_S=${COLL_SMOKE_S:-40}
TEST_S=${COLL_TEST_S:-140}
BENCH_S=${COLL_BENCH_S:-100}
MPS_TEST_S=${COLL_MPS_TEST_S:-90}
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
  MPS=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null)
  echo "MPS control: ${MPS:-none}"
  # COLL_PLAIN=0 skips the runs without MPS, unless there is no MPS to run instead
  if [ "${COLL_PLAIN:-1}" = 1 ] || [ -z "$MPS" ]; then
    if [ "${COLL_SMOKE:-1}" = 1 ]; then
      stage smoke
      limit "$SMOKE_S" $PY bench/gpu/collectives_smoke.py; echo "smoke rc=$?"
    fi
    if [ "${COLL_TESTS:-1}" = 1 ]; then
      stage "gpu tests"
      limit "$TEST_S" $PY -m pytest -q -rA -m gpu -p no:cacheprovider --timeout "$TEST_S" -s \
        tests/gpu/test_collectives_faults.py tests/gpu/test_collectives_graphs.py \
        tests/gpu/test_collectives_correctness.py tests/gpu/test_commwire_vllm_path.py \
        > "$OUT/gpu-tests.log" 2>&1
      echo "gpu tests rc=$?"; tail -n 40 "$OUT/gpu-tests.log"
    fi
    stage bench
    limit "$BENCH_S" $PY bench/collectives.py --max-mb "$BENCH_MB" --out "$OUT"
    echo "bench rc=$?"
  fi
  # The same with CUDA MPS: the ranks' processes then run concurrently on the GPU instead of
  # time-slicing it, which is closer to one process per GPU (and a harder test of the ordering).
  if [ "${COLL_MPS:-1}" = 1 ] && [ -n "$MPS" ]; then
    stage "MPS"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/coll-mps CUDA_MPS_LOG_DIRECTORY=/tmp/coll-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if "$MPS" -d; then
      sleep 1
      limit "$SMOKE_S" $PY bench/gpu/collectives_smoke.py; rc=$?; echo "MPS smoke rc=$rc"
      if [ $rc = 0 ]; then
        limit "$BENCH_S" $PY bench/collectives.py --max-mb "$BENCH_MB" --out "$OUT" \
          --name collectives-mps --label "measured on 1x H200, N processes sharing one GPU via CUDA MPS"
        echo "MPS bench rc=$?"
        limit "$MPS_TEST_S" $PY -m pytest -q -rA -m gpu -p no:cacheprovider --timeout "$MPS_TEST_S" -s \
          tests/gpu/test_collectives_graphs.py tests/gpu/test_collectives_correctness.py \
          > "$OUT/gpu-tests-mps.log" 2>&1
        echo "MPS gpu tests rc=$?"; tail -n 25 "$OUT/gpu-tests-mps.log"
      fi
      echo quit | "$MPS"; sleep 1
      tail -n 20 "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null
    else
      echo "MPS did not start"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    echo "no MPS here ($MPS)"
  fi
  cp "$OUT"/cache/calibration/collectives-*.json "$OUT/" 2>/dev/null
  rm -rf "$OUT/cache"
  ls /dev/shm | grep glmctl-coll && echo "LEFTOVER SEGMENTS" || echo "no leftover segments"
} 2>&1 | tee "$LOG"
