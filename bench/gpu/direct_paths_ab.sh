#!/usr/bin/env bash
# Is the native direct path's slowness on the thread rig the rig's or the protocol's? One device
# call (~150 s, no vLLM; carry the pydantic wheels of .whl/): the rig's `small` phase at 2 and 4
# ranks for the LL, one-shot and two-shot direct variants and the barrier path (with a fence and a
# barrier timed alone), first with CUDA's default 8 hardware queues per context, then with 32.
# Ranks are threads of one process, each on its own stream: with fewer queues than streams two
# ranks can share a queue, so a rank's spinning collect kernel can hold up a peer's publish kernel
# and fence behind it, which no node has (one GPU per rank). LL words are one kernel per call and
# would not notice; the one- and two-shot paths (publish, fence, collect) would.
#
#   there:  bash bench/gpu/direct_paths_ab.sh              timeout_s 200
#
# Writes $OUT/conn8 and $OUT/conn32 (each the rig's JSON, .md and log); prints both small tables.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/direct-ab}
for conn in 8 32; do
  mkdir -p "$OUT/conn$conn"
  CUDA_DEVICE_MAX_CONNECTIONS=$conn OUT=$OUT/conn$conn COLL_THREADS_BUDGET_S=${DIRECT_AB_BUDGET_S:-50} \
    COLL_THREADS_WORLDS="2 4" COLL_THREADS_PHASES=small COLL_THREADS_SMOKE_S=0 \
    bash bench/gpu/collectives_threads.sh > "$OUT/conn$conn/stdout.txt" 2>&1
  echo "== CUDA_DEVICE_MAX_CONNECTIONS=$conn"
  sed -n '/small messages, captured/,/^$/p' "$OUT/conn$conn/stdout.txt" | head -40
done
