#!/usr/bin/env python3
"""One GLM-5.3-Flash MoE layer at TP8 on one GPU: EXL3 4-bit experts vs FP8 and bf16 experts.

    python bench/exl3.py [--tokens 1,2,4,8,16,32,48] [--prefill 8192] [--out DIR]

Shapes: 288 routed experts, top-8, hidden 4096, moe_intermediate 2048 split over 8 ranks (256
channels per rank), i.e. exactly one rank's share of a layer. The routed experts only (the
shared expert and the router are the same in every variant and are left out).

  exl3   glmctl.plugin.exl3_experts.Exl3MoE as the plugin runs it, 4 bits/weight (random trellis
         bits: the kernels' cost does not depend on the values): exl3_moe_coop up to 256 slots
         (32 tokens), exl3_moe above; `exl3 fused` forces exl3_moe at every size
  fp8    torch: sort by expert + torch._scaled_grouped_mm (e4m3 weights with per-channel scales,
         per-token dynamic e4m3 activations), SwiGLU, weighted scatter-add
  bf16   the same with torch._grouped_mm on bf16 weights

Decode sizes (1..48 tokens) are timed as CUDA-graph replays, the way vLLM runs them; each replay
runs 16 layers' worth of different routings back to back so that expert weights do not stay in
L2 between calls. The prefill chunk runs eagerly (vLLM does not capture it). Latency is the median
of 5 timed rounds (CUDA events). Expert bytes per GPU are exact arithmetic over the tensors each
variant holds; the model total multiplies by GLM-5.3-Flash's 43 MoE layers (42 + MTP).
Writes exl3-bench.json and exl3-bench.md to --out and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

EXPERTS, TOP_K, HIDDEN, INTER_FULL, TP = 288, 8, 4096, 2048, 8
INTER = INTER_FULL // TP
BITS = 4
MOE_LAYERS = 43  # transformers 5.24 Glm5NextTextConfig: 42 "sparse" mlp_layer_types + the MTP layer
CALLS_PER_REPLAY = 16
SWIGLU_LIMIT = 10.0


def exl3_layer(torch, device):
    from glmctl.plugin.exl3_experts import Exl3MoE, Exl3Projection

    g = torch.Generator(device=device).manual_seed(0)

    def proj(k, n):
        trellis = torch.randint(-2**15, 2**15, (EXPERTS, k // 16, n // 16, 16 * BITS), dtype=torch.int16,
                                device=device, generator=g)
        # |suh * svh| ~ 1/sqrt(k): unit-variance outputs from unit-variance inputs, fp16-safe
        scale = k ** -0.25
        suh = (torch.randint(0, 2, (EXPERTS, k), device=device, generator=g) * 2 - 1).half() * scale
        svh = (torch.randint(0, 2, (EXPERTS, n), device=device, generator=g) * 2 - 1).half() * scale
        return Exl3Projection(trellis, suh, svh)

    return Exl3MoE(proj(HIDDEN, INTER), proj(HIDDEN, INTER), proj(INTER, HIDDEN), BITS, SWIGLU_LIMIT)


class TorchExperts:
    """Sort by expert, grouped GEMMs, SwiGLU, weighted scatter-add: sync-free and capturable."""

    def __init__(self, torch, device, fp8: bool) -> None:
        self.torch, self.fp8 = torch, fp8
        g = torch.Generator(device=device).manual_seed(1)
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device, generator=g, dtype=torch.bfloat16) / 64
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=device, generator=g, dtype=torch.bfloat16) / 16
        if fp8:
            self.w13, self.s13 = self._quant_rows(w13)
            self.w2, self.s2 = self._quant_rows(w2)
        else:
            self.w13, self.w2 = w13, w2
        self.impl = "torch._scaled_grouped_mm" if fp8 else "torch._grouped_mm"

    def _quant_rows(self, w):
        torch = self.torch
        scale = w.float().abs().amax(-1).clamp(min=1e-8) / 448.0  # per output channel
        return (w.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale

    @property
    def weight_bytes(self) -> int:
        ts = [self.w13, self.w2] + ([self.s13, self.s2] if self.fp8 else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def _gemm(self, a, w, s, offs):
        torch = self.torch
        if not self.fp8:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        a_scale = a.float().abs().amax(-1).clamp(min=1e-8) / 448.0
        a8 = (a.float() / a_scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        return torch._scaled_grouped_mm(a8, w.transpose(1, 2), a_scale, s, offs=offs, out_dtype=torch.bfloat16)

    def __call__(self, x, ids, weights):
        torch = self.torch
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat)
        tok = torch.div(order, ids.shape[1], rounding_mode="floor")
        counts = torch.zeros(EXPERTS, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[tok]
        gu = self._gemm(xs, self.w13, self.s13 if self.fp8 else None, offs)
        g, u = gu[:, :INTER].float().clamp(max=SWIGLU_LIMIT), gu[:, INTER:].float().clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        a = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
        y = self._gemm(a, self.w2, self.s2 if self.fp8 else None, offs)
        out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, y.float() * weights.reshape(-1)[order].float().unsqueeze(1))
        return out.to(x.dtype)


def routings(torch, tokens: int, n: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        scores = torch.rand(tokens, EXPERTS, device=device, generator=g)
        w, ids = scores.topk(TOP_K, dim=-1)
        out.append((torch.randn(tokens, HIDDEN, device=device, generator=g).bfloat16(), ids.to(torch.int32),
                    (w / w.sum(-1, keepdim=True) * 2.5).float()))
    return out


def time_graph(torch, fn, inputs, rounds: int = 5, replays: int = 10) -> float:
    """Median microseconds per call over graph replays of len(inputs) back-to-back calls."""
    for x, ids, w in inputs[:2]:
        fn(x, ids, w)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for x, ids, w in inputs:
            fn(x, ids, w)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        per_call.append(a.elapsed_time(b) * 1000 / replays / len(inputs))
    return statistics.median(per_call)


def time_eager(torch, fn, inputs, rounds: int = 5) -> float:
    x, ids, w = inputs[0]
    fn(x, ids, w)
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x, ids, w)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000)
    return statistics.median(out)


def fp8_block_bytes(block: int = 128) -> int:
    """Per-layer, per-rank bytes of block-FP8 experts as vLLM 0.30 holds them (e4m3 + fp32 scales)."""
    per = 0
    for k, n in ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)):
        per += k * n + math.ceil(k / block) * math.ceil(n / block) * 4
    return EXPERTS * per


def run(tokens: list[int], prefill: int) -> dict:
    import torch

    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    exl3 = exl3_layer(torch, device)

    def decode_with(kind):
        def fn(x, ids, w):
            exl3.decode_kernel = kind  # read while the graph is captured: each capture bakes one kernel
            return exl3(x, ids, w)
        return fn

    variants = {"exl3": decode_with("coop"), "exl3_fused": decode_with("fused")}
    notes = []
    for name, fp8 in (("fp8", True), ("bf16", False)):
        try:
            v = TorchExperts(torch, device, fp8)
            x, ids, w = routings(torch, 4, 1, device, 0)[0]
            v(x, ids, w)
            torch.cuda.synchronize()
            variants[name] = v
        except Exception as exc:  # a torch without grouped GEMMs for this dtype/arch: say so
            notes.append(f"{name}: unavailable ({type(exc).__name__}: {str(exc)[:160]})")
    for kind in ("coop", "fused"):
        exl3.decode_kernel = kind
        exl3.warm_up(tokens, TOP_K)
    # The two EXL3 kernels must agree at the real shape (288 experts, top-8): a cross-check
    agree = {}
    for t in (1, 8, 32):
        x, ids, w = routings(torch, t, 1, device, 99)[0]
        outs = []
        for kind in ("coop", "fused"):
            exl3.decode_kernel = kind
            outs.append(exl3(x, ids, w).float())
        agree[t] = float((outs[0] - outs[1]).norm() / outs[1].norm())
    exl3.decode_kernel = "coop"
    rows = []
    for t in tokens:
        inputs = routings(torch, t, CALLS_PER_REPLAY, device, t)
        row = {"tokens": t, "mode": "cuda-graph"}
        for name, fn in variants.items():
            try:
                row[f"{name}_us"] = round(time_graph(torch, fn, inputs), 1)
            except Exception as exc:  # not capturable here: time it eagerly and say so
                torch.cuda.synchronize()
                row[f"{name}_us"] = round(time_eager(torch, fn, inputs), 1)
                notes.append(f"{name} at {t} tokens timed eagerly: capture failed ({type(exc).__name__}: "
                             f"{str(exc)[:120]})")
        rows.append(row)
    if prefill:
        inputs = routings(torch, prefill, 1, device, 7)
        row = {"tokens": prefill, "mode": "eager"}
        for name, fn in variants.items():
            if name == "exl3_fused":
                continue  # the same path as exl3 at this size
            row[f"{name}_us"] = round(time_eager(torch, fn, inputs), 1)
        exl3.prefill_mode = "chunk"
        row["exl3_chunked_us"] = round(time_eager(torch, exl3, inputs), 1)
        exl3.prefill_mode = "recon"
        rows.append(row)
    mem = {"exl3": exl3.weight_bytes, "fp8_block128": fp8_block_bytes(), "bf16": EXPERTS * 3 * HIDDEN * INTER * 2}
    if "fp8" in variants:
        mem["fp8_bench_rowwise"] = variants["fp8"].weight_bytes
    from importlib.metadata import version

    try:
        exl3_version = version("exllamav3")
    except Exception:
        exl3_version = "unknown"
    return {
        "what": "GLM-5.3-Flash routed experts, one MoE layer, one TP8 rank (288 experts x 256 channels, top-8)",
        "device": props.name, "sm_count": props.multi_processor_count,
        "torch": torch.__version__, "exllamav3": exl3_version,
        "how": f"CUDA-graph replays of {CALLS_PER_REPLAY} different routings per replay (decode sizes), eager "
               "for the prefill chunk; median of 5 rounds of CUDA events; random weights and uniform routing",
        "rows": rows, "notes": notes, "coop_vs_exl3_moe_rel_diff": agree, "fp16_clamped_values": int(exl3.fp16_clamped),
        "expert_bytes_per_gpu_per_layer": mem,
        "expert_gib_per_gpu_model": {k: round(v * MOE_LAYERS / 2**30, 2) for k, v in mem.items()},
        "exl3_over_fp8_bytes": round(mem["exl3"] / mem["fp8_block128"], 3),
    }


def table(result: dict) -> str:
    lines = [f"{result['what']} on {result['device']} (torch {result['torch']}, exllamav3 {result['exllamav3']})", "",
             "| tokens | mode | EXL3 us | EXL3 exl3_moe only us | FP8 us | bf16 us | EXL3/FP8 |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = f"{r['exl3_us'] / r['fp8_us']:.2f}" if r.get("fp8_us") else "-"
        fused = r.get("exl3_fused_us", f"sliced, sync-free: {r.get('exl3_chunked_us', '-')}")
        lines.append(f"| {r['tokens']} | {r['mode']} | {r['exl3_us']} | {fused} | {r.get('fp8_us', '-')} | "
                     f"{r.get('bf16_us', '-')} | {ratio} |")
    gib = result["expert_gib_per_gpu_model"]
    lines += ["", f"expert weights per GPU, whole model (43 MoE layers, TP8): EXL3 {gib['exl3']} GiB, "
                  f"block-FP8 {gib['fp8_block128']} GiB, bf16 {gib['bf16']} GiB; EXL3/FP8 = "
                  f"{result['exl3_over_fp8_bytes']} (target <= 0.6)"]
    lines += ["EXL3 kernels agree (exl3_moe_coop vs exl3_moe, relative difference by tokens): "
              + ", ".join(f"{t}: {d:.1e}" for t, d in result["coop_vs_exl3_moe_rel_diff"].items())]
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,48")
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    started = time.perf_counter()
    result = run([int(t) for t in args.tokens.split(",") if t], args.prefill)
    result["bench_seconds"] = round(time.perf_counter() - started, 1)
    text = table(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "exl3-bench.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "exl3-bench.md").write_text(text + "\n")
    print(json.dumps(result, indent=2) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
