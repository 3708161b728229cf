#!/usr/bin/env bash
# The thread rig of the host-staged collectives in one device call (at most about 180 s):
#
#   there:  OUT=/some/dir bash bench/gpu/collectives_threads.sh
#
# Ranks are threads of one process on GPU 0 (bench/gpu/collectives_threads.py says what that
# measures and how). Phases in priority order until COLL_THREADS_BUDGET_S (default 110) runs out:
# `decode` (the auto paths at the decode sizes, INT8 requested there, the logits gathers; 2, 4, 8
# ranks), then `small` (every small-message path at 4-256 KiB, and a barrier pair, a fence and a
# launch alone). Then the multi-process smoke (bench/gpu/collectives_smoke.py, one process per
# rank, time-sliced here; COLL_THREADS_SMOKE_S, default 25; 0 skips it). Writes
# $OUT/collectives-h200-threads.json and .md, smoke.log and log.txt; prints the compact table, the
# decode step's predicted collectives last. Knobs: COLL_THREADS_WORLDS ("2 4 8"),
# COLL_THREADS_PHASES ("decode small"; add "sweep" for 4 KiB-256 MiB, not within 180 s),
# COLL_THREADS_MAX_MB (256). Needs no package index: torch and Triton from the machine, pydantic
# from vLLM's staged site-packages (/tmp/vsite) or carried wheels (.whl/).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/collectives-threads}
mkdir -p "$OUT"
BUDGET=${COLL_THREADS_BUDGET_S:-110}
SMOKE_S=${COLL_THREADS_SMOKE_S:-25}
# run "$@" in its own process group and kill the whole group (spawned ranks included) after $1 s
limit() {
  local t=$1; shift
  setsid "$@" & local pid=$!
  ( sleep "$t"; kill -TERM -- "-$pid" 2>/dev/null; sleep 3; kill -KILL -- "-$pid" 2>/dev/null ) &
  local watcher=$!
  wait "$pid"; local rc=$?
  kill "$watcher" 2>/dev/null
  return $rc
}
{
  echo "=== set-up ($(date +%T))"
  for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
  wheels=$(ls .whl/*.whl 2>/dev/null | grep -E '/(pydantic|pydantic_core|annotated_types|typing_inspection)-')
  if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $wheels || echo "installing the carried wheels failed"
  fi
  export PYTHONPATH=/tmp/vsite:/tmp/site:$ROOT PYTHONUNBUFFERED=1 GLMCTL_CACHE=/tmp/glmctl-cache
  python3 -c "import pydantic" 2>/dev/null || echo "no pydantic: stage vLLM under /tmp/vsite or carry .whl"
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
  if [ "$(df --output=avail -k /dev/shm | tail -1)" -lt 2000000 ]; then
    mount -o remount,size=16G /dev/shm 2>/dev/null || echo "cannot enlarge /dev/shm"
  fi
  df -h /dev/shm | tail -1
  echo "=== thread rig ($(date +%T), budget ${BUDGET}s)"
  # shellcheck disable=SC2086
  timeout -k 5 $((BUDGET + 20)) python3 bench/gpu/collectives_threads.py --out "$OUT" \
    --budget-s "$BUDGET" --worlds ${COLL_THREADS_WORLDS:-2 4 8} \
    --phases ${COLL_THREADS_PHASES:-decode small} --max-mb "${COLL_THREADS_MAX_MB:-256}"
  echo "thread rig rc=$? ($(date +%T))"
  if [ "$SMOKE_S" -gt 0 ]; then  # the production shape: one process per rank (time-sliced here)
    echo "=== multi-process smoke, 2 and 4 processes ($(date +%T), limit ${SMOKE_S}s)"
    limit "$SMOKE_S" python3 bench/gpu/collectives_smoke.py > "$OUT/smoke.log" 2>&1
    echo "smoke rc=$? (0: every exact result exact)"; grep -E "^world" "$OUT/smoke.log" | cut -c1-400
  fi
  ls /dev/shm | grep glmctl-coll && echo "LEFTOVER SEGMENTS" || echo "no leftover segments"
  echo
  if [ -f "$OUT/collectives-h200-threads.json" ]; then
    timeout 10 python3 bench/gpu/collectives_threads.py --from-json "$OUT/collectives-h200-threads.json" --out "$OUT"
  else
    echo "no results written"
  fi
} 2>&1 | tee "$OUT/log.txt"
