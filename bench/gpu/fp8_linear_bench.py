"""glmctl's block-FP8 W8A16 linear vs vLLM 0.30's Marlin FP8 at one TP8 rank's shapes of
GLM-5.3-Flash, decode and prefill batch sizes, on the GPU at hand.

Each (shape, M, path) row is timed as CUDA-graph replays of COPIES different layers of that shape
back to back (together >= 256 MiB of weights, so they stream from DRAM as in the model, not
from L2), median of 7 replays over the copies (torch.cuda.Event). Paths: `glmctl` (split-K summed
by the last arrival, one launch), `glmctl-2k` (split-K summed by a second kernel), `glmctl-bits` (decode tiles converting e4m3 -> bf16 by
bit moves instead of cvt instructions), `marlin`
(vLLM's `MarlinFP8ScaledMMLinearKernel` path, what sm_89 runs today; absent without vLLM).
`frac_copy` = weight bytes / time over the measured device copy bandwidth.

The step figures sum calls x us over one decode step of the rank-simulation cells: the target
model at 32 (8x22k) or 4 (1x64k) tokens through every layer's FP8 linears, and the MTP drafter's
layer three times at 8 or 1 tokens (predicted from these per-call times: labelled so).

    python bench/gpu/fp8_linear_bench.py [--out FILE.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.kernels_common import copy_bandwidth, graph_calls_us  # noqa: E402

# (name, N, K, calls per target step, calls per drafter pass) at TP8: 34 KDA, 11 MLA, 3 dense-MLP
# and 42 MoE layers (shared experts), one MTP layer (MLA + MoE)
LINEARS = [
    ("kda.qkv", 3072, 4096, 34, 0), ("kda.f_b", 1024, 128, 34, 0), ("kda.g_b", 1024, 128, 34, 0),
    ("kda.o_proj", 4096, 1024, 34, 0), ("mla.qkv_a", 2048, 4096, 11, 1), ("mla.q_b", 2048, 1536, 11, 1),
    ("mla.o_proj", 4096, 2048, 11, 1), ("mla.wq_b", 512, 1536, 11, 1), ("mlp.gate_up", 3072, 4096, 3, 0),
    ("mlp.down", 4096, 1536, 3, 0), ("shared.gate_up", 512, 4096, 42, 1), ("shared.down", 4096, 256, 42, 1),
]
ROUTER = (288, 4096)  # the MoE gate: 42 MoE layers + the MTP layer per target step
ROUTER_CALLS = (43, 1)
CELLS = {"8x22k": (32, 8), "1x64k": (4, 1)}  # (target tokens, drafter tokens) per step, MTP-3
DRAFT_PASSES = 3
WEIGHT_BYTES_MIN = 256 << 20


def router_rows(sizes, bw) -> list[dict]:
    """The MoE router's logits (bf16 [288, 4096] gate, fp32 out): glmctl's GEMV vs cuBLAS's
    bf16 -> fp32 mm (vLLM's GateLinear tier on sm_89 and sm_90), 43 calls per target step."""
    from glmctl.kernels import fp8_block_linear as fbl

    n, k = ROUTER
    copies = -(-WEIGHT_BYTES_MIN // (2 * n * k))
    weights = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    counters = [fbl.new_counters("cuda") for _ in range(copies)]
    rows = []
    for m in [s for s in sizes if s <= fbl.DECODE_MAX_M]:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        paths = {"glmctl": [lambda x=x, w=w, c=c: fbl.bf16_linear(x, w, counters=c)
                            for w, c in zip(weights, counters, strict=True)],
                 "cublas": [lambda x=x, w=w: torch.mm(x, w.t(), out_dtype=torch.float32) for w in weights]}
        for path, calls in paths.items():
            us = graph_calls_us(calls)
            byte = 2 * n * k + m * k * 2 + m * n * 4
            rows.append(dict(linear="router", n=n, k=k, m=m, path=path, us=round(us, 2),
                             gb_s=round(byte / us / 1e3, 1), frac_copy=round(byte / us / 1e-6 / bw, 3)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "fp8-linear-h200.json"))
    ap.add_argument("--quick", action="store_true", help="decode sizes 8 and 32 only")
    args = ap.parse_args()
    from glmctl.kernels import fp8_block_linear as fbl

    try:
        from bench.fp8_marlin import MarlinFp8Linear
    except Exception as exc:  # noqa: BLE001 - the bench runs without vLLM, minus the peer
        print(f"marlin unavailable: {exc}")
        MarlinFp8Linear = None
    bw = copy_bandwidth()[0]
    device = torch.cuda.get_device_name()
    sizes = sorted({m for cell in CELLS.values() for m in cell} | ({8, 32} if args.quick else {2048}))
    if args.quick:
        sizes = [8, 32]
    rows = []
    for name, n, k, _, _ in LINEARS:
        copies = max(2, -(-WEIGHT_BYTES_MIN // (n * k)))
        weights = [(torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn) for _ in range(copies)]
        scales = [torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 0.02 + 0.004 for _ in range(copies)]
        counters = [fbl.new_counters("cuda") for _ in range(copies)]
        marlins = [MarlinFp8Linear(w, s) for w, s in zip(weights, scales, strict=True)] if MarlinFp8Linear else []
        for m in sizes:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            paths = {
                "glmctl": [lambda x=x, w=w, s=s, c=c: fbl.fp8_block_linear(x, w, s, counters=c)
                           for w, s, c in zip(weights, scales, counters, strict=True)],
                "glmctl-2k": [lambda x=x, w=w, s=s: fbl.fp8_block_linear(x, w, s)
                              for w, s in zip(weights, scales, strict=True)],
            }
            if m <= fbl.DECODE_MAX_M:  # the decode tiles with e4m3 -> bf16 by bit moves
                bits = fbl.plan(m, n, k, fp8_bits=True)
                paths["glmctl-bits"] = [
                    lambda x=x, w=w, s=s, c=c, b=bits: fbl.fp8_block_linear(x, w, s, counters=c, config=b)
                    for w, s, c in zip(weights, scales, counters, strict=True)]
            if marlins:
                paths["marlin"] = [lambda x=x, f=f: f(x) for f in marlins]
            p = fbl.plan(m, n, k)
            for path, calls in paths.items():
                us = graph_calls_us(calls)
                byte = n * k + scales[0].numel() * 4 + m * (k + n) * 2
                rows.append(dict(linear=name, n=n, k=k, m=m, path=path, us=round(us, 2),
                                 gb_s=round(byte / us / 1e3, 1), frac_copy=round(byte / us / 1e-6 / bw, 3),
                                 tflop_s=round(2 * m * n * k / us / 1e6, 1),
                                 config=f"{p.config.name} split {p.split_k}" if path != "marlin" else "marlin"))
        del weights, scales, counters, marlins
        torch.cuda.empty_cache()
    rows += router_rows(sizes, bw)
    by = {(r["linear"], r["m"], r["path"]): r["us"] for r in rows}
    paths = sorted({r["path"] for r in rows if r["linear"] != "router"})
    steps = []
    for cell, (target_m, draft_m) in CELLS.items():
        if target_m not in sizes or draft_m not in sizes:
            continue
        for path in paths:
            us = sum(calls * by[(name, target_m, path)] + DRAFT_PASSES * dcalls * by[(name, draft_m, path)]
                     for name, _, _, calls, dcalls in LINEARS)
            calls = sum(c + DRAFT_PASSES * d for *_, c, d in LINEARS)
            steps.append(dict(cell=cell, path=path, calls=calls, us_per_step=round(us, 1),
                              how="predicted: sum of calls x per-call graph-replay time"))
    for cell, (target_m, draft_m) in CELLS.items():
        if (("router", target_m, "glmctl") in by and ("router", draft_m, "glmctl") in by):
            for path in ("glmctl", "cublas"):
                us = (ROUTER_CALLS[0] * by[("router", target_m, path)]
                      + DRAFT_PASSES * ROUTER_CALLS[1] * by[("router", draft_m, path)])
                steps.append(dict(cell=cell, path=f"router-{path}", calls=ROUTER_CALLS[0] + DRAFT_PASSES * ROUTER_CALLS[1],
                                  us_per_step=round(us, 1), how="predicted: sum of calls x per-call graph-replay time"))
    record = dict(device=device, torch=torch.__version__, copy_bw_bytes_per_s=round(bw),
                  how="CUDA-graph replays over >= 256 MiB of distinct weights per row, median of 7",
                  rows=rows, steps=steps)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{device}: copy {bw / 1e12:.2f} TB/s; us per call (frac of copy BW)")
    print(f"{'linear':<15}{'N':>6}{'K':>6}{'M':>6}" + "".join(f"{p:>18}" for p in paths))
    for name, n, k, _, _ in LINEARS:
        for m in sizes:
            cells = []
            for p in paths:
                r = next((r for r in rows if r["linear"] == name and r["m"] == m and r["path"] == p), None)
                cells.append(f"{r['us']:>9.1f} ({r['frac_copy']:.2f})" if r else f"{'-':>18}")
            print(f"{name:<15}{n:>6}{k:>6}{m:>6}" + "".join(f"{c:>18}" for c in cells))
    for m in sizes:
        cells = [f"{by[('router', m, p)]:>9.1f}" for p in ("glmctl", "cublas") if ("router", m, p) in by]
        if cells:
            print(f"{'router':<15}{ROUTER[0]:>6}{ROUTER[1]:>6}{m:>6}  glmctl {cells[0]} us, cublas {cells[-1]} us")
    for s in steps:
        print(f"step {s['cell']:<6} {s['path']:<10} {s['calls']} calls {s['us_per_step'] / 1e3:.3f} ms (predicted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
