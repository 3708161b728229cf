#!/usr/bin/env bash
# The gpu lane on a CUDA machine with no package index (the H200 test machine).
#
#   here:   ../shared/tools/gpu-wheels.sh && make gpu-bundle      # .whl/: deps + glmctl's own wheel
#   there:  bash bench/gpu/lane.sh [pytest args...]               # run with carry: [".whl"]
#
# Installs the carried wheels into /tmp/site (never touching the machine's torch/triton), then
# runs `pytest -m gpu tests/gpu` and writes everything under $OUT (or ./out/gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing the carried wheels failed" >&2; exit 3; }
export PYTHONPATH=$PWD/.whl/ext:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 - <<'PY'
import glmctl, glmctl.kernels, torch, triton
print(f"glmctl {glmctl.__version__} from {glmctl.__file__}; torch {torch.__version__}; triton {triton.__version__}; "
      f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
python3 -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider --junitxml="$OUT/gpu-lane.xml" "$@" 2>&1 | tee "$OUT/gpu-lane.log"
exit "${PIPESTATUS[0]}"
