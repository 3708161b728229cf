#!/usr/bin/env bash
# The gpu lane's vLLM stage: the plugin's CUDA path inside real vLLM 0.30 on the H200, every
# profile path (tests/gpu/test_vllm_lane_gpu.py, plus tests/gpu/test_vllm_dflash2_gpu.py when
# present), written to one record and printed as a table last.
#
#   here:   ../shared/tools/gpu-wheels.sh          (.whl/: exllamav3, pydantic, the prebuilt ext)
#           ../shared/tools/gpu-vllm-stage.sh      (.stage/: vLLM 0.30 CUDA + deps, in pieces)
#   there:  the stage's piece calls back to back, then in the same warm machine, carrying
#           [".stage/unpack.sh", ".whl"]:
#             bash .stage/unpack.sh && bash bench/gpu/vllm_lane.sh
#
# glmctl is not installed there: symlinks glmctl/{kernels,quantize,profiles} -> ../X reproduce
# pyproject's package mapping (as bench/gpu/all.sh does), and a dist-info holding only glmctl's
# entry point makes vLLM load the plugin (`vllm.general_plugins`) in every process it starts.
# /tmp/vsite (vLLM, transformers 5.24, a newer pydantic) comes first on PYTHONPATH.
# Writes under $OUT (default ./out/gpu): vllm-gpu-lane.json (the record; commit it as
# bench/results/vllm-gpu-lane.json), vllm-lane-pytest.log, vllm-lane-logs.tar.gz (every engine's
# log and request). Needs about 200 s of GPU-machine time; VLLM_LANE_TIMEOUT (s) bounds the tests.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
started=$(date +%s)
if [ ! -d /tmp/vsite/vllm ]; then
  echo "vLLM is not staged in /tmp/vsite: run ../shared/tools/gpu-vllm-stage.sh's calls and .stage/unpack.sh first"
  exit 3
fi
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v '/glmctl-') || { echo "installing the carried wheels failed"; exit 3; }
else
  echo "no .whl/ carried: the EXL3 case will say it could not run (../shared/tools/gpu-wheels.sh)"
fi
version=$(PYTHONPATH=$ROOT python3 -c "import glmctl; print(glmctl.__version__)")
dist=/tmp/glmctl-entry/glmctl-$version.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: glmctl\nVersion: %s\n' "$version" > "$dist/METADATA"
printf '[vllm.general_plugins]\nglmctl = glmctl.plugin:register\n' > "$dist/entry_points.txt"

export PYTHONPATH=/tmp/vsite:/tmp/glmctl-entry:$ROOT/.whl/ext:/tmp/site:$ROOT
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 GLMCTL_PLUGIN=on
export GLMCTL_GPU_LANE_RECORD=$OUT/vllm-gpu-lane.json GLMCTL_GPU_LANE_WORK=/tmp/vllm-lane-work
rm -f "$GLMCTL_GPU_LANE_RECORD"
rm -rf "$GLMCTL_GPU_LANE_WORK" && mkdir -p "$GLMCTL_GPU_LANE_WORK"
python3 - <<'PY' 2>&1 | tee "$OUT/vllm-lane-env.txt"
import importlib.metadata as md, torch, vllm, transformers, glmctl
print(f"vLLM {vllm.__version__} ({vllm.__file__}); transformers {transformers.__version__}; torch {torch.__version__}; "
      f"{torch.cuda.get_device_name(0)}; glmctl {glmctl.__version__} plugin entry point: "
      f"{[e.value for e in md.entry_points(group='vllm.general_plugins') if e.name == 'glmctl']}")
PY
tests=tests/gpu/test_vllm_lane_gpu.py
[ -f tests/gpu/test_vllm_dflash2_gpu.py ] && tests="$tests tests/gpu/test_vllm_dflash2_gpu.py"
timeout --kill-after=15 "${VLLM_LANE_TIMEOUT:-290}" python3 -m pytest -q -s -rs -p no:cacheprovider -m gpu \
  --durations=5 $tests > "$OUT/vllm-lane-pytest.log" 2>&1
rc=$?
why="not run: no test recorded it (see vllm-lane-pytest.log)"
[ $rc -eq 124 ] || [ $rc -eq 137 ] && why="not run: the tests hit the ${VLLM_LANE_TIMEOUT:-290} s limit"
tar -C "$GLMCTL_GPU_LANE_WORK" -czf "$OUT/vllm-lane-logs.tar.gz" \
  $(cd "$GLMCTL_GPU_LANE_WORK" && ls *.log *.json 2>/dev/null) 2>/dev/null
grep -E "^stage [ABC]|^(FAILED|ERROR) | (passed|failed|skipped|error)" "$OUT/vllm-lane-pytest.log" | tail -n 12
echo "pytest exit $rc after $(( $(date +%s) - started )) s (limit ${VLLM_LANE_TIMEOUT:-290} s for the tests)"
python3 tests/gpu/lane_record.py "$GLMCTL_GPU_LANE_RECORD" "$why"
exit $rc
