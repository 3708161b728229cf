"""mHC blocks at GLM-5.3-Flash's shape (4 streams x 4096, 20 Sinkhorn iterations): glmctl's Triton
kernels, the one-launch decode path (``fused``, the default up to 64 tokens) against the
two-launch pair (``split``), vLLM 0.30's torch path (what the engine runs on CUDA without
tilelang), and optionally a baseline copy of glmctl's kernel module (``--baseline FILE.py``, e.g.
main's kernels/mhc_pre_post.py) for an A/B.

Each path runs CHAIN fused post+pre blocks back to back in one CUDA graph (a decode step runs ~90
of them in one stream), replayed; the figure is the median replay over CHAIN (torch.cuda.Event).
Every block of the chain has its own mixer weights (fn, 1.5 MiB fp32) and residual streams, as
the model's layers do: 40 blocks' weights exceed the L2, so each block reads its fn from memory as
in a decode step, not from the previous block's cache lines.

    python bench/mhc.py [--out FILE.json] [--baseline FILE.py] [--chain 40] [--sweep]

``--sweep`` also times candidate one-launch configs at 4 and 32 tokens (the table the defaults
in kernels/mhc_decode.py are picked from). Prints the per-block table last: µs per block for
each path, fused/split and fused/baseline ratios, and the floor (the bytes a block must move over
the measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

N, H = 4, 4096
GATES = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0,
             sinkhorn_repeat=20)


def _blocks(t: int, count: int) -> list[dict]:
    """Inputs of `count` distinct blocks at `t` tokens."""
    d = "cuda"
    out = []
    for _ in range(count):
        out.append(dict(
            x=torch.randn(t, H, device=d).to(torch.bfloat16),
            residual=torch.randn(t, N, H, device=d).to(torch.bfloat16),
            post=torch.rand(t, N, 1, device=d) * 2,
            comb=torch.softmax(torch.randn(t, N, N, device=d), -1),
            fn=torch.randn(N * (N + 2), N * H, device=d) * (N * H) ** -0.5,
            scale=torch.rand(3, device=d) + 0.5,
            base=torch.randn(N * (N + 2), device=d) * 0.3,
            weight=(1 + 0.1 * torch.randn(H, device=d)).to(torch.bfloat16),
        ))
    return out


def _triton(a, module=None, decode=None):
    if module is None:
        from glmctl.kernels import mhc_pre_post as module
    kw = {} if decode is None else dict(decode=decode)

    return lambda: module.mhc_fused_post_pre(a["x"], a["residual"], a["post"], a["comb"],
                                             a["fn"], a["scale"], a["base"], **GATES,
                                             norm_weight=a["weight"], norm_eps=1e-5, **kw)


def _torch(a):
    from glmctl.kernels.mhc_pre_post import rms_norm_ref
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_torch

    def run():
        cur = mhc_post_torch(a["x"], a["residual"], a["post"], a["comb"])
        post, comb, lin = mhc_pre_torch(cur, a["fn"], a["scale"], a["base"], **GATES)
        return cur, post, comb, rms_norm_ref(lin, a["weight"], 1e-5)

    return run


def graph_us(fns, replays=50) -> float:
    """Median µs per call of `fns` (one callable per block) captured back to back in one graph."""
    for _ in range(2):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(fns))
    return statistics.median(times)


def copy_gbps() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_us([lambda: b.copy_(a)], replays=10)
    return 2 * a.numel() / us / 1e3


def _max_diff(new, old) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(new, old, strict=True))


def _sweep(chain: int) -> list[dict]:
    from glmctl.kernels import mhc_decode

    rows = []
    blocks = {}
    for t, cfg in mhc_decode.FUSED_CANDIDATES:
        blocks.setdefault(t, _blocks(t, chain))
        try:
            us = round(graph_us([_triton(a, decode=cfg) for a in blocks[t]]), 2)
        except Exception as exc:  # a config the compiler refuses: say so, go on
            us = f"error {type(exc).__name__}"
        default = mhc_decode.pick_config(t)
        rows.append(dict(tokens=t, config=f"{cfg.name} (bt{cfg.block_t} bh{cfg.block_h} "
                                          f"s{cfg.splits} fin{cfg.fin_h} w{cfg.num_warps})",
                         us=us, default=default.name if default else None))
    return rows


def _load_module(path):
    """A kernel module from a file, as a member of glmctl.kernels (so that its relative imports
    find the current siblings)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("glmctl.kernels._mhc_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "mhc.json"))
    ap.add_argument("--tokens", default="1,4,32,2048")
    ap.add_argument("--baseline", help="a copy of an earlier kernels/mhc_pre_post.py to compare")
    ap.add_argument("--chain", type=int, default=40, help="blocks per captured graph")
    ap.add_argument("--sweep", action="store_true", help="time candidate one-launch configs too")
    ap.add_argument("--no-torch", action="store_true", help="skip vLLM's torch path")
    args = ap.parse_args()
    from glmctl.kernels import mhc_decode

    base = _load_module(args.baseline) if args.baseline else None
    bw = copy_gbps()
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        blocks = _blocks(t, args.chain if t <= 128 else 2)
        cfg = mhc_decode.pick_config(t)
        row = dict(tokens=t, fused_config=cfg.name if cfg else None)
        row["split_us"] = round(graph_us([_triton(a, decode="split") for a in blocks]), 2)
        if cfg is not None:
            row["fused_us"] = round(graph_us([_triton(a, decode="fused") for a in blocks]), 2)
            row["fused_vs_split_max_diff"] = _max_diff(_triton(blocks[0], decode="fused")(),
                                                       _triton(blocks[0], decode="split")())
        if base is not None:
            row["baseline_us"] = round(graph_us([_triton(a, base) for a in blocks]), 2)
            row["max_diff_vs_baseline"] = _max_diff(_triton(blocks[0])(),
                                                    _triton(blocks[0], base)())
        if not args.no_torch:
            row["torch_us"] = round(graph_us([_torch(a) for a in blocks]), 2)
        moved = t * N * H * 2 * 2 + t * H * 2 + blocks[0]["fn"].numel() * 4 + t * H * 2
        row["floor_us"] = round(moved / bw / 1e3, 2)
        rows.append(row)
        del blocks
    sweep = _sweep(args.chain) if args.sweep else []
    result = dict(device=torch.cuda.get_device_name(0), copy_GBps=round(bw, 1),
                  torch_version=torch.__version__,
                  method=f"CUDA graph of {args.chain} chained fused post+pre blocks (2 at more "
                         "than 128 tokens), each with its own fn and residuals, replayed; median "
                         "of 50 replays / chain",
                  rows=rows, sweep=sweep)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in sweep:
        print(f"sweep t={r['tokens']:<3} {r['config']:<40} {r['us']:>8} us "
              f"(default at {r['tokens']} tokens: {r['default']})")
    print(f"mHC fused post+pre per block, {result['device']}, copy {bw:.0f} GB/s "
          f"(us per block; fused = one launch, split = two launches)")
    print(f"{'tokens':>7} {'config':>7} {'fused':>8} {'split':>8} {'baseline':>9} {'torch':>8} "
          f"{'split/fused':>11} {'base/fused':>10} {'floor':>6} {'diff':>8}")
    for r in rows:
        fused = r.get("fused_us")
        best = fused if fused is not None else r["split_us"]
        ratio = f"{r['split_us'] / fused:.2f}" if fused else "-"
        bratio = f"{r['baseline_us'] / best:.2f}" if "baseline_us" in r else "-"
        diff = r.get("fused_vs_split_max_diff")
        diff = "-" if diff is None else f"{diff:.1e}"
        print(f"{r['tokens']:>7} {r['fused_config'] or '-':>7} {fused or '-':>8} "
              f"{r['split_us']:>8} {r.get('baseline_us', '-'):>9} {r.get('torch_us', '-'):>8} "
              f"{ratio:>11} {bratio:>10} {r['floor_us']:>6} {diff:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
