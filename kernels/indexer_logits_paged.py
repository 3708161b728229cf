"""Lightning-indexer logits of decode queries against the paged kpool key cache.

``indexer_logits_paged(q_fp8, weights, kv_cache, block_table, context_lens, out)`` and
``indexer_logits_paged_ref`` (``out`` optional). DeepGEMM ``fp8_paged_mqa_logits`` semantics,
which is what vLLM 0.30 calls on Hopper:

* ``q_fp8``: ``[B, N, H, 128]`` float8_e4m3fn, ``N`` query tokens per request (1, or 1 + the MTP
  draft count; vLLM's "native" layout; the flattened layout is ``N = 1`` with one row per token),
  ``H`` indexer heads (vLLM zero-pads to 32).
* ``weights``: ``[B * N, H]`` fp32, per-head weights with q's dequant scale and
  ``softmax_scale * H ** -0.5`` already folded in (vLLM's ``_fused_indexer_weight_scale``).
* ``kv_cache``: ``[num_pages, page_pools, 132]`` uint8 pool cache (``layouts`` module doc).
* ``block_table``: ``[B, max_pages]`` int32, pool pages of each request.
* ``context_lens``: ``[B, N]`` int32, visible complete pools of each query token
  (``token_seq_len // kpool``, what vLLM's indexer metadata holds for a kpool cache).
* ``out``: ``[B * N, W]`` fp32; for ``p < context_lens[b, n]``:
  ``out[b*N + n, p] = scale[p] * sum_h weights[b*N + n, h] * relu(q[b, n, h] . k[p])`` with the fp8
  values multiplied exactly and summed in fp32. Columns at or past the context length are -inf
  in the reference and unspecified (not written) in the kernel; the top-k never reads them.

Kernel: a fixed grid (``num_programs`` + B programs, default 2 per SM: it never depends on the
lengths, so it can be captured in a CUDA graph). Every program reads the context lengths on the
device and gives each request a share of the programs in proportion to its ``BLOCK_N``-pool
tiles; a program then walks a contiguous run of one request's tiles (a branch-free loop that
Triton software-pipelines). A tile's keys are read once for all ``N`` query tokens and ``H``
heads of its request: one ``[BLOCK_N, 128] x [128, N*H]`` product with the keys as the M operand,
so the per-head weighted sum is a reduction along the product's columns. The fp8 values enter
the tensor cores as fp16 (exact) and products accumulate in fp32; Hopper's fp8 MMA accumulates
with too few bits for an indexer whose head sum cancels.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .layouts import INDEXER_HEAD_DIM, indexer_page_views
from .triton_env import dot_dtype, interpreting

# (BLOCK_N, num_warps, num_stages, prefetch); compiled for sm_89 in
# tests/unit/test_kernels_sm89.py. The configuration measured in bench/results/kernels-h200.md;
# the prefetching loop (prefetch=True) passes the GPU tests but has not been timed yet.
PAGED_CONFIG = (64, 4, 2, False)


@triton.jit
def _load_keys(kv_ptr, kv_f32_ptr, page, pools, ok, page_stride, PAGE_POOLS: tl.constexpr):
    """fp8 keys [BLOCK_N, 128] (as stored) and their fp32 scales, from each pool's page."""
    d = tl.arange(0, 128)
    slot = pools % PAGE_POOLS
    page_base = page.to(tl.int64) * page_stride
    k = tl.load(kv_ptr + page_base[:, None] + slot[:, None] * 128 + d[None, :], mask=ok[:, None],
                other=0.0)
    k_scale = tl.load(kv_f32_ptr + (page_base + PAGE_POOLS * 128) // 4 + slot, mask=ok,
                      other=0.0)
    return k, k_scale


@triton.jit
def _score_tile(k, k_scale, q, w, ctx, tile, out_ptr, out_rows, N: tl.constexpr,
                N_PAD: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    pools = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, N_PAD)
    scores = tl.maximum(tl.dot(k.to(DOT_DTYPE), tl.trans(q)), 0.0) * w[None, :]
    logits = tl.sum(tl.reshape(scores, [BLOCK_N, N_PAD, H]), axis=2) * k_scale[:, None]
    keep = (toks[None, :] < N) & (pools[:, None] < ctx[None, :])
    tl.store(out_ptr + out_rows[None, :] + pools[:, None], logits, mask=keep)


@triton.jit
def _indexer_logits_paged_kernel(
    q_ptr, w_ptr, kv_ptr, kv_f32_ptr, page_stride,
    bt_ptr, bt_stride, ctx_ptr, out_ptr, out_stride, num_req, num_programs,
    N: tl.constexpr, N_PAD: tl.constexpr, H: tl.constexpr, PAGE_POOLS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    # Programs per request in proportion to its tiles (>= 1 if it has any, <= its tiles).
    reqs = tl.arange(0, BLOCK_B)
    live = reqs < num_req
    longest = tl.zeros([BLOCK_B], tl.int32)
    for n in tl.static_range(N):
        longest = tl.maximum(longest, tl.load(ctx_ptr + reqs * N + n, mask=live, other=0))
    tiles = tl.where(live, (longest + BLOCK_N - 1) // BLOCK_N, 0)
    total = tl.maximum(tl.sum(tiles, axis=0), 1)
    share = tl.where(tiles > 0, tl.maximum((tiles * num_programs) // total, 1), 0)
    share = tl.minimum(share, tiles)
    ends = tl.cumsum(share, axis=0)
    if pid < tl.sum(share, axis=0):
        req = tl.sum((ends <= pid).to(tl.int32), axis=0)
        mine = reqs == req
        rank = pid - tl.sum(tl.where(reqs < req, share, 0), axis=0)
        req_tiles = tl.sum(tl.where(mine, tiles, 0), axis=0)
        req_share = tl.sum(tl.where(mine, share, 0), axis=0)
        per = (req_tiles + req_share - 1) // req_share
        first = rank * per
        last = tl.minimum(first + per, req_tiles)

        cols = tl.arange(0, N_PAD * H)  # query column = n * H + h
        col_ok = cols < N * H
        d = tl.arange(0, 128)
        base = req.to(tl.int64) * N * H
        q = tl.load(q_ptr + (base + cols[:, None]) * 128 + d[None, :], mask=col_ok[:, None],
                    other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptr + base + cols, mask=col_ok, other=0.0)
        toks = tl.arange(0, N_PAD)
        ctx = tl.load(ctx_ptr + req * N + toks, mask=toks < N, other=0)
        ctx_max = tl.max(ctx, axis=0)
        out_rows = (req * N + toks).to(tl.int64) * out_stride
        bt_row = bt_ptr + req.to(tl.int64) * bt_stride
        if PREFETCH:
            # Register double buffering: keys of tile i+1 load while tile i is scored; page
            # numbers two tiles ahead (each tile's keys depend on its page-table entry).
            # Pools past the program's last tile are masked like pools past the context.
            limit = tl.minimum(ctx_max, last * BLOCK_N)
            pools = first * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = pools < limit
            page = tl.load(bt_row + pools // PAGE_POOLS, mask=ok, other=0)
            k_next, scale_next = _load_keys(kv_ptr, kv_f32_ptr, page, pools, ok, page_stride,
                                            PAGE_POOLS)
            pools = (first + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
            page_next = tl.load(bt_row + pools // PAGE_POOLS, mask=pools < limit, other=0)
            for tile in range(first, last):
                k, k_scale = k_next, scale_next
                pools = (tile + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
                ok = pools < limit
                k_next, scale_next = _load_keys(kv_ptr, kv_f32_ptr, page_next, pools, ok,
                                                page_stride, PAGE_POOLS)
                pools = (tile + 2) * BLOCK_N + tl.arange(0, BLOCK_N)
                page_next = tl.load(bt_row + pools // PAGE_POOLS, mask=pools < limit, other=0)
                _score_tile(k, k_scale, q, w, ctx, tile, out_ptr, out_rows, N, N_PAD, H, BLOCK_N,
                            DOT_DTYPE)
        else:
            for tile in range(first, last):
                pools = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                ok = pools < ctx_max
                page = tl.load(bt_row + pools // PAGE_POOLS, mask=ok, other=0)
                k, k_scale = _load_keys(kv_ptr, kv_f32_ptr, page, pools, ok, page_stride,
                                        PAGE_POOLS)
                _score_tile(k, k_scale, q, w, ctx, tile, out_ptr, out_rows, N, N_PAD, H, BLOCK_N,
                            DOT_DTYPE)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_programs(device: torch.device) -> int:
    """Two programs per SM (4 on CPU / under the interpreter)."""
    if device.type != "cuda" or interpreting():
        return 4
    return 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def indexer_logits_paged(q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, context_lens: torch.Tensor,
                         out: torch.Tensor, num_programs: int | None = None) -> torch.Tensor:
    """Triton kernel; same contract as :func:`indexer_logits_paged_ref` (see module doc)."""
    num_req, next_n, heads, dim = q_fp8.shape
    assert dim == INDEXER_HEAD_DIM and q_fp8.is_contiguous() and weights.is_contiguous()
    assert context_lens.is_contiguous() and context_lens.numel() == num_req * next_n
    assert out.stride(1) == 1 and block_table.stride(1) == 1
    if num_req == 0:
        return out
    page_values, _ = indexer_page_views(kv_cache)
    block_n, num_warps, num_stages, prefetch = PAGED_CONFIG
    if num_programs is None:
        num_programs = default_num_programs(q_fp8.device)
    _indexer_logits_paged_kernel[(num_programs + num_req,)](
        q_fp8, weights, kv_cache.view(torch.float8_e4m3fn), kv_cache.view(torch.float32),
        kv_cache.stride(0), block_table, block_table.stride(0), context_lens, out, out.stride(0),
        num_req, num_programs,
        N=next_n, N_PAD=triton.next_power_of_2(next_n), H=heads, PAGE_POOLS=kv_cache.shape[1],
        BLOCK_N=block_n, BLOCK_B=max(16, triton.next_power_of_2(num_req)),
        DOT_DTYPE=dot_dtype(tl.float16), PREFETCH=prefetch,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def indexer_logits_paged_ref(q_fp8: torch.Tensor, weights: torch.Tensor,
                             kv_cache: torch.Tensor, block_table: torch.Tensor,
                             context_lens: torch.Tensor, out: torch.Tensor | None = None, *,
                             compute_dtype: torch.dtype = torch.float32,
                             chunk_pools: int = 4096) -> torch.Tensor:
    """Torch reference: gather each request's pools page by page, score in fp32, chunked."""
    num_req, next_n, num_heads, dim = q_fp8.shape
    page_values, page_scales = indexer_page_views(kv_cache)
    page_pools = kv_cache.shape[1]
    width = out.shape[1] if out is not None else block_table.shape[1] * page_pools
    if out is None:
        out = torch.empty((num_req * next_n, width), dtype=torch.float32, device=q_fp8.device)
    out.fill_(float("-inf"))
    lens = context_lens.reshape(num_req, next_n).long()
    q = q_fp8.to(compute_dtype)
    w = weights.reshape(num_req, next_n, num_heads).to(compute_dtype)
    longest = int(lens.max().item()) if lens.numel() else 0
    for lo in range(0, min(longest, width), chunk_pools):
        pools = torch.arange(lo, min(width, lo + chunk_pools), device=q_fp8.device)
        pages = block_table[:, pools // page_pools].long().clamp_min(0)  # [B, P]
        slots = (pools % page_pools)[None, :].expand_as(pages)
        keys = page_values[pages, slots].to(compute_dtype)  # [B, P, 128]
        scales = page_scales[pages, slots].to(compute_dtype)  # [B, P]
        scores = torch.relu(torch.einsum("bnhd,bpd->bnhp", q, keys))
        logits = torch.einsum("bnhp,bnh->bnp", scores, w) * scales[:, None, :]
        visible = pools[None, None, :] < lens[:, :, None]
        chunk = torch.where(visible, logits, float("-inf")).reshape(num_req * next_n, -1)
        out[:, lo : lo + pools.numel()] = chunk.to(out.dtype)
    return out
