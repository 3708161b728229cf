#!/usr/bin/env bash
# Every gpu-lane stage in one device call, for the index-less H200 test machine.
#
#   here:   ../shared/tools/gpu-wheels.sh          (.whl/: exllamav3, pydantic, the prebuilt ext)
#   there:  OUT=... bash bench/gpu/all.sh [stage ...]     stages: collectives exl3 doctor plugin kernels repro
#
# glmctl is not installed there: symlinks glmctl/{kernels,quantize,profiles} -> ../X (in the
# throw-away copy of the tree) reproduce pyproject's package-dir mapping. Each stage runs under its
# own time limit and the script carries on after a failure, so one call brings back every log;
# a summary of the stages' exit codes comes last.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v '/glmctl-') || { echo "installing the carried wheels failed"; exit 3; }
export PYTHONPATH=$ROOT/.whl/ext:/tmp/site:$ROOT PYTHONUNBUFFERED=1
stages=${*:-collectives exl3 doctor plugin}
summary=()
run_stage() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo; echo "=== $name (limit ${secs}s, $(date +%T))"
  timeout --kill-after=10 "$secs" "$@"; local rc=$?
  summary+=("$name rc=$rc")
}
for s in $stages; do
  case $s in
    collectives) run_stage collectives 280 env COLL_MPS=0 COLL_SMOKE=0 COLL_TEST_S=150 COLL_BENCH_S=110 \
                   OUT="$OUT/collectives" bash bench/gpu/collectives.sh ;;
    exl3)        run_stage exl3 150 env OUT="$OUT/exl3" bash bench/gpu/exl3.sh ;;
    doctor)      run_stage doctor 120 env GLMCTL_DOCTOR_RECORD="$OUT/doctor-h200.json" \
                   GLMCTL_DOCTOR_WHERE="1x H200 (device tool, Firecracker VM), gpu lane" \
                   python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu/test_doctor_gpu.py ;;
    plugin)      files=$(ls tests/gpu/test_plugin_*.py 2>/dev/null)
                 if [ -n "$files" ]; then
                   run_stage plugin 240 python3 -m pytest -q -rs -p no:cacheprovider -m gpu $files
                 else summary+=("plugin: no tests/gpu/test_plugin_*.py"); fi ;;
    repro)       run_stage repro 150 python3 bench/gpu/repro_decode_240k.py ;;  # syncs after each step itself
    kernels)     run_stage kernels 320 env TEST_SECONDS=190 BENCH_SECONDS=110 OUT="$OUT/kernels" \
                   bash bench/gpu/kernels.sh ;;
    *) echo "unknown stage $s"; summary+=("$s unknown") ;;
  esac
done
echo; echo "=== summary"; printf '%s\n' "${summary[@]}"
