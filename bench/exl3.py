#!/usr/bin/env python3
"""One GLM-5.3-Flash MoE layer at TP8 on one GPU: every routed-expert path, against the bytes it must move.

    python bench/exl3.py [--tokens 1,8,32,48] [--paths exl3_coop,exl3_auto,...] [--sweep PATTERNS]
                         [--prefill 2048,8192] [--vllm-fused-moe PATH] [--tag NAME] [--out DIR] [--json]
                         [--hot-experts N] [--no-launches]
    python bench/exl3.py --warm ...      compile / warm every selected path, no timing
    python bench/exl3.py --profile ...   one eager call per (path, tokens), between
                                         cudaProfilerStart/Stop, each after a `spin_kernel` marker
                                         (for Nsight Compute: bench/gpu/moe_v2.sh)

Shapes: 288 routed experts, top-8, hidden 4096, moe_intermediate 2048 over 8 ranks (256 channels
per rank): one rank's share of a layer, routed experts only. Paths: bench/moe_paths.py.

Per row: `us` is the median of 5 rounds of CUDA-event timing of CUDA-graph replays, each replay
running 16 different uniform routings back to back (so weights do not stay in L2), per call;
prefill chunks run eagerly as vLLM runs them. `bytes` is what the call must move at least: the
distinct experts its routing touches (counted from each of the 16 routings, averaged) x that
path's bytes per expert, plus the activations (bf16 x in and out, ids and weights).
`frac_copy` = bytes / us / (device-to-device copy bandwidth measured in the same run, read +
write bytes of a 1 GiB torch copy). Writes moe-bench.json / moe-bench.md to --out; the table last.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_paths import EXPERTS, HIDDEN, INTER, TOP_K, Paths, fp8_block_bytes  # noqa: E402

CALLS_PER_REPLAY = 16
MOE_LAYERS = 43  # transformers 5.24 Glm5NextTextConfig: 42 "sparse" mlp_layer_types + the MTP layer
DEFAULT_PATHS = "exl3_coop,exl3_coop_lean,exl3_auto,exl3_triton,fp8_torch,bf16_torch,fp8_vllm_k.vllm_default"
EXL3_PATH_NAMES = ("exl3_coop", "exl3_coop_lean", "exl3_auto", "exl3_fused", "exl3_triton", "exl3_prefill_triton")


def routings(torch, tokens: int, n: int, device, seed: int, hot: int = 0):
    """n uniform top-8 routings of `tokens` tokens; with `hot`, over the first `hot` experts only
    (their weights then stay in L2 from call to call: the kernel's compute ceiling, not DRAM's)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        scores = torch.rand(tokens, EXPERTS, device=device, generator=g)
        if hot:
            scores[:, hot:] = -1.0
        w, ids = scores.topk(TOP_K, dim=-1)
        out.append((torch.randn(tokens, HIDDEN, device=device, generator=g).bfloat16(), ids.to(torch.int32),
                    (w / w.sum(-1, keepdim=True) * 2.5).float()))
    return out


def copy_bandwidth(torch, device, size: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, read + write counted."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    del src, dst
    return 2 * size / statistics.median(times)


def time_graph(torch, fn, inputs, rounds: int = 5, replays: int = 10) -> float:
    """Median microseconds per call over graph replays of len(inputs) back-to-back calls."""
    for i, (x, ids, w) in enumerate(inputs[:2]):
        fn(x, ids, w, i)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i, (x, ids, w) in enumerate(inputs):
            fn(x, ids, w, i)
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
    del graph
    return statistics.median(per_call)


def time_eager(torch, fn, inputs, rounds: int = 5) -> float:
    x, ids, w = inputs[0]
    fn(x, ids, w, 0)
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x, ids, w, 0)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000)
    return statistics.median(out)


def launches(torch, fn, inputs) -> dict:
    """GPU activities of one eager call (kernels, memsets, copies), from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    x, ids, w = inputs[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x, ids, w, 0)
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    busy = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            key = e.name.split("(")[0][-60:]
            names[key] = names.get(key, 0) + 1
            busy += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {"count": sum(names.values()), "busy_us": round(busy, 1), "names": names}


def must_move(inputs, per_expert: float) -> tuple[float, float]:
    """(bytes, mean distinct experts) over the routings: expert weights + activations."""
    experts = statistics.mean(len(ids.unique()) for _, ids, _ in inputs)
    tokens = inputs[0][0].shape[0]
    return experts * per_expert + tokens * HIDDEN * 2 * 2 + tokens * TOP_K * 8, experts


def select(patterns: str, names: list[str]) -> list[str]:
    out = []
    for pat in filter(None, (p.strip() for p in patterns.split(","))):
        hits = [n for n in names if fnmatch.fnmatchcase(n, pat)] or [pat]
        out += [h for h in hits if h not in out]
    return out


def all_names() -> list[str]:
    from glmctl.kernels.exl3_moe_decode import DECODE_CONFIGS
    from moe_fp8_vllm import SWEEP

    decode = [c for c, cfg in DECODE_CONFIGS.items() if cfg.rows == 16]
    prefill = [c for c, cfg in DECODE_CONFIGS.items() if cfg.rows > 16]
    return (list(EXL3_PATH_NAMES) + [f"exl3_triton.{c}" for c in decode]
            + [f"exl3_prefill_triton.{c}" for c in prefill] + ["fp8_torch", "bf16_torch"]
            + [f"{p}.{c}" for p in ("fp8_vllm", "fp8_vllm_k") for c in ["vllm_default"] + [s.name for s in SWEEP]])


def run(args) -> dict:
    import torch

    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    paths = Paths(torch, device, args.vllm_fused_moe)
    names = all_names()
    plan = [(p, t) for p in select(args.paths, names) for t in args.tokens]
    plan += [(p, t) for p in select(args.sweep, names) for t in args.sweep_tokens if (p, t) not in plan]
    notes, rows, agree = [], [], {}
    bw = None if (args.warm or args.profile) else copy_bandwidth(torch, device)

    def checkpoint():  # a run cut short by its time limit still leaves its rows
        if args.out and not (args.warm or args.profile):
            args.out.mkdir(parents=True, exist_ok=True)
            partial = {"partial": True, "device": props.name, "tag": args.tag, "copy_bw_bytes_per_s": round(bw),
                       "rows": rows, "notes": notes}
            (args.out / f"{stem(args)}.json").write_text(json.dumps(partial, indent=1) + "\n")
    if not args.warm and not args.profile:
        paths.exl3.warm_up(sorted({t for _, t in plan} | {1, 8, 32}), TOP_K)
    if args.profile:
        torch.cuda.profiler.start()
    for name, tokens in plan:
        if not paths.supports(name, tokens):
            continue
        inputs = routings(torch, tokens, 2 if (args.warm or args.profile) else CALLS_PER_REPLAY, device, tokens,
                          args.hot_experts)
        try:
            fn, per_expert, note = paths.get(name, inputs)
            if args.warm or args.profile:
                if args.profile:
                    torch.cuda.synchronize()
                    torch.cuda._sleep(1000)  # the marker kernel before each (path, tokens) in the profile
                    print(f"PROFILE {name} {tokens}", flush=True)
                x, ids, w = inputs[0]
                fn(x, ids, w, 0)
                torch.cuda.synchronize()
                continue
            us = time_graph(torch, fn, inputs)
        except Exception as exc:  # unavailable here (no vLLM file, an arch without grouped GEMMs): say so
            torch.cuda.synchronize()
            notes.append(f"{name} at {tokens} tokens: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        nbytes, experts = must_move(inputs, per_expert)
        rows.append({"path": name, "tokens": tokens, "mode": "cuda-graph", "us": round(us, 1), "bytes": int(nbytes),
                     "frac_copy": round(nbytes / (us * 1e-6) / bw, 3), "experts": round(experts, 1),
                     "tag": args.tag, **({"config": note} if note else {})})
        if not args.no_launches:
            try:
                rows[-1]["launches"] = launches(torch, fn, inputs)
            except Exception as exc:
                rows[-1]["launches"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        checkpoint()
        print(json.dumps(rows[-1]), flush=True)
    if args.profile:
        torch.cuda.profiler.stop()
    if args.warm or args.profile:
        return {"rows": [], "notes": notes}
    try:
        agree = agreement(torch, paths, [p for p, _ in plan if p.startswith("exl3_")], device)
    except Exception as exc:
        notes.append(f"agreement check: {type(exc).__name__}: {str(exc)[:200]}")
    for tokens in args.prefill:
        inputs = routings(torch, tokens, 1, device, 7)
        first = None  # the first EXL3 path's output: every EXL3 path's prefill row says how far it is
        for name in select(args.prefill_paths, names):
            try:
                fn, per_expert, note = paths.get(name, inputs)
                y = fn(*inputs[0], 0).float() if name.startswith("exl3_") else None
                us = time_eager(torch, fn, inputs)
            except Exception as exc:
                notes.append(f"{name} at {tokens} tokens (eager): {type(exc).__name__}: {str(exc)[:200]}")
                continue
            first = y if first is None else first
            nbytes, experts = must_move(inputs, per_expert)
            rows.append({"path": name, "tokens": tokens, "mode": "eager", "us": round(us, 1), "bytes": int(nbytes),
                         "frac_copy": round(nbytes / (us * 1e-6) / bw, 3), "experts": round(experts, 1),
                         "tag": args.tag})
            if y is not None:
                rows[-1]["rel_err_vs_first_exl3"] = float((y - first).norm() / first.norm())
            print(json.dumps(rows[-1]), flush=True)
            checkpoint()
    mem = {"exl3": paths.exl3.weight_bytes, "fp8_block128": fp8_block_bytes(), "bf16": EXPERTS * 3 * HIDDEN * INTER * 2}
    from importlib.metadata import version

    try:
        exl3_version = version("exllamav3")
    except Exception:
        exl3_version = "unknown"
    env = {k: v for k, v in os.environ.items() if k.startswith(("EXL3_", "GLMCTL_EXL3"))}
    return {
        "what": "GLM-5.3-Flash routed experts, one MoE layer, one TP8 rank (288 experts x 256 channels, top-8)",
        "device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
        "exllamav3": exl3_version, "tag": args.tag, "env": env, "hot_experts": args.hot_experts,
        "copy_bw_bytes_per_s": round(bw),
        "how": f"CUDA-graph replays of {CALLS_PER_REPLAY} different uniform routings per replay (decode sizes), "
               "eager for prefill chunks; median of 5 rounds of CUDA events; random weights",
        "rows": rows, "agree": agree, "notes": notes, "fp16_clamped_values": int(paths.exl3.fp16_clamped),
        "expert_bytes_per_gpu_per_layer": mem,
        "expert_gib_per_gpu_model": {k: round(v * MOE_LAYERS / 2**30, 2) for k, v in mem.items()},
    }


def agreement(torch, paths, names: list[str], device) -> dict:
    """Relative difference of every EXL3 path from exl3_coop, and of coop (and the Triton path,
    where it was selected) from the dequantised torch reference (exllamav3's reconstruct of the
    touched experts). Only selected paths run: a path that faults takes the process with it."""
    from glmctl.plugin.quantization.exl3_experts import dequantize, moe_reference

    layer = paths.exl3
    out: dict = {}
    for tokens in (1, 8, 32):
        x, ids, w = routings(torch, tokens, 1, device, 99)[0]
        ref_fn, _, _ = paths.get("exl3_coop", [(x, ids, w)])
        ref = ref_fn(x, ids, w, 0).float()
        for name in dict.fromkeys(names):
            if name != "exl3_coop" and paths.supports(name, tokens):
                try:
                    fn, _, _ = paths.get(name, [(x, ids, w)])
                    out.setdefault(name, {})[tokens] = float((fn(x, ids, w, 0).float() - ref).norm() / ref.norm())
                except Exception as exc:
                    out.setdefault(name, {})[tokens] = f"{type(exc).__name__}: {str(exc)[:100]}"
        if tokens == 8:
            touched = ids.unique().tolist()
            deq = []
            for p in (layer.gate, layer.up, layer.down):
                full = torch.zeros((EXPERTS, p.in_features, p.out_features), device=device)
                for e in touched:
                    full[e] = dequantize(*p.expert(e), 4)
                deq.append(full)
            want = moe_reference(x.half().float(), ids, w, *deq, layer.act_limit)
            for name in ("exl3_coop", *(["exl3_triton"] if "exl3_triton" in names else [])):
                fn, _, _ = paths.get(name, [(x, ids, w)])
                out.setdefault("vs_dequantised_T8", {})[name] = float((fn(x, ids, w, 0).float() - want).norm()
                                                                      / want.norm())
            del deq
    layer.decode_kernel = "auto"
    return out


def table(result: dict) -> str:
    bw = result["copy_bw_bytes_per_s"]
    lines = [f"{result['what']} on {result['device']} (torch {result['torch']}, exllamav3 {result['exllamav3']}), "
             f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", "",
             "| path | tokens | mode | us | MB must move | frac_copy | experts |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['path']}{' ' + r['tag'] if r.get('tag') else ''} | {r['tokens']} | {r['mode']} | "
                     f"{r['us']} | {r['bytes'] / 1e6:.1f} | {r['frac_copy']:.3f} | {r['experts']} |")
    gib = result["expert_gib_per_gpu_model"]
    lines += ["", f"expert weights per GPU, whole model (43 MoE layers, TP8): EXL3 {gib['exl3']} GiB, "
                  f"block-FP8 {gib['fp8_block128']} GiB, bf16 {gib['bf16']} GiB"]
    for name, by_t in result["agree"].items():
        lines.append(f"agree {name}: " + ", ".join(f"{t}: {d:.1e}" if isinstance(d, float) else f"{t}: {d}"
                                                   for t, d in by_t.items()))
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def stem(args) -> str:
    return f"moe-bench{'-' + args.tag if args.tag else ''}"


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=ints, default=ints("1,2,4,8,16,32,48"))
    ap.add_argument("--paths", default=DEFAULT_PATHS, help="comma-separated names or fnmatch patterns")
    ap.add_argument("--sweep", default="", help="more paths, timed at --sweep-tokens only")
    ap.add_argument("--sweep-tokens", type=ints, default=ints("8,32"))
    ap.add_argument("--prefill", type=ints, default=ints("8192"))
    ap.add_argument("--prefill-paths", default="exl3_auto,fp8_torch,bf16_torch,fp8_vllm.vllm_default")
    ap.add_argument("--vllm-fused-moe", default=os.environ.get("VLLM_FUSED_MOE_PY"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--hot-experts", type=int, default=0,
                    help="route among the first N experts only (L2-resident weights: the compute ceiling)")
    ap.add_argument("--no-launches", action="store_true", help="skip the per-row profiler pass (kernel counts)")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    started = time.perf_counter()
    result = run(args)
    if args.warm or args.profile:
        print("\n".join(result["notes"]))
        return 0
    result["bench_seconds"] = round(time.perf_counter() - started, 1)
    text = table(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{stem(args)}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"{stem(args)}.md").write_text(text + "\n")
    print(json.dumps(result, indent=2) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
