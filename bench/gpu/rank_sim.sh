#!/usr/bin/env bash
# The per-rank simulation of the reference node on the H200 (bench/rank_sim.py), with the kernels
# an L40 (sm_89) runs. vLLM 0.30 must be staged in /tmp/vsite (../shared/tools/gpu-vllm-stage.sh's
# piece calls, then `bash .stage/unpack.sh` in the same warm machine); .whl/ (exllamav3 + its
# prebuilt extension, ../shared/tools/gpu-wheels.sh) for the EXL3 runs.
#
#   bash bench/gpu/rank_sim.sh RUN [RUN ...]        in the foreground (one device call: 10 min at most)
#   bash bench/gpu/rank_sim.sh --detach RUN ...     in a session of its own, which outlives the call
#   bash bench/gpu/rank_sim.sh --collect [SECONDS]  wait up to SECONDS (default 0) for the detached
#                                                   job, copy what it wrote into $OUT, print the table
#   runs: main (= exl3-mtp3), main-prefill (main, then the profiled prefill cell), decode (exl3-mtp3's
#         decode cells without 8x227k and 256k), prefill (warm + the prefill cell alone), exl3-mtp3,
#         exl3-fullgraph, exl3-nospec, fp8-mtp3, stock
#         (exl3-fullgraph: VLLM_USE_BREAKABLE_CUDAGRAPH=0, so KDA, MLA attention and the indexer are
#         captured too instead of running eagerly between graph segments, vLLM's default for this
#         model: the A/B that says how much of a step is host time)
#   env:  RANK_SIM_SECONDS (per run; default 520 in the foreground, 1050 detached),
#         RANK_SIM_DIR (the detached job's folder, default /root/rank-sim), RANK_SIM_SAVE_TRITON=1
#         (put Triton's cache, autotuning included, into $OUT as triton-cache.tar.xz when under
#         15 MiB; carry it next session as .rank-sim-cache/triton-cache.tar.xz to skip the JIT),
#         RANK_SIM_COMPILE=1 (torch.compile + piecewise graphs; default: no compile, FULL decode graphs),
#         RANK_SIM_SERVER_ENV="K=V K=V" (switches for every server, e.g. GLMCTL_FP8_LINEAR=glmctl
#         GLMCTL_ROUTER_GEMM=glmctl: recorded in each record's settings.env)
#
# The run plan for ~15 minutes of device time (staging ~3 min included), one server boot:
#   call 1..3   the staging pieces (../shared/tools/gpu-vllm-stage.sh prints them)
#   call 4      carry [".stage/unpack.sh", ".whl"]:
#               bash .stage/unpack.sh && bash bench/gpu/rank_sim.sh --detach main && bash bench/gpu/rank_sim.sh --collect 560
#   call 5      right after (the machine goes back ~30 s after a call): bash bench/gpu/rank_sim.sh --collect 560
#   main = exl3-mtp3 with cells warm, 8x22k, 1x64k, 8x64k, 8x227k (each profiled inside its window), 256k:
#   boot ~250 s, warm-up ~40 s, 8x22k ~50 s, 8x227k ~350 s (eight 227k prefills queue one at a time,
#   ~0.35 s per 2,048-token chunk on the H200), 256k ~45 s; 8x64k and 1x64k only if time is left.
#   The table (last) and every file come back with call 5; call 4's come back with what was done by then.
#   Next in line, ~6 min each with its own boot: exl3-fullgraph (the host-time A/B), exl3-nospec, fp8-mtp3.
#   main-prefill = main + cell `prefill` last (bench/rank_sim_prefill.py): a bf16 matmul probe before
#   the boot (~6 s), then one 252k prompt with the profiler on for 4 chunks at ~8k, ~64k and ~240k
#   (~31 s of prefill + 3 trace exports + parsing: ~60 s); the record's `prefill` cell holds each
#   chunk's kernels by kind. Give it RANK_SIM_SECONDS=1120 detached; with less left than 90 s it is
#   skipped, every other cell as in main. bench/rank_prefill.py turns the record into
#   bench/results/rank-prefill-h200.json (on CPU).
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
JOB=${RANK_SIM_DIR:-/root/rank-sim}

table() {  # the short table, last: one line per cell of every record under $1
  python3 - "$1" <<'PY'
import json, pathlib, sys
print(f"{'run':<12} {'KV tokens':>10} {'wts GiB':>7} {'boot s':>6} {'cell':>6} {'tok/s':>7} {'step ms':>8} "
      f"{'TTFT max s':>10} note")
for f in sorted(pathlib.Path(sys.argv[1]).glob("rank-sim-*.json")):
    r = json.loads(f.read_text()); s = r.get("server", {})
    if r.get("error"):
        print(f"{r['name']:<12} ERROR {r['error'][:150]}")
    for c in r.get("cells", []):
        ttft = max([x for x in (c.get("ttft_s") if isinstance(c.get("ttft_s"), list) else [c.get("ttft_s")]) if x] or [0])
        note = c.get("no_window") or c.get("skipped") or c.get("error") or (c.get("breakdown") or {}).get("error") or ""
        if c.get("summary"):  # the prefill cell: per window, context of its chunks, GPU span / wall ms per chunk
            note = "chunks " + ", ".join(f"{w.get('context')}: {w.get('span_ms')}/{w.get('wall_ms')} ms"
                                         for w in c["summary"]) + f"; admission {c.get('admission_s')} s"
            ttft = c.get("profiled_ttft_s") or 0
        if (c.get("breakdown") or {}).get("us_per_iteration"):
            note = "profiled: " + ", ".join(f"{k} {v:.0f}" for k, v in list(c["breakdown"]["us_per_iteration"].items())[:4])
        print(f"{r['name']:<12} {s.get('kv_tokens', '-'):>10} {s.get('weights_gib', '-'):>7} {s.get('startup_s', '-'):>6} "
              f"{c.get('cell'):>6} {c.get('decode_tok_s', '-'):>7} {c.get('step_ms', '-'):>8} {ttft:>10} "
              f"{note[:150] if c.get('summary') else note[:70]}")
    if r.get("bf16_matmul"):
        print(f"{r['name']:<12} bf16 matmul before the boot: {r['bf16_matmul']}")
PY
}

if [ "${1:-}" = "--collect" ]; then
  wait_s=${2:-0}; end=$(( $(date +%s) + wait_s ))
  while [ -f "$JOB/running" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  [ -f "$JOB/running" ] && echo "the detached job is still running (log: $JOB/job.log); collecting what it wrote so far"
  [ -f "$JOB/running" ] || echo "the detached job has ended"
  tail -n 30 "$JOB/job.log" 2>/dev/null
  cp "$JOB"/out/*.json "$JOB"/out/*.head.log "$JOB"/out/*.tail.log "$JOB"/out/*.tar.xz "$OUT"/ 2>/dev/null
  for f in "$JOB"/out/vllm-*.log; do  # a server still running: its log so far, without the /metrics polls
    case $f in *.head.log|*.tail.log) continue ;; esac
    [ -f "$f" ] && grep -v '"GET /metrics' "$f" | head -c 2000000 > "$OUT/$(basename "$f" .log).sofar.log"
  done
  ls -la "$OUT"
  table "$OUT"
  exit 0
fi
if [ "${1:-}" = "--detach" ]; then
  shift
  rm -rf "$JOB" && mkdir -p "$JOB/out"
  # The job runs from its own copy of the tree: the device tool re-copies the working tree at every
  # later call (a collect call included), which must not change what a running job imports.
  mkdir -p "$JOB/tree" && tar -C "$ROOT" --exclude=./.git --exclude=./.stage --exclude=./out -cf - . | tar -C "$JOB/tree" -xf -
  touch "$JOB/running"
  RANK_SIM_SECONDS=${RANK_SIM_SECONDS:-1050} OUT="$JOB/out" setsid nohup bash "$JOB/tree/bench/gpu/rank_sim.sh" "$@" \
    > "$JOB/job.log" 2>&1 < /dev/null &
  echo "detached: pid $!, log $JOB/job.log; collect with: bash bench/gpu/rank_sim.sh --collect SECONDS"
  exit 0
fi
trap 'rm -f "$JOB/running"' EXIT

# the package mapping by symlinks, only where glmctl is not installed (an installed glmctl has it)
python3 -c "import importlib.util as u; raise SystemExit(u.find_spec('glmctl.kernels') is None)" 2>/dev/null ||
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
# Triton's cache (compiled kernels and autotuning results) in one folder; seeded from a carried one
export TRITON_CACHE_DIR=/tmp/rank-sim-triton TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .rank-sim-cache/triton-cache.tar.xz ]; then
  tar -C "$TRITON_CACHE_DIR" -xJf .rank-sim-cache/triton-cache.tar.xz && echo "Triton cache seeded from the carried tarball"
fi
secs=${RANK_SIM_SECONDS:-520}
compile=$([ "${RANK_SIM_COMPILE:-0}" = 1 ] || echo --no-compile)

end_stale() {  # the groups of servers an earlier run of this script left (their ids were written down)
  for f in /tmp/rank-sim-*.pgid; do
    [ -f "$f" ] || continue
    pg=$(cat "$f"); kill -TERM -- "-$pg" 2>/dev/null && sleep 10; kill -KILL -- "-$pg" 2>/dev/null
    rm -f "$f"; echo "ended the server group $pg left by an earlier run ($f)"
  done
}
rank_dir() {  # experts -> a TP8 rank checkpoint directory (config + tokenizer, no weights)
  local d=/tmp/rank-$1
  [ -f "$d/config.json" ] || python3 -m glmctl testing rank-config "$d" --tp 8 --experts "$1" >/dev/null \
    || { echo "rank-config --experts $1 failed"; return 1; }
  echo "$d"
}
port=8011
run() {  # name experts mtp plugin cells profile_cell extra...
  local name=$1 experts=$2 mtp=$3 plugin=$4 cells=$5 prof=$6; shift 6
  local dir; dir=$(rank_dir "$experts") || return 1
  end_stale
  port=$((port + 1))  # a fresh port per run: nothing left on an old one can answer for this run
  echo "=== $name ($(date +%T), limit ${secs}s, port $port)"
  local server_env=()
  for e in ${RANK_SIM_SERVER_ENV:-}; do server_env+=(--env "$e"); done
  timeout --kill-after=20 $((secs + 30)) python3 bench/rank_sim.py --model "$dir" --name "$name" \
    --mtp "$mtp" --plugin "$plugin" --cells "$cells" ${prof:+--profile-cell "$prof"} $compile --port "$port" \
    --env "VLLM_ENGINE_ITERATION_TIMEOUT_S=600" "${server_env[@]}" --out "$OUT/rank-sim-$name.json" \
    --deadline "$secs" "$@"
  echo "=== $name rc=$?"
  end_stale  # python ended the group itself unless it was killed first; this is the fallback
  local log="$OUT/vllm-$name.log"
  if [ -f "$log" ]; then  # the boot in full, the rest without the /metrics polls
    grep -v '"GET /metrics' "$log" | head -c 400000 > "$OUT/vllm-$name.head.log"
    grep -v '"GET /metrics' "$log" | tail -c 60000 > "$OUT/vllm-$name.tail.log"
    rm -f "$log"
  fi
}
for r in "${@:-main}"; do
  case $r in
    main|exl3-mtp3) run exl3-mtp3 exl3 3 on warm,8x22k,1x64k,8x64k,8x227k,256k 8x22k,1x64k,8x64k,8x227k ;;
    main-prefill)   run exl3-mtp3 exl3 3 on warm,8x22k,1x64k,8x64k,8x227k,256k,prefill 8x22k,1x64k,8x64k,8x227k ;;
    decode)         run exl3-mtp3 exl3 3 on warm,8x22k,1x64k,8x64k 8x22k,1x64k,8x64k ;;
    prefill)        run exl3-prefill exl3 3 on warm,prefill "" ;;
    exl3-fullgraph) run exl3-fullgraph exl3 3 on warm,8x22k,1x64k "" --env VLLM_USE_BREAKABLE_CUDAGRAPH=0 ;;
    exl3-nospec)    run exl3-nospec exl3 0 on warm,8x22k,8x227k "" ;;
    fp8-mtp3)       run fp8-mtp3 fp8 3 on warm,1x64k,8x22k "" ;;
    stock)          run stock fp8 0 off 1x8k "" --max-model-len 16384 ;;
    *) echo "unknown run $r" ;;
  esac
done
if [ "${RANK_SIM_SAVE_TRITON:-0}" = 1 ]; then
  tar -C "$TRITON_CACHE_DIR" -cJf /tmp/triton-cache.tar.xz . && size=$(stat -c %s /tmp/triton-cache.tar.xz)
  if [ "${size:-0}" -lt $((15 << 20)) ]; then cp /tmp/triton-cache.tar.xz "$OUT/"; else
    echo "Triton cache is $((size >> 20)) MiB compressed: over 15 MiB, not saved"; fi
fi
table "$OUT"
