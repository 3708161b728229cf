"""Reproduce (or clear) the kernels run-4 crash: "illegal memory access" at the first bf16 sparse-MLA
decode case at 240k context, 32 sessions (an ~8 GB latent cache). Runs that exact case with
a synchronize after every step, checks the output against the torch
reference on every row, eagerly and after 20 CUDA-graph replays (as the bench timed it), then
repeats the case at 2x the cache to cross the 2^32-element mark.

    python3 bench/gpu/repro_decode_240k.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from glmctl.kernels.sparse_mla_decode import (
    plan_sparse_mla_decode,
    sparse_mla_decode,
    sparse_mla_decode_ref,
    sparse_mla_decode_workspace,
)

# bench/kernels.py by path (the repository's kernels/ package has the same name): its cache fill
# and selection are the ones that crashed.
_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).parents[1] / "kernels.py")
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)


def case(sessions: int, per: int, ctx: int, fmt: str) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cache = kb.latent_cache(fmt, sessions * ctx)
    torch.cuda.synchronize()
    rows = sessions * per
    sess = torch.arange(rows, device=kb.DEV) // per
    idx = kb.selection(rows, ctx, sess)
    q = torch.randn(rows, kb.HEADS_TP8, 512, device=kb.DEV).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(rows, kb.HEADS_TP8, device=kb.DEV)
    plan = plan_sparse_mla_decode(rows, kb.HEADS_TP8, kb.WIDTH, sms, kv_format=fmt)
    ws = sparse_mla_decode_workspace([plan], kb.DEV)
    sparse_mla_decode(q, cache, idx, kb.SCALE, out, lse, plan, ws)
    torch.cuda.synchronize()
    ref, ref_lse = sparse_mla_decode_ref(q, cache, idx, kb.SCALE)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{fmt} sessions={sessions} x {per} ctx={ctx}: cache {cache.numel() * cache.element_size() / 2**30:.1f} GiB, "
          f"rows {cache.shape[0] * cache.shape[1]:,}, rel err {err:.2e}, nan {int(out.isnan().sum())}", flush=True)
    assert err < 2e-2 and not out.isnan().any()
    # As bench/kernels.py timed it: captured in a CUDA graph, replayed, with new queries each time.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_decode(q, cache, idx, kb.SCALE, out, lse, plan, ws)
    for _ in range(20):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
        graph.replay()
    torch.cuda.synchronize()
    ref, _ = sparse_mla_decode_ref(q, cache, idx, kb.SCALE)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"  after 20 graph replays with new queries: rel err {err:.2e}", flush=True)
    assert err < 2e-2
    del graph, cache
    torch.cuda.empty_cache()


if __name__ == "__main__":
    case(32, 4, kb.CONTEXTS["240k"], "bf16")
    case(32, 4, kb.CONTEXTS["240k"], "fp8_ds_mla")
    case(64, 1, kb.CONTEXTS["240k"], "bf16")  # ~15.7M rows x 512 bf16 = 8.05e9 elements > 2^32
    print("no crash")
