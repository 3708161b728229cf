#!/usr/bin/env bash
# DFlash2-5 on the tiny GLM-5.3-Flash inside real vLLM 0.30 on the H200 (tests/gpu/test_vllm_dflash2_gpu.py).
#
#   there:  bash bench/gpu/dflash2.sh        # after vLLM is unpacked into /tmp/vsite
#                                            # (../shared/tools/gpu-vllm-stage.sh, then .stage/unpack.sh)
#
# Three cases, about a minute of GPU each (the Triton kernels compile on the first engine if no
# earlier lane run left them in the cache): dflash2_greedy (eager), dflash2_greedy_graphed (FULL
# CUDA graphs to 48 tokens), dflash2_capacity (planner KV tokens == vLLM's, prefix caching on).
# Writes $OUT/dflash2-gpu.json (the cases), dflash2-gpu.log (pytest) and dflash2-gpu-logs.tar.gz
# (each engine subprocess's request, stdout and stderr); prints the table last. ~4 min of GPU at most.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
if [ ! -d /tmp/vsite/vllm ]; then
  echo "vLLM is not staged in /tmp/vsite: run ../shared/tools/gpu-vllm-stage.sh's calls and .stage/unpack.sh first"
  exit 3
fi
# glmctl is not installed there: pyproject's package mapping by symlinks, and a dist-info with only
# glmctl's vLLM entry point so that every vLLM process loads the plugin (as bench/gpu/vllm_lane.sh).
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
version=$(PYTHONPATH=$ROOT python3 -c "import glmctl; print(glmctl.__version__)")
dist=/tmp/glmctl-entry/glmctl-$version.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: glmctl\nVersion: %s\n' "$version" > "$dist/METADATA"
printf '[vllm.general_plugins]\nglmctl = glmctl.plugin:register\n' > "$dist/entry_points.txt"
export PYTHONPATH=/tmp/vsite:/tmp/glmctl-entry:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 GLMCTL_PLUGIN=on VLLM_USE_FLASHINFER_SAMPLER=0
export GLMCTL_GPU_LANE_RECORD=${GLMCTL_GPU_LANE_RECORD:-$OUT/dflash2-gpu.json}
export GLMCTL_GPU_LANE_WORK=${GLMCTL_GPU_LANE_WORK:-/tmp/dflash2-gpu-work}
mkdir -p "$GLMCTL_GPU_LANE_WORK"
timeout 420 python3 -m pytest -m gpu tests/gpu/test_vllm_dflash2_gpu.py -q -rs -p no:cacheprovider \
  -o timeout=400 "$@" > "$OUT/dflash2-gpu.log" 2>&1
status=$?
tar -C "$GLMCTL_GPU_LANE_WORK" -czf "$OUT/dflash2-gpu-logs.tar.gz" $(cd "$GLMCTL_GPU_LANE_WORK" && ls dflash2-* 2>/dev/null) 2>/dev/null
tail -n 30 "$OUT/dflash2-gpu.log"
python3 - "$GLMCTL_GPU_LANE_RECORD" <<'PY'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    print(f"no record: {exc}")
    raise SystemExit
cases = doc["cases"] if isinstance(doc, dict) else doc
print(f"{'case':<24} {'result':<6} detail")
for c in cases:
    if str(c.get("name", "")).startswith("dflash2"):
        detail = " ".join(str(c.get("detail", "")).split())
        print(f"{c['name']:<24} {'PASS' if c.get('passed') else 'FAIL':<6} {detail[:150]}")
PY
exit $status
