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

Kernels (graph safe: lengths are read on the device; no allocation, no host sync):

* page grid (the default, :data:`PAGED_CONFIGS`): grid ``(B, cdiv(max_pools, block_n * tiles))``
  with ``max_pools`` = the block table's width x ``page_pools``, so it is fixed for a captured
  batch size (it depends on B and the block table's width only); a program scores ``tiles``
  consecutive ``block_n``-pool tiles of one request and programs past the request's context exit
  at once. Many small programs keep many page reads in flight.
* balanced: a fixed grid (``num_programs`` + B programs, default 2 per SM); every program reads
  the context lengths and gives each request a share of the programs in proportion to its
  ``BLOCK_N``-pool tiles, then walks a contiguous run of one request's tiles.

In both, a tile's keys are read once for all ``N`` query tokens and ``H`` heads of its request:
one ``[BLOCK_N, 128] x [128, N*H]`` product with the keys as the M operand, so the per-head
weighted sum is a reduction along the product's columns. The fp8 values enter the tensor cores
as fp16 (exact) and products accumulate in fp32; Hopper's fp8 MMA accumulates with too few bits
for an indexer whose head sum cancels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .layouts import INDEXER_HEAD_DIM, indexer_page_views
from .triton_env import dot_dtype, interpreting

# The balanced kernel's (BLOCK_N, num_warps, num_stages, prefetch), as measured in
# bench/results/kernels-h200.md.
PAGED_CONFIG = (64, 4, 2, False)

KERNEL_BALANCED = "balanced"
KERNEL_PAGE_GRID = "page_grid"


@dataclass(frozen=True)
class PagedLogitsConfig:
    """A launch configuration of the paged logits: ``kernel`` is ``KERNEL_PAGE_GRID`` (grid
    ``(B, cdiv(max_pools, block_n * tiles))``: a program scores ``tiles`` consecutive tiles of
    ``block_n`` pools of one request) or ``KERNEL_BALANCED`` (the fixed grid of ``PAGED_CONFIG``
    sharing programs between requests by their lengths)."""

    name: str
    kernel: str = KERNEL_PAGE_GRID
    block_n: int = 64
    tiles: int = 1
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = False


def _grid_cfg(block_n, tiles, warps, stages, prefetch=False):
    return PagedLogitsConfig(f"grid-n{block_n}-t{tiles}-w{warps}-s{stages}"
                             f"{'-prefetch' if prefetch else ''}", KERNEL_PAGE_GRID, block_n,
                             tiles, warps, stages, prefetch)


BALANCED = PagedLogitsConfig("balanced", KERNEL_BALANCED, block_n=PAGED_CONFIG[0],
                             num_warps=PAGED_CONFIG[1], num_stages=PAGED_CONFIG[2],
                             prefetch=PAGED_CONFIG[3])
# The shipped configuration per query tokens per request (1, or 1 + MTP drafts), and what the
# bench sweeps; each is compiled for sm_89 in tests/unit/test_kernels_sm89.py. Chosen with Ada's
# instructions on the H200 (mma.sync, no wgmma; bench/results/kernels-h200.md) at 240k: one
# token, four 64-pool tiles per program (8 / 32 requests: 8.8 / 31.2 us against 9.3 / 32.7 us
# for two tiles); four tokens (MTP), 32-pool tiles with 2 warps (22.9 us against 29.3 us). The
# grid depends on the batch size and the block table's width only.
PAGED_CONFIGS = {1: _grid_cfg(64, 4, 4, 2), 4: _grid_cfg(32, 4, 2, 2)}
PAGED_CANDIDATES = [
    BALANCED,
    _grid_cfg(64, 1, 4, 1),
    _grid_cfg(64, 2, 4, 2),
    _grid_cfg(64, 4, 4, 2),
    _grid_cfg(64, 4, 4, 3),
    _grid_cfg(64, 4, 4, 1, prefetch=True),
    _grid_cfg(128, 2, 8, 2),
    _grid_cfg(32, 4, 2, 2),
]


def paged_config(next_n: int) -> PagedLogitsConfig:
    """The shipped configuration for ``next_n`` query tokens per request."""
    fitting = sorted(n for n in PAGED_CONFIGS if n >= next_n)
    return PAGED_CONFIGS[fitting[0] if fitting else max(PAGED_CONFIGS)]


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


@triton.jit
def _indexer_logits_page_grid_kernel(
    q_ptr, w_ptr, kv_ptr, kv_f32_ptr, page_stride,
    bt_ptr, bt_stride, ctx_ptr, out_ptr, out_stride,
    N: tl.constexpr, N_PAD: tl.constexpr, H: tl.constexpr, PAGE_POOLS: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Program (request, chunk): tiles [chunk * TILES, + TILES) of the request; programs past
    the request's longest context exit at once (the grid is fixed by the block table's width)."""
    req = tl.program_id(0)
    first = tl.program_id(1) * TILES
    toks = tl.arange(0, N_PAD)
    ctx = tl.load(ctx_ptr + req * N + toks, mask=toks < N, other=0)
    ctx_max = tl.max(ctx, axis=0)
    if first * BLOCK_N < ctx_max:
        last = tl.minimum(first + TILES, (ctx_max + BLOCK_N - 1) // BLOCK_N)
        cols = tl.arange(0, N_PAD * H)  # query column = n * H + h
        col_ok = cols < N * H
        d = tl.arange(0, 128)
        base = req.to(tl.int64) * N * H
        q = tl.load(q_ptr + (base + cols[:, None]) * 128 + d[None, :], mask=col_ok[:, None],
                    other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptr + base + cols, mask=col_ok, other=0.0)
        out_rows = (req * N + toks).to(tl.int64) * out_stride
        bt_row = bt_ptr + req.to(tl.int64) * bt_stride
        if PREFETCH:
            pools = first * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = pools < ctx_max
            page = tl.load(bt_row + pools // PAGE_POOLS, mask=ok, other=0)
            k_next, scale_next = _load_keys(kv_ptr, kv_f32_ptr, page, pools, ok, page_stride,
                                            PAGE_POOLS)
            for tile in range(first, last):
                k, k_scale = k_next, scale_next
                pools = (tile + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
                ok = pools < tl.minimum(ctx_max, last * BLOCK_N)
                page = tl.load(bt_row + pools // PAGE_POOLS, mask=ok, other=0)
                k_next, scale_next = _load_keys(kv_ptr, kv_f32_ptr, page, pools, ok,
                                                page_stride, PAGE_POOLS)
                _score_tile(k, k_scale, q, w, ctx, tile, out_ptr, out_rows, N, N_PAD, H,
                            BLOCK_N, DOT_DTYPE)
        else:
            for tile in range(first, last):
                pools = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                ok = pools < ctx_max
                page = tl.load(bt_row + pools // PAGE_POOLS, mask=ok, other=0)
                k, k_scale = _load_keys(kv_ptr, kv_f32_ptr, page, pools, ok, page_stride,
                                        PAGE_POOLS)
                _score_tile(k, k_scale, q, w, ctx, tile, out_ptr, out_rows, N, N_PAD, H,
                            BLOCK_N, DOT_DTYPE)


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
                         out: torch.Tensor, num_programs: int | None = None,
                         config: PagedLogitsConfig | None = None) -> torch.Tensor:
    """Triton kernel; same contract as :func:`indexer_logits_paged_ref` (see module doc).
    ``config``: a :class:`PagedLogitsConfig` (default :func:`paged_config`); ``num_programs``
    sizes the balanced kernel's grid (default two per SM)."""
    num_req, next_n, heads, dim = q_fp8.shape
    assert dim == INDEXER_HEAD_DIM and q_fp8.is_contiguous() and weights.is_contiguous()
    assert context_lens.is_contiguous() and context_lens.numel() == num_req * next_n
    assert out.stride(1) == 1 and block_table.stride(1) == 1
    if num_req == 0:
        return out
    indexer_page_views(kv_cache)  # validates the layout
    cfg = config or paged_config(next_n)
    page_pools = kv_cache.shape[1]
    common = dict(N=next_n, N_PAD=triton.next_power_of_2(next_n), H=heads, PAGE_POOLS=page_pools,
                  DOT_DTYPE=dot_dtype(tl.float16))
    args = (q_fp8, weights, kv_cache.view(torch.float8_e4m3fn), kv_cache.view(torch.float32),
            kv_cache.stride(0), block_table, block_table.stride(0), context_lens, out,
            out.stride(0))
    if cfg.kernel == KERNEL_PAGE_GRID:
        max_pools = block_table.shape[1] * page_pools
        grid = (num_req, triton.cdiv(max_pools, cfg.block_n * cfg.tiles))
        _indexer_logits_page_grid_kernel[grid](
            *args, BLOCK_N=cfg.block_n, TILES=cfg.tiles, PREFETCH=cfg.prefetch,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
        return out
    block_n, num_warps, num_stages, prefetch = (PAGED_CONFIG if config is None else
                                                (cfg.block_n, cfg.num_warps, cfg.num_stages,
                                                 cfg.prefetch))
    if num_programs is None:
        num_programs = default_num_programs(q_fp8.device)
    _indexer_logits_paged_kernel[(num_programs + num_req,)](
        *args, num_req, num_programs, BLOCK_N=block_n,
        BLOCK_B=max(16, triton.next_power_of_2(num_req)), PREFETCH=prefetch,
        num_warps=num_warps, num_stages=num_stages, **common)
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
