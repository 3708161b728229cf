"""mHC blocks at GLM-5.3-Flash's shape (4 streams x 4096, 20 Sinkhorn iterations): glmctl's Triton
kernels vs vLLM 0.30's torch path (what the engine runs on CUDA without tilelang), and optionally
a baseline copy of glmctl's kernel module (``--baseline FILE.py``, e.g. the previous version) for
an A/B. Each path runs CHAIN blocks back to back in one CUDA graph (as a decode step runs ~90 of
them in one stream), replayed; the figure is the median replay over CHAIN (torch.cuda.Event), so
graph-launch overhead is spread as it is in the model. A decode step of the reference node runs
89 fused post+pre blocks, 1 pre and 1 post per rank.

    python bench/mhc.py [--out FILE.json] [--baseline FILE.py] [--chain 20] [--sweep]

``--sweep`` also times every candidate partials tile and finalize warp count at the decode sizes
(the table the decode config is picked from).

Prints one row per token count: µs per fused block for each path and the ratio; the bytes each
block must move (residual in and out, fn once) over the measured copy bandwidth give the floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

N, H = 4, 4096
GATES = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0,
             sinkhorn_repeat=20)


def _inputs(t):
    d = "cuda"
    return dict(
        x=torch.randn(t, H, device=d).to(torch.bfloat16),
        residual=torch.randn(t, N, H, device=d).to(torch.bfloat16),
        post=torch.rand(t, N, 1, device=d) * 2,
        comb=torch.softmax(torch.randn(t, N, N, device=d), -1),
        fn=torch.randn(N * (N + 2), N * H, device=d) * (N * H) ** -0.5,
        scale=torch.rand(3, device=d) + 0.5,
        base=torch.randn(N * (N + 2), device=d) * 0.3,
        weight=torch.ones(H, device=d, dtype=torch.bfloat16),
    )


def _triton(a, module=None):
    if module is None:
        from glmctl.kernels import mhc_pre_post as module
    mhc_fused_post_pre = module.mhc_fused_post_pre

    return lambda: mhc_fused_post_pre(a["x"], a["residual"], a["post"], a["comb"], a["fn"],
                                      a["scale"], a["base"], **GATES, norm_weight=a["weight"],
                                      norm_eps=1e-5)


def _torch(a):
    from glmctl.kernels.mhc_pre_post import rms_norm_ref
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_torch

    def run():
        cur = mhc_post_torch(a["x"], a["residual"], a["post"], a["comb"])
        post, comb, lin = mhc_pre_torch(cur, a["fn"], a["scale"], a["base"], **GATES)
        return cur, post, comb, rms_norm_ref(lin, a["weight"], 1e-5)

    return run


def graph_us(fn, replays=50, chain=1) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(chain):
            fn()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / chain)
    return statistics.median(times)


def copy_gbps() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a), replays=10)
    return 2 * a.numel() / us / 1e3


SWEEP_TILES = ((16, 32, 4), (16, 64, 4), (16, 16, 2), (16, 32, 2), (16, 64, 8), (32, 32, 4))
SWEEP_TOKENS = (4, 32)


def _sweep(chain: int) -> list[dict]:
    """Per-block time of each candidate tile (partials) x finalize warps at the decode sizes."""
    from glmctl.kernels import mhc_pre_post as k

    pick, warps = k.mix_config, k.finalize_warps
    rows = []
    try:
        for t in SWEEP_TOKENS:
            a = _inputs(t)
            for bt, bh, w in SWEEP_TILES:
                for fw in (4, 8):
                    cfg = k.MixConfig(f"{bt}x{bh}w{w}", bt, bh, w)
                    k.mix_config = lambda _t, cfg=cfg: cfg
                    k.finalize_warps = lambda _h, fw=fw: fw
                    try:
                        us = round(graph_us(_triton(a), chain=chain), 2)
                    except Exception as exc:  # a tile the compiler refuses: say so, go on
                        us = f"error {type(exc).__name__}"
                    rows.append(dict(tokens=t, config=f"{cfg.name} fin{fw}", us=us))
    finally:
        k.mix_config, k.finalize_warps = pick, warps
    return rows


def _load_module(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mhc_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tokens", default="1,4,8,32,48,2048")
    ap.add_argument("--baseline", help="a copy of an earlier kernels/mhc_pre_post.py to compare")
    ap.add_argument("--chain", type=int, default=20, help="blocks per captured graph")
    ap.add_argument("--sweep", action="store_true", help="time candidate decode configs too")
    args = ap.parse_args()
    base = _load_module(args.baseline) if args.baseline else None
    bw = copy_gbps()
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        a = _inputs(t)
        chain = args.chain if t <= 128 else 2
        tri, tor = graph_us(_triton(a), chain=chain), graph_us(_torch(a), chain=chain)
        moved = t * N * H * 2 * 2 + t * H * 2 + a["fn"].numel() * 4 + t * H * 2
        row = dict(tokens=t, triton_us=round(tri, 2), torch_us=round(tor, 2),
                   speedup=round(tor / tri, 2), floor_us=round(moved / bw / 1e3, 2))
        if base is not None:
            row["baseline_us"] = round(graph_us(_triton(a, base), chain=chain), 2)
            new, old = _triton(a)(), _triton(a, base)()
            row["max_diff_vs_baseline"] = max(float((x.float() - y.float()).abs().max())
                                              for x, y in zip(new, old, strict=True))
        rows.append(row)
    sweep = _sweep(args.chain) if args.sweep else []
    result = dict(device=torch.cuda.get_device_name(0), copy_GBps=round(bw, 1),
                  torch_version=torch.__version__, sweep=sweep,
                  method=f"CUDA graph of {args.chain} chained blocks (2 at 2,048 tokens) replayed, "
                         "median of 50 replays / chain",
                  rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"mHC fused post+pre, {result['device']}, copy {bw:.0f} GB/s")
    print(f"{'tokens':>7} {'triton us':>10} {'baseline us':>11} {'torch us':>10} {'x':>6} "
          f"{'floor us':>9} {'diff':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['triton_us']:>10} {r.get('baseline_us', '-'):>11} "
              f"{r['torch_us']:>10} {r['speedup']:>6} {r['floor_us']:>9} "
              f"{r.get('max_diff_vs_baseline', '-'):>8}")
    for r in sweep:
        print(f"sweep t={r['tokens']:<3} {r['config']:<24} {r['us']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
