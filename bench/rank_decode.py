"""The decode step of one TP8 rank, component by component, against the bytes each component must
move: `bench/results/rank-decode-h200.json` from bench/rank_sim.py records whose cells were profiled.

    python bench/rank_decode.py REC.json [REC.json ...] --out bench/results/rank-decode-h200.json \\
        --copy-bw 4.19e12 --source "H200, 2026-12-02 (block 1)"

Per cell (`SxCk`: S sessions at C context, MTP-k): `step_ms` is the cell's measured step (vLLM's
counters over its steady window); `components` are the profiled window's kernel time per engine
iteration grouped by kind (`rank_sim_profile.KINDS`, re-applied here to the record's kernel table,
so an old record reads with today's kinds), each beside `bytes_per_step`, the bytes its kernels
must move at least, and `frac_copy` = bytes / time / the device-to-device copy bandwidth. The
floor is the sum of those bytes over the copy bandwidth.

The bytes (`step_bytes`) are a stated model, not a measurement: `glmctl.plan.prediction.decode_bytes`
(its module doc lists what each kind is charged; the node prediction's roofline uses the same).
Uniform routing is an upper bound on the experts a real batch touches: random router weights on
correlated hidden states may touch fewer (in the 8x22k cell the EXL3 calls took 192 us each against
376 us for the same kernels under uniform routing in bench/exl3.py), so the experts' `frac_copy`
here is an upper bound; bench/results/moe-decode-h200.json holds the kernel's figure at known bytes.
Runs on CPU (no torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_sim import parse_cell  # noqa: E402
from rank_sim_profile import kind_of  # noqa: E402

from glmctl.plan import load_model_spec  # noqa: E402
from glmctl.plan.prediction import decode_bytes  # noqa: E402

TP = 8
TARGETS_MS = {"8x22k": 7.0, "1x64k": 5.0}  # issue 27
COMPONENTS = ("routed_experts", "fp8_linear", "norms_mhc", "dense_gemm", "indexer", "mla_attention", "kda",
              "activation", "sampler", "runner", "torch_glue", "memcpy", "other")
KERNEL_CHOICES = {
    "routed_experts": ("exllamav3 1.6.5 exl3_moe_coop (rot + a + b kernels; mma.sync m16n8k16, no wgmma/TMA) via "
                       "glmctl's EXL3 method, vLLM's single_group_topk router; sm_80+ code: an sm_89 node runs "
                       "the same kernels"),
    "fp8_linear": ("vLLM's MarlinFP8ScaledMMLinearKernel (W8A16), forced with VLLM_DISABLED_KERNELS as on "
                   "sm_89, where vLLM picks it first (DeepGEMM/CUTLASS block-FP8 need sm_90+)"),
    "norms_mhc": "glmctl's Triton mHC kernels (kernels/mhc_pre_post.py; sm_89 cross-compiled, no spills)",
    "dense_gemm": ("cuBLAS(Lt) bf16/fp32 GEMMs (nvjet sm90 kernels on the H200; an sm_89 node gets cuBLAS's "
                   "sm_89 kernels for the same calls: the same calls, not the same kernels)"),
    "indexer": "glmctl's Triton indexer logits, kpool writes and top-k (sm_89 configs)",
    "mla_attention": "glmctl's Triton sparse MLA decode (sm_89 configs)",
    "kda": "vLLM's FLA Triton kernels (fused_recurrent, causal_conv1d_update): the same on sm_89",
    "sampler": "torch sampler (VLLM_USE_FLASHINFER_SAMPLER=0) and vLLM's Triton rejection sampler",
}
# What replaces a component's stock kernels when a record's kernel table shows glmctl's instead
# (kernel name fragment -> component, text)
ALTERNATIVES = (
    ("_fp8_block_linear_kernel", "fp8_linear",
     "glmctl's Triton W8A16 block-FP8 linear (kernels/fp8_block_linear.py, GLMCTL_FP8_LINEAR=glmctl; mma.sync, "
     "no wgmma/TMA, sm_89 cross-compiled: an sm_89 node runs the same kernel)"),
    ("_bf16_gemv_kernel", "dense_gemm",
     "cuBLAS(Lt) bf16/fp32 GEMMs, the MoE router's logits on glmctl's Triton GEMV (GLMCTL_ROUTER_GEMM=glmctl; "
     "the same kernel on an sm_89 node)"),
)


def kernel_choices(records: list[dict]) -> dict[str, str]:
    """KERNEL_CHOICES, with each component whose glmctl kernel ran in a profiled window named as such."""
    names = {row["name"] for rec in records for c in rec.get("cells", [])
             for row in (c.get("breakdown") or {}).get("kernels_table") or []}
    out = dict(KERNEL_CHOICES)
    for fragment, component, text in ALTERNATIVES:
        if any(fragment in n for n in names):
            out[component] = text
    return out


def step_bytes(sessions: int, context: int, mtp: int, variant: str = "exl3") -> dict[str, float]:
    return decode_bytes.step_bytes(load_model_spec("glm-5.3-flash"), sessions, context, mtp, variant, TP)


def components_of(breakdown: dict) -> tuple[dict[str, float], int]:
    """Kernel us per iteration by today's kinds, from the record's kernel table (or its kinds)."""
    table = breakdown.get("kernels_table")
    if not table:
        return dict(breakdown.get("us_per_iteration") or {}), 0
    out: dict[str, float] = {}
    calls = 0.0
    for row in table:
        kind = kind_of(row["name"])
        out[kind] = out.get(kind, 0.0) + row["us_per_iteration"]
        calls += row["calls_per_iteration"]
    return out, round(calls)


def cell_entry(cell: dict, mtp: int, copy_bw: float, choices: dict[str, str] = KERNEL_CHOICES) -> dict:
    sessions, context = parse_cell(cell["cell"])
    b = cell.get("breakdown") or {}
    us, launches = components_of(b)
    need = step_bytes(sessions, context, mtp)
    comps = []
    for name in COMPONENTS:
        t = us.get(name, 0.0)
        if not t and name not in need:
            continue
        nbytes = need.get(name)
        comps.append({"name": name, "us_per_step": round(t, 1),
                      "bytes_per_step": None if nbytes is None else int(nbytes),
                      "frac_copy": None if not (nbytes and t) else round(nbytes / (t * 1e-6) / copy_bw, 3),
                      "kernels": choices.get(name)})
    busy = sum(us.values())
    floor_ms = sum(need.values()) / copy_bw * 1e3
    entry = {"cell": cell["cell"], "step_ms": cell.get("step_ms"), "floor_ms": round(floor_ms, 3),
             "step_over_floor": round(cell["step_ms"] / floor_ms, 2) if cell.get("step_ms") else None,
             "profiled_busy_ms": round(busy / 1e3, 3), "gpu_idle_us": (b.get("us_per_iteration") or {}).get(
                 "gpu_idle_in_span"), "kernels_per_step": launches or b.get("kernels"),
             "other_frac": round(us.get("other", 0.0) / busy, 4) if busy else None,
             "components": comps}
    if cell["cell"] in TARGETS_MS and cell.get("step_ms"):
        entry["target_ms"] = TARGETS_MS[cell["cell"]]
        entry["measured_over_target"] = round(cell["step_ms"] / TARGETS_MS[cell["cell"]], 2)
    if not b or b.get("error"):
        entry["not_profiled"] = (b or {}).get("error") or cell.get("no_window") or "the cell was not profiled"
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--copy-bw", type=float, required=True, help="device-to-device copy bytes/s (read + write)")
    ap.add_argument("--source", required=True)
    ap.add_argument("--note", action="append", default=[])
    args = ap.parse_args()
    cells, head = {}, {}
    records = [json.loads(path.read_text()) for path in args.records]
    choices = kernel_choices(records)
    for rec in records:
        head = head or {k: rec.get(k) for k in ("device", "vllm_version", "torch_version")}
        mtp = int((rec.get("settings") or {}).get("mtp", 0))
        for c in rec.get("cells", []):
            if "x" in c.get("cell", "") and c.get("step_ms"):
                cells[c["cell"]] = cell_entry(c, mtp, args.copy_bw, choices)  # a later record's cell wins
    order = ["8x22k", "1x64k", "8x64k", "8x227k"]
    out = {**head, "source": args.source, "copy_bw_bytes_per_s": args.copy_bw,
           "how": __doc__.split("\n\n")[1].strip(), "kernel_choices": choices,
           "cells": [cells[k] for k in order if k in cells] + [v for k, v in cells.items() if k not in order],
           "missing_cells": [k for k in order if k not in cells], "notes": args.note}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"{'cell':>7} {'step ms':>8} {'floor ms':>8} {'x floor':>7}  top components (us, frac_copy)")
    for c in out["cells"]:
        top = sorted(c["components"], key=lambda x: -x["us_per_step"])[:5]
        print(f"{c['cell']:>7} {c['step_ms']:>8} {c['floor_ms']:>8} {c['step_over_floor']:>7}  "
              + ", ".join(f"{x['name']} {x['us_per_step']:.0f} ({x['frac_copy']})" for x in top))
    if out["missing_cells"]:
        print("missing:", ", ".join(out["missing_cells"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
