"""Shared pieces of the kernel benchmarks: timing, the copy-bandwidth probe, and TP8 decode inputs
(latent caches in the three layouts, index rows, indexer pool caches)."""

from __future__ import annotations

import time

import torch
from glmctl.kernels.mla_cache_write import mla_cache_write

DEV = torch.device("cuda")
TOPK, KPOOL, WIDTH, SELECTED = 2048, 16, 2176, 2048 + 15
HEADS_TP8, INDEX_HEADS, PAGE_POOLS = 8, 32, 64
SCALE = 0.0883883
CONTEXTS = {"22k": 22 * 1024, "64k": 64 * 1024, "240k": 240 * 1024}
ROW_BYTES = {"fp8": 512, "fp8_ds_mla": 656, "bf16": 1024}
DEADLINE = [float("inf")]  # wall-clock time after which remaining cases are skipped
_KV_SCALE: dict = {}


def kv_scale(fmt: str):
    """The fp8 layout's per-tensor scale (a device scalar, as vLLM's layer._k_scale)."""
    if fmt != "fp8":
        return None
    if "fp8" not in _KV_SCALE:
        _KV_SCALE["fp8"] = torch.tensor(0.0173, device=DEV)
    return _KV_SCALE["fp8"]


def check_deadline():
    if time.time() > DEADLINE[0]:
        raise TimeoutError("deadline reached; remaining cases skipped")


def graph_time(fn, iters=20, reps=5, statistic=min) -> float:
    """Seconds per call: ``iters`` calls captured in one CUDA graph, ``statistic`` (best by
    default) of ``reps`` replays."""
    check_deadline()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    del graph
    return statistic(times)


def graph_calls_us(calls, replays: int = 7) -> float:
    """Microseconds per call: one CUDA graph running every call of ``calls`` once (e.g. one layer's
    kernel over many layers' weights, so they stream from memory), median of ``replays`` replays
    over the number of calls."""
    check_deadline()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (JIT, allocator) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    times.sort()
    return times[len(times) // 2] / len(calls)


def eager_time(fn, reps=3) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def copy_bandwidth() -> tuple[float, dict]:
    """Best of an eager D2D ``copy_`` and an SM copy kernel (an elementwise multiply) of 2 GiB,
    counting bytes read + written. (A copy captured in a CUDA graph becomes a copy-engine memcpy
    node, slower than what kernels stream; not used.)"""
    src = torch.randn(512 << 20, device=DEV)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * 4
    found = {"eager_copy": moved / eager_time(lambda: dst.copy_(src), reps=5),
             "sm_kernel_copy": moved / eager_time(lambda: torch.mul(src, 1.0, out=dst), reps=5)}
    return max(found.values()), found


def latent_cache(fmt: str, tokens: int, fill: bool = True) -> torch.Tensor:
    """A [blocks, 64, row] latent cache filled by the Triton cache writer (fp8: vLLM's uint8
    storage viewed as float8_e4m3fn, as its attention layer hands it over). ``fill=False``
    leaves it unwritten (compile-only runs: the kernels' code does not depend on the values)."""
    block = 64
    blocks = -(-tokens // block)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.uint8
    cache = torch.empty(blocks, block, ROW_BYTES[fmt] // dtype.itemsize, dtype=dtype, device=DEV)
    step = 1 << 18  # rows per write: 0.5 GiB of fp32 noise at a time
    for lo in range(0, blocks * block if fill else 0, step):
        hi = min(blocks * block, lo + step)
        latent = torch.randn(hi - lo, 512, device=DEV).to(torch.bfloat16)
        mla_cache_write(latent, torch.arange(lo, hi, device=DEV), cache, kv_scale(fmt))
    return cache.view(torch.float8_e4m3fn) if fmt == "fp8" else cache


def selection(rows: int, context: int, session_of_row: torch.Tensor) -> torch.Tensor:
    """128 random whole pools + the 15-token tail per row, inside the row's session region."""
    pools = context // KPOOL
    idx = torch.full((rows, WIDTH), -1, dtype=torch.int32, device=DEV)
    for lo in range(0, rows, 2048):
        hi = min(rows, lo + 2048)
        chosen = torch.rand(hi - lo, pools, device=DEV).argsort(dim=1)[:, : TOPK // KPOOL]
        tok = (chosen[:, :, None] * KPOOL + torch.arange(KPOOL, device=DEV)).reshape(hi - lo, -1)
        idx[lo:hi, :TOPK] = (tok + (session_of_row[lo:hi, None] * context)).int()
    tail = pools * KPOOL - 15 + torch.arange(15, device=DEV)
    idx[:, TOPK : TOPK + 15] = (tail[None, :] + session_of_row[:, None] * context).int()
    return idx


def decode_inputs(sessions: int, per: int, context: int):
    """(q, indices, out, lse) for ``sessions`` x ``per`` query rows at TP8."""
    rows = sessions * per
    idx = selection(rows, context, torch.arange(rows, device=DEV) // per)
    q = torch.randn(rows, HEADS_TP8, 512, device=DEV).to(torch.bfloat16)
    return q, idx, torch.empty_like(q), torch.empty(rows, HEADS_TP8, device=DEV)


def mla_bytes(rows, heads, fmt):
    """Selected rows x row bytes + queries + outputs + lse."""
    return rows * SELECTED * ROW_BYTES[fmt] + 2 * rows * heads * 512 * 2 + rows * heads * 4


def pool_cache(pages):
    """Indexer pool pages [values | scales] of random e4m3 keys with power-of-two scales."""
    cache = torch.empty(pages, PAGE_POOLS, 132, dtype=torch.uint8, device=DEV)
    flat = cache.view(pages, -1)
    flat[:, : PAGE_POOLS * 128] = torch.randn(pages, PAGE_POOLS * 128, device=DEV).to(
        torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.exp2(torch.randint(-9, -3, (pages, PAGE_POOLS), device=DEV).float())
    flat[:, PAGE_POOLS * 128 :] = scales.view(torch.uint8).view(pages, -1)
    return cache


def indexer_inputs(requests: int, next_n: int, context: int):
    """(q, w, cache, block_table, context_pools [B, N], token lengths [B*N], logits out)."""
    pools = context // KPOOL
    pages = -(-pools // PAGE_POOLS)
    cache = pool_cache(requests * pages)
    block_table = torch.randperm(requests * pages, device=DEV).view(requests, pages).int()
    q = torch.randn(requests, next_n, INDEX_HEADS, 128, device=DEV).to(torch.float8_e4m3fn)
    w = torch.randn(requests * next_n, INDEX_HEADS, device=DEV) * 0.1
    tok_len = (context - next_n + 1 + torch.arange(next_n, device=DEV)).repeat(requests).int()
    ctx = (tok_len // KPOOL).int().view(requests, next_n).contiguous()
    logits = torch.empty(requests * next_n, pages * PAGE_POOLS, device=DEV)
    return q, w, cache, block_table, ctx, tok_len, logits


def indexer_bytes(requests, next_n, pools):
    """Pooled keys (132 B per pool per request) + logits written + queries + weights."""
    rows = requests * next_n
    return requests * pools * 132 + rows * pools * 4 + rows * INDEX_HEADS * (128 + 4)
