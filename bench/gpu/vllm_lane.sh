#!/usr/bin/env bash
# The gpu lane's vLLM stage: the plugin's CUDA path inside real vLLM 0.30 on the H200, every
# profile path (tests/gpu/test_vllm_lane_gpu.py) and the DFlash2 cases
# (tests/gpu/test_vllm_dflash2_gpu.py, when present), written to one record, a table printed last.
#
#   here:   ../shared/tools/gpu-wheels.sh          (.whl/: exllamav3, pydantic, the prebuilt ext)
#           ../shared/tools/gpu-vllm-stage.sh      (.stage/: vLLM 0.30 CUDA + deps, in pieces)
#   there:  the stage's piece calls back to back, then in the same warm machine, carrying
#           [".stage/unpack.sh", ".whl"], with timeout_s 600:
#             bash .stage/unpack.sh && bash bench/gpu/vllm_lane.sh
#
# Budget: one device call of at most 600 s = the unpack (9 s measured) + this script, which ends
# within VLLM_LANE_BUDGET (default 570 s) however its processes behave: every process it starts
# is stopped by then and the table printed (20 s spare for the call's own start and copy-back).
# Inside the 570 s: set-up (wheels, entry point) ~15 s; the lane's three stages up to 45 s before
# the end (tests/gpu/vllm_lane_runs.py; limits from the first run's measured phases with a 1.5x
# margin, tests/gpu/vllm_lane_schedule.py: the cold eager engine 297 s at most, each later engine
# 100-220 s, every limit cut to the lane's deadline); the DFlash2 cases beside stage B, from the
# moment the eager engine's first requests are done (the caches are filled) to 25 s before the
# end; then clean-up, logs and the table, ~10 s. Expected with empty caches (estimated from the
# first run's phases, not measured end to end): warm-up gate ~175 s after the start, stage B
# ~150 s beside DFlash2's ~180 s, stage C ~30 s: ~360 s.
#
# glmctl is not installed there: symlinks glmctl/{kernels,quantize,profiles} -> ../X reproduce
# pyproject's package mapping (as bench/gpu/all.sh does), and a dist-info holding only glmctl's
# entry point makes vLLM load the plugin (`vllm.general_plugins`) in every process it starts (the
# same as bench/gpu/rank_sim.sh and bench/gpu/dflash2.sh). /tmp/vsite (vLLM, transformers 5.24, a
# newer pydantic) comes first on PYTHONPATH. Every process shares one Triton, vLLM and Inductor
# cache under /tmp/glmctl-lane-cache (kept between calls in one warm machine).
# Writes under $OUT (default ./out/gpu): vllm-gpu-lane.json (the record; commit it as
# bench/results/vllm-gpu-lane.json), vllm-lane-pytest.log, vllm-lane-dflash2.log,
# vllm-lane-env.txt, vllm-lane-logs.tar.gz (every process's request and log).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
started=$(date +%s)
budget=${VLLM_LANE_BUDGET:-570}
left() { echo $(( budget - ($(date +%s) - started) - $1 )); }  # seconds left, less a reserve
vsite=${VLLM_LANE_SITE:-/tmp/vsite} entry=${VLLM_LANE_ENTRY:-/tmp/glmctl-entry}  # other paths: the CPU test
if [ ! -d "$vsite/vllm" ]; then
  echo "vLLM is not staged in $vsite: run ../shared/tools/gpu-vllm-stage.sh's calls and .stage/unpack.sh first"
  exit 3
fi
# the package mapping by symlinks, only where glmctl is not installed (an installed glmctl has it)
python3 -c "import importlib.util as u; raise SystemExit(u.find_spec('glmctl.kernels') is None)" 2>/dev/null ||
  for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v '/glmctl-') || { echo "installing the carried wheels failed"; exit 3; }
else
  echo "no .whl/ carried: the EXL3 case will say it could not run (../shared/tools/gpu-wheels.sh)"
fi
version=$(PYTHONPATH=$ROOT python3 -c "import glmctl; print(glmctl.__version__)")
rm -rf "$entry"  # one dist-info only: a stale one of another version would load the plugin twice
dist=$entry/glmctl-$version.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: glmctl\nVersion: %s\n' "$version" > "$dist/METADATA"
printf '[vllm.general_plugins]\nglmctl = glmctl.plugin:register\n' > "$dist/entry_points.txt"

export PYTHONPATH=$vsite:$entry:$ROOT/.whl/ext:/tmp/site:$ROOT
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 GLMCTL_PLUGIN=on
export GLMCTL_GPU_LANE_RECORD=$OUT/vllm-gpu-lane.json GLMCTL_GPU_LANE_WORK=${GLMCTL_GPU_LANE_WORK:-/tmp/vllm-lane-work}
export GLMCTL_GPU_LANE_CACHE=${GLMCTL_GPU_LANE_CACHE:-/tmp/glmctl-lane-cache}
export TRITON_CACHE_DIR=$GLMCTL_GPU_LANE_CACHE/triton VLLM_CACHE_ROOT=$GLMCTL_GPU_LANE_CACHE/vllm \
  TORCHINDUCTOR_CACHE_DIR=$GLMCTL_GPU_LANE_CACHE/inductor  # the same folders the lane gives its processes
export GLMCTL_LANE_PGID_DIR=$GLMCTL_GPU_LANE_WORK/pgids
rm -f "$GLMCTL_GPU_LANE_RECORD"
rm -rf "$GLMCTL_GPU_LANE_WORK" && mkdir -p "$GLMCTL_GPU_LANE_WORK" "$GLMCTL_LANE_PGID_DIR"
timeout 90 python3 - > "$OUT/vllm-lane-env.txt" 2>&1 <<'PY' &
import importlib.metadata as md, os, torch, vllm, transformers, glmctl
print(f"vLLM {vllm.__version__} ({vllm.__file__}); transformers {transformers.__version__}; torch {torch.__version__}; "
      f"{torch.cuda.get_device_name(0)}; {os.cpu_count()} CPU cores; glmctl {glmctl.__version__} plugin entry point: "
      f"{[e.value for e in md.entry_points(group='vllm.general_plugins') if e.name == 'glmctl']}")
PY
env_pid=$!

# The DFlash2 cases start once the lane's warm-up has filled the caches (warm.done), or when the
# lane's tests end, whichever comes first; they stop with everything else at the budget.
dflash=tests/gpu/test_vllm_dflash2_gpu.py
dflash_pid=
if [ -f "$dflash" ]; then
  setsid bash -c '
    while [ ! -f "$GLMCTL_GPU_LANE_WORK/warm.done" ] && [ ! -f "$GLMCTL_GPU_LANE_WORK/lane.ended" ]; do sleep 1; done
    secs=$(( $1 - $(date +%s) ))
    [ "$secs" -gt 10 ] || { echo "DFlash2 cases not run: ${secs} s left of the budget"; exit 124; }
    echo "DFlash2 cases from $(date +%T), limit $secs s"
    exec timeout --kill-after=10 "$secs" python3 -m pytest -q -s -rs -p no:cacheprovider -m gpu "$2"' \
    _ $(( started + budget - 25 )) "$dflash" > "$OUT/vllm-lane-dflash2.log" 2>&1 &
  dflash_pid=$!
  echo "$dflash_pid" > "$GLMCTL_LANE_PGID_DIR/$dflash_pid.pgid"
fi

# VLLM_LANE_SHADOW=1: the kernel shadow check (tests/gpu/vllm_shadow_check.py: every CUDA kernel
# of the indexer and sparse MLA against its torch reference inside real vLLM, V2 and V1 model
# runners) beside stage B, from warm.done to 30 s before the end; its tables print last.
shadow_pid=
if [ "${VLLM_LANE_SHADOW:-0}" = 1 ]; then
  setsid bash -c '
    while [ ! -f "$GLMCTL_GPU_LANE_WORK/warm.done" ] && [ ! -f "$GLMCTL_GPU_LANE_WORK/lane.ended" ]; do sleep 1; done
    secs=$(( $1 - $(date +%s) ))
    [ "$secs" -gt 30 ] || { echo "shadow check not run: ${secs} s left"; exit 124; }
    python3 -m glmctl testing tiny-checkpoint "$GLMCTL_GPU_LANE_WORK/shadow-tiny" --quiet --force || exit 1
    timeout --kill-after=5 "$secs" python3 tests/gpu/vllm_shadow_check.py "$GLMCTL_GPU_LANE_WORK/shadow-tiny" \
      "$OUT/shadow-v2.json" > "$GLMCTL_GPU_LANE_WORK/shadow-v2.log" 2>&1 &
    VLLM_USE_V2_MODEL_RUNNER=0 timeout --kill-after=5 "$secs" python3 tests/gpu/vllm_shadow_check.py \
      "$GLMCTL_GPU_LANE_WORK/shadow-tiny" "$OUT/shadow-v1.json" > "$GLMCTL_GPU_LANE_WORK/shadow-v1.log" 2>&1 &
    wait' _ $(( started + budget - 30 )) > "$OUT/vllm-lane-shadow.log" 2>&1 &
  shadow_pid=$!
  echo "$shadow_pid" > "$GLMCTL_LANE_PGID_DIR/$shadow_pid.pgid"
fi

# the lane's own deadline (epoch s), then judging, logs and the table
export GLMCTL_GPU_LANE_DEADLINE=$(( started + budget - 45 ))
echo "lane deadline in $(left 45) s, script budget ${budget} s ($(date +%T))"
timeout --kill-after=10 "$(left 25)" python3 -m pytest -q -s -rs -p no:cacheprovider -m gpu \
  --durations=5 tests/gpu/test_vllm_lane_gpu.py > "$OUT/vllm-lane-pytest.log" 2>&1
rc=$?
touch "$GLMCTL_GPU_LANE_WORK/lane.ended"
why="not run: no test recorded it (see vllm-lane-pytest.log)"
[ $rc -eq 124 ] || [ $rc -eq 137 ] && why="not run: the lane's tests hit their limit (${budget} s script budget)"
dwhy="not run: no DFlash2 test recorded it (see vllm-lane-dflash2.log)"
if [ -n "$dflash_pid" ]; then
  wait "$dflash_pid"; drc=$?
  [ $drc -eq 124 ] || [ $drc -eq 137 ] && dwhy="not run: the DFlash2 cases hit the script's ${budget} s budget"
  [ $drc -eq 0 ] || [ $rc -ne 0 ] || rc=$drc
fi
wait "$env_pid" 2>/dev/null
[ -n "$shadow_pid" ] && wait "$shadow_pid"
python3 tests/gpu/vllm_lane_schedule.py stop "$GLMCTL_LANE_PGID_DIR"  # what a killed pytest left running
tar -C "$GLMCTL_GPU_LANE_WORK" -czf "$OUT/vllm-lane-logs.tar.gz" \
  $(cd "$GLMCTL_GPU_LANE_WORK" && ls *.log *.json warm.done 2>/dev/null) 2>/dev/null
grep -E "^stage [ABC]|^(FAILED|ERROR) | (passed|failed|skipped|error)" "$OUT/vllm-lane-pytest.log" | tail -n 12
grep -E " (passed|failed|skipped|error)|^DFlash2" "$OUT/vllm-lane-dflash2.log" 2>/dev/null | tail -n 3
echo "pytest exit $rc after $(( $(date +%s) - started )) s (script budget ${budget} s)"
[ -n "$dflash_pid" ] && python3 tests/gpu/lane_record.py "$GLMCTL_GPU_LANE_RECORD" "$dwhy" --no-table \
  --cases dflash2_greedy dflash2_greedy_graphed dflash2_capacity
for runner in v2 v1; do  # the shadow check's tables (VLLM_LANE_SHADOW=1)
  [ -f "$GLMCTL_GPU_LANE_WORK/shadow-$runner.log" ] || continue
  grep -A40 "^shadow check" "$GLMCTL_GPU_LANE_WORK/shadow-$runner.log" || tail -n 4 "$GLMCTL_GPU_LANE_WORK/shadow-$runner.log"
done
python3 tests/gpu/lane_record.py "$GLMCTL_GPU_LANE_RECORD" "$why"
rm -f "$GLMCTL_GPU_LANE_RECORD.lock"
exit $rc
