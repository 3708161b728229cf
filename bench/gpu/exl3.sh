#!/usr/bin/env bash
# EXL3 experts on a CUDA machine: the gpu-lane tests (tests/gpu/test_exl3.py), then bench/exl3.py.
#
# With glmctl[gpu] installed:   bash bench/gpu/exl3.sh
# On the index-less H200 (carry .whl/ with exllamav3 1.6.5, pydantic, marisa-trie, the prebuilt
# .whl/ext/exllamav3_ext.so and a glmctl wheel of this tree):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=$PWD/.whl/ext:/tmp/site     # the prebuilt extension skips exllamav3's JIT build
#   bash bench/gpu/exl3.sh
# Writes everything under $OUT (default ./out/gpu) and prints the bench table last.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export EXL3_EXPANDABLE_SEGMENTS=0          # as inside vLLM: exllamav3 leaves torch's allocator alone
export GLMCTL_EXL3_RECORD="$OUT/exl3-gpu-tests.json"
# Run from outside the tree: glmctl must be the installed one (kernels/ and quantize/ map into it).
cd /tmp
python3 - <<'PY' 2>&1 | tee "$OUT/exl3-env.txt"
import importlib.metadata as md, torch, glmctl, glmctl.quantize.exl3_format
import exllamav3_ext
print(f"glmctl {glmctl.__version__} ({glmctl.__file__}); torch {torch.__version__}; "
      f"exllamav3 {md.version('exllamav3')}; ext {exllamav3_ext.__file__}; "
      f"{torch.cuda.get_device_name(0)} sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}, "
      f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
      f"exl3_moe groups {exllamav3_ext.exl3_moe_max_concurrency(0)}")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader >> "$OUT/exl3-env.txt"

timeout "${EXL3_BENCH_TIMEOUT:-60}" python3 "$ROOT/bench/exl3.py" --tokens 1,8,32,48 --out "$OUT" > "$OUT/exl3-bench.log" 2>&1
bench_rc=$?
timeout "${EXL3_TEST_TIMEOUT:-140}" python3 -m pytest -p no:cacheprovider --import-mode=importlib \
    --rootdir "$ROOT" -c "$ROOT/pyproject.toml" -m gpu -q -rs --durations=8 \
    --junitxml="$OUT/exl3-gpu-tests.xml" "$ROOT/tests/gpu/test_exl3.py" > "$OUT/exl3-gpu-tests.log" 2>&1
test_rc=$?
tail -n 25 "$OUT/exl3-gpu-tests.log"
python3 - "$GLMCTL_EXL3_RECORD" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print(f"(no test record: {exc})"); sys.exit(0)
for k, v in (r.get("quantize_real_shape") or {}).get("tensors", {}).items():
    print(f"{k:24s} {v['seconds']:6.2f} s  rel err {v['rel_weight_error']:.4f}  proxy {v['proxy_error']:.5f}")
for k, v in (r.get("moe_vs_reference") or {}).items():
    print(f"{k:44s} vs deq {v['rel_error_vs_dequantised']:.2e}  vs bf16 {v['rel_error_vs_original_weights']:.3f}")
print("graph replay:", r.get("cuda_graph_replay_rel_error"), " tp2:", r.get("tp2_slices_vs_whole_rel_error"))
for p in (r.get("mgemm_barrier_sm90") or {}).get("probes", []):
    print("mgemm", p)
PY
echo "tests rc=$test_rc bench rc=$bench_rc"
cat "$OUT/moe-bench.md" 2>/dev/null || tail -n 30 "$OUT/exl3-bench.log"
exit $(( test_rc || bench_rc ))
