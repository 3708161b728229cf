#!/usr/bin/env bash
# Issue 12: the multi-GPU measurement run, in one call on a machine with 2-8 GPUs.
#
#   here:   ../shared/tools/gpu-wheels.sh && make gpu-bundle
#   there:  bash bench/multigpu.sh          (device tool: carry [".whl"], kind nvidia-h200-x2/-x4/-x8)
#
# 1. `glmctl doctor --json` on all GPUs: P2P matrix (driver vs a cross-process write test), pinned
#    copy bandwidth per GPU and all at once, NCCL all-reduce busbw with P2P allowed and with
#    NCCL_P2P_DISABLE=1 (the report's situation), host-staged all-reduce/all-gather bf16 + INT8.
# 2. Host-staged correctness across real GPUs, one process per GPU (GLMCTL_COLLECTIVES_SPREAD=1):
#    fp64 reference, bitwise identity across ranks, 1,000 graph replays, a killed rank.
# 3. A table: host-staged vs NCCL-no-P2P busbw ratio per size, latency at decode sizes.
# Everything lands in $OUT; commit it under bench/results/multigpu-* with bench/README.md's table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/multigpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing the carried wheels failed" >&2; exit 3; }
export PYTHONPATH=$PWD/.whl/ext:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts (device tool KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi topo -m | tee "$OUT/topo.txt"
timeout 420 python3 -m glmctl doctor --json --record "$OUT/doctor.json" > "$OUT/doctor-verdict.json" 2> "$OUT/doctor.log"
echo "doctor rc=$? (1 = the chosen profile cannot run here, expected off an 8x L40 node)"
GLMCTL_COLLECTIVES_SPREAD=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/gpu/test_collectives_correctness.py tests/gpu/test_collectives_graphs.py tests/gpu/test_collectives_faults.py \
  2>&1 | tee "$OUT/collectives-spread.log" | tail -5
python3 - "$OUT/doctor.json" <<'PY' | tee "$OUT/table.md"
import json, sys
from glmctl.probe.doctor_report import DoctorReport
r = DoctorReport.model_validate_json(open(sys.argv[1]).read())
nccl = {c.bytes: c for c in r.collectives if c.backend == "nccl" and c.env.get("NCCL_P2P_DISABLE") == "1"}
hs = {c.bytes: c for c in r.collectives if c.backend == "host-staged" and c.op == "all_reduce" and c.dtype == "bf16"}
print(f"| size | NCCL no-P2P busbw GB/s | host-staged busbw GB/s | ratio | host-staged latency us |")
print("|---|---|---|---|---|")
for b in sorted(set(nccl) & set(hs)):
    ratio = hs[b].busbw_gbps / nccl[b].busbw_gbps if nccl[b].busbw_gbps else float("nan")
    print(f"| {b / 2**10:,.0f} KiB | {nccl[b].busbw_gbps:.2f} | {hs[b].busbw_gbps:.2f} | {ratio:.2f} | {hs[b].latency_us:.1f} |")
states = {}
for p in r.p2p:
    states[p.state] = states.get(p.state, 0) + 1
print(f"\nP2P pairs by state: {states}; GPUs: {len(r.gpus)} x {r.gpus[0].name if r.gpus else '-'}")
PY
