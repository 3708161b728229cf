#!/usr/bin/env bash
# The thread rig of the host-staged collectives in one device call (about 120 s):
#
#   here:   ../shared/tools/gpu-wheels.sh        (.whl/: pydantic for glmctl.collectives)
#   there:  OUT=/some/dir bash bench/gpu/collectives_threads.sh
#
# Ranks are threads of one process on GPU 0 (bench/gpu/collectives_threads.py says what that
# measures and how); phases run in priority order (small-message paths, then the sweep)
# until COLL_THREADS_BUDGET_S (default 65) runs out, then the direct path's flag-line variant
# in a second process (COLL_THREADS_FLAG_BUDGET_S, default 12), then the multi-process smoke
# (bench/gpu/collectives_smoke.py, COLL_THREADS_SMOKE_S, default 25; 0 skips it). Writes
# $OUT/collectives-h200-threads.json and .md, smoke.log and log.txt; the compact table comes last. Knobs: COLL_THREADS_WORLDS ("2 4 8"),
# COLL_THREADS_PHASES ("small sweep"), COLL_THREADS_MAX_MB (256).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/collectives-threads}
mkdir -p "$OUT"
BUDGET=${COLL_THREADS_BUDGET_S:-65}   # the main run; the flag-line variant runs after it
FLAG_BUDGET=${COLL_THREADS_FLAG_BUDGET_S:-12}
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
  export PYTHONPATH=/tmp/site:$ROOT PYTHONUNBUFFERED=1 GLMCTL_CACHE=/tmp/glmctl-cache
  python3 -c "import pydantic" 2>/dev/null || echo "no pydantic: carry .whl (../shared/tools/gpu-wheels.sh)"
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
  # the 8-rank segment of 256 MiB messages needs ~2.5 GB of /dev/shm; this machine is ours alone
  if [ "$(df --output=avail -k /dev/shm | tail -1)" -lt 8000000 ]; then
    mount -o remount,size=16G /dev/shm 2>/dev/null || echo "cannot enlarge /dev/shm: lower COLL_THREADS_MAX_MB"
  fi
  df -h /dev/shm | tail -1
  echo "=== thread rig ($(date +%T), budget ${BUDGET}s)"
  # shellcheck disable=SC2086
  timeout -k 5 $((BUDGET + 20)) python3 bench/gpu/collectives_threads.py --out "$OUT" \
    --budget-s "$BUDGET" --worlds ${COLL_THREADS_WORLDS:-2 4 8} --skip direct-flag \
    --phases ${COLL_THREADS_PHASES:-small sweep} --max-mb "${COLL_THREADS_MAX_MB:-256}"
  echo "thread rig rc=$? ($(date +%T))"
  # the flag-line variant (a system-scope atomic on host memory) in a process of its own: if this
  # GPU or VM faults on it, the context it poisons is not the main run's
  echo "=== thread rig, direct path with flag lines ($(date +%T), budget ${FLAG_BUDGET}s)"
  # shellcheck disable=SC2086
  timeout -k 5 $((FLAG_BUDGET + 15)) python3 bench/gpu/collectives_threads.py --out "$OUT" \
    --budget-s "$FLAG_BUDGET" --worlds ${COLL_THREADS_WORLDS:-2 4 8} --only direct-flag \
    --phases small --append
  echo "flag-line run rc=$? ($(date +%T))"
  if [ "$SMOKE_S" -gt 0 ]; then  # the production shape: one process per rank (time-sliced here)
    echo "=== multi-process smoke, 2 and 4 processes ($(date +%T), limit ${SMOKE_S}s)"
    limit "$SMOKE_S" python3 bench/gpu/collectives_smoke.py > "$OUT/smoke.log" 2>&1
    echo "smoke rc=$? (0: every exact result exact)"; grep -E "^world" "$OUT/smoke.log" | cut -c1-400
  fi
  ls /dev/shm | grep glmctl-coll && echo "LEFTOVER SEGMENTS" || echo "no leftover segments"
  echo
  if [ -f "$OUT/collectives-h200-threads.json" ]; then
    python3 bench/gpu/collectives_threads.py --from-json "$OUT/collectives-h200-threads.json" --out "$OUT"
  else
    echo "no results written"
  fi
} 2>&1 | tee "$OUT/log.txt"
