#!/usr/bin/env bash
# The per-rank simulation of the reference node on the H200 (bench/rank_sim.py), with the kernels
# an L40 (sm_89) runs. vLLM 0.30 must be staged in /tmp/vsite (../shared/tools/gpu-vllm-stage.sh,
# then `bash .stage/unpack.sh` in the same warm machine); .whl/ (exllamav3 + its prebuilt
# extension, ../shared/tools/gpu-wheels.sh) for the EXL3 runs.
#
#   bash bench/gpu/rank_sim.sh RUN [RUN ...]      runs: exl3-mtp3 exl3-nospec fp8-mtp3 stock
#   env: RANK_SIM_SECONDS (per run, default 540), RANK_SIM_COMPILE=1 (torch.compile + piecewise
#        graphs; default 0: no compile, FULL decode graphs)
#
# What an sm_89 node gets where vLLM chooses by compute capability, and how this forces it here
# (read from vLLM 0.30's source; bench/results/rank-sim-h200.md lists them with references):
#   KDA prefill        FlashKDA on 9.x/10.x/12.x, Triton below  -> --kda-prefill-backend triton
#   block-FP8 linears  DeepGEMM / CUTLASS block-scaled on sm_90+, Marlin FP8 (W8A16) on sm_89
#                      -> VLLM_DISABLED_KERNELS drops the four kernels ahead of Marlin
#   FP8 fused MoE      Triton fused_moe on both (Hopper moves Triton to the front for block FP8
#                      with TP; on sm_89 the backends ahead of it do not apply): nothing to force
#   sparse MLA, indexer, mHC: glmctl's Triton kernels (GLMCTL_PLUGIN=on; no tilelang here)
#   sampler            FlashInfer's is not staged: VLLM_USE_FLASHINFER_SAMPLER=0 (torch)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/out/rank-sim}
mkdir -p "$OUT"
for p in kernels quantize profiles; do [ -e "glmctl/$p" ] || ln -s "../$p" "glmctl/$p"; done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v '/glmctl-') || echo "installing .whl failed (EXL3 runs will fail)"
fi
# glmctl is not installed there: a dist-info holding only its entry point makes vLLM load the
# plugin (`vllm.general_plugins`) in every process it starts.
version=$(PYTHONPATH=$ROOT python3 -c "import glmctl; print(glmctl.__version__)")
dist=/tmp/glmctl-entry/glmctl-$version.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: glmctl\nVersion: %s\n' "$version" > "$dist/METADATA"
printf '[vllm.general_plugins]\nglmctl = glmctl.plugin:register\n' > "$dist/entry_points.txt"
export PYTHONPATH=/tmp/vsite:/tmp/glmctl-entry:$ROOT/.whl/ext:/tmp/site:$ROOT PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 EXL3_EXPANDABLE_SEGMENTS=0
export VLLM_DISABLED_KERNELS=FlashInferFp8DeepGEMMDynamicBlockScaledKernel,DeepGemmFp8BlockScaledMMKernel,CutlassFp8BlockScaledMMKernel,B12xFp8BlockScaledMMKernel
export VLLM_USE_DEEP_GEMM=0 VLLM_MOE_USE_DEEP_GEMM=0
secs=${RANK_SIM_SECONDS:-540}
compile=$([ "${RANK_SIM_COMPILE:-0}" = 1 ] || echo --no-compile)
rank_dir() {  # experts -> a TP8 rank checkpoint directory (config + tokenizer, no weights)
  local d=/tmp/rank-$1
  [ -f "$d/config.json" ] || python3 -m glmctl testing rank-config "$d" --tp 8 --experts "$1" >/dev/null \
    || { echo "rank-config --experts $1 failed"; return 1; }
  echo "$d"
}
run() {  # name experts mtp plugin cells profile_cell extra...
  local name=$1 experts=$2 mtp=$3 plugin=$4 cells=$5 prof=$6; shift 6
  local dir; dir=$(rank_dir "$experts") || return 1
  echo "=== $name ($(date +%T), limit ${secs}s)"
  timeout --kill-after=20 $((secs + 30)) python3 bench/rank_sim.py --model "$dir" --name "$name" \
    --mtp "$mtp" --plugin "$plugin" --cells "$cells" ${prof:+--profile-cell "$prof"} $compile \
    --env "VLLM_ENGINE_ITERATION_TIMEOUT_S=600" --out "$OUT/rank-sim-$name.json" --deadline "$secs" "$@"
  echo "=== $name rc=$?"
  tail -c 20000 "$OUT/vllm-$name.log" > "$OUT/vllm-$name.tail.log" 2>/dev/null; rm -f "$OUT/vllm-$name.log"
}
for r in "${@:-exl3-mtp3}"; do
  case $r in
    exl3-mtp3)   run exl3-mtp3 exl3 3 on 1x64k,8x22k,8x64k,8x227k 8x227k --prefill-256k ;;
    exl3-nospec) run exl3-nospec exl3 0 on 1x64k,8x22k,8x64k "" ;;
    fp8-mtp3)    run fp8-mtp3 fp8 3 on 1x64k,8x22k "" ;;
    stock)       run stock fp8 0 off 1x8k "" --max-model-len 16384 ;;
    *) echo "unknown run $r" ;;
  esac
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<13} {'KV tokens':>10} {'weights GiB':>11} {'cell':>7} {'tok/s':>8} {'step ms':>8} {'TTFT max s':>10}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("rank-sim-*.json")):
    r = json.loads(f.read_text()); s = r.get("server", {})
    if r.get("error"):
        print(f"{r['name']:<13} ERROR {r['error'][:150]}")
    for c in r.get("cells", []):
        ttft = max([x for x in c.get("ttft_s", []) if x] or [0])
        print(f"{r['name']:<13} {s.get('kv_tokens', '-'):>10} {s.get('weights_gib', '-'):>11} {c.get('cell'):>7} "
              f"{c.get('decode_tok_s', '-'):>8} {c.get('step_ms', '-'):>8} {ttft:>10}")
    if "prefill_ttft_256k_s" in r:
        print(f"{r['name']:<13} 256k prompt TTFT {r['prefill_ttft_256k_s']} s")
PY
