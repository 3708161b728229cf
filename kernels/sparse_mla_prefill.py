"""Sparse MLA attention over selected cache rows (absorbed / MQA form), prefill and chunked prefill.

``sparse_mla_prefill(q, kv_cache, indices, softmax_scale, out, lse)`` and
``sparse_mla_prefill_ref`` (same arguments, ``out``/``lse`` optional).

* ``q``: ``[T, H, 512]`` bf16, queries already absorbed into the latent space (``q_nope @ W_UK``);
  GLM-5.3-Flash has no RoPE part, so q and k are both the 512-d latent.
* ``kv_cache``: vLLM's latent cache, ``[num_blocks, block_size, 512]`` bf16,
  ``[num_blocks, block_size, 512]`` uint8 / float8_e4m3fn ``fp8`` (one per-tensor scale) or
  ``[num_blocks, block_size, 656]`` uint8 ``fp8_ds_mla`` (see :mod:`glmctl.kernels.layouts`).
* ``indices``: ``[T, K]`` int32 flat cache rows per query token (vLLM's converted top-k, K is
  the buffer width, 2176 for GLM-5.3-Flash); entries < 0 or past the cache are ignored and never
  read; duplicates count twice (vLLM never produces them).
* ``softmax_scale``: the model's scale (``qk_head_dim ** -0.5`` times the YaRN mscale squared);
  no default, FlashMLA's ``576 ** -0.5`` would be wrong here.
* ``out``: ``[T, H, 512]`` (q's dtype) = ``sum_n softmax(scale * q.k_n) * k_n`` (V = the latent);
  ``lse``: ``[T, H]`` fp32, natural-log log-sum-exp of the scaled scores. A row with no valid
  index gives ``out = 0`` and ``lse = -inf``.
* ``kv_scale`` (keyword, ``fp8`` caches only): the layer's ``_k_scale``, a 0-d fp32 device
  tensor, read by the kernel on the device (graph safe; no ``.item()``).

Kernel: one program per (token, block of ``BLOCK_H`` heads, split); it walks its columns of
``indices`` ``BLOCK_N`` at a time with an online softmax in base 2 (prefill skips tiles with no
valid index, which early prompt tokens have many of; decode does not branch, so its loop can be
software-pipelined). The 512-d row is handled as
four 128-wide tiles so that an fp8 tile is used exactly (e4m3 -> bf16 is exact) and its per-tile
scale multiplies the fp32 dot products instead of every element (fp8 tiles enter the tensor
cores as fp16, which e4m3 converts to exactly; bf16 tiles as bf16): scores
``sum_t scale_t * (q_t . k8_t)``, values ``acc_t += (p * scale_t) @ k8_t``. The per-tensor
``fp8`` layout needs no per-row scale at all: ``k_scale`` is folded into the softmax scale and
into the final normalisation, so its inner loop is the bf16 loop on fp16 operands (and it
gathers 512 instead of 656 bytes per row). The decode launcher
(:mod:`.sparse_mla_decode`) runs the same kernel with several splits writing fp32 partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layouts import (
    FP8_DS_MLA_SCALE_OFFSET,
    KV_BF16,
    KV_FP8,
    KV_FP8_DS_MLA,
    LATENT_DIM,
    flat_rows,
    mla_kv_format,
    require_kv_scale,
)
from .layouts import dequant_latent_rows as _dequant
from .sparse_mla_configs import PREFILL_CONFIGS, pick_config
from .triton_env import dot_dtype

LOG2E = 1.4426950408889634
# The kernel's KV_MODE constexpr per cache layout.
KV_MODES = {KV_BF16: 0, KV_FP8_DS_MLA: 1, KV_FP8: 2}


@triton.jit
def _load_tile(kv_ptr, kv_f32_ptr, rows, valid, t: tl.constexpr, row_stride,
               TILE_SCALES: tl.constexpr, SCALE_OFFSET: tl.constexpr):
    """Tile ``t`` (128 wide) of the selected rows as stored (fp8 or bf16), and its per-row fp32
    scale (fp8_ds_mla; 1 for the layouts without per-row scales)."""
    d = tl.arange(0, 128)
    base = rows * row_stride
    k = tl.load(kv_ptr + base[:, None] + t * 128 + d[None, :], mask=valid[:, None], other=0.0)
    if TILE_SCALES:
        scale = tl.load(kv_f32_ptr + (base + SCALE_OFFSET) // 4 + t, mask=valid, other=0.0)
    else:
        scale = tl.full(rows.shape, 1.0, tl.float32)
    return k, scale


@triton.jit
def _reload_tile(kv_ptr, rows, valid, t: tl.constexpr, row_stride):
    """A second load of tile ``t`` for the value product: a distinct load (never merged with
    the scores' one), so each has one consumer and Triton's pipeliner can stage both through
    shared memory; the re-read hits L1/L2."""
    d = tl.arange(0, 128)
    return tl.load(kv_ptr + (rows * row_stride)[:, None] + t * 128 + d[None, :],
                   mask=valid[:, None], other=0.0, eviction_policy="evict_first")


@triton.jit
def _pv_fp8(p, scale, k, DOT_DTYPE: tl.constexpr):
    top = tl.max(scale, axis=0)
    top = tl.where(top > 0.0, top, 1.0)
    return tl.dot((p * (scale / top)[None, :]).to(DOT_DTYPE), k) * top


@triton.jit
def _attend(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, s0, s1, s2, s3, valid, m, l_sum,
            acc0, acc1, acc2, acc3, sm_scale_log2, TILE_SCALES: tl.constexpr,
            DOT_DTYPE: tl.constexpr):
    """Online-softmax update of one tile of selected rows (k_t as stored for the scores, v_t
    the same rows for the values: the same tensors, or a second load of them; s_t their per-row
    scales when the layout has them)."""
    k0 = k0.to(DOT_DTYPE)
    k1 = k1.to(DOT_DTYPE)
    k2 = k2.to(DOT_DTYPE)
    k3 = k3.to(DOT_DTYPE)
    v0 = v0.to(DOT_DTYPE)
    v1 = v1.to(DOT_DTYPE)
    v2 = v2.to(DOT_DTYPE)
    v3 = v3.to(DOT_DTYPE)
    if TILE_SCALES:
        scores = tl.dot(q0, tl.trans(k0)) * s0[None, :]
        scores += tl.dot(q1, tl.trans(k1)) * s1[None, :]
        scores += tl.dot(q2, tl.trans(k2)) * s2[None, :]
        scores += tl.dot(q3, tl.trans(k3)) * s3[None, :]
    else:
        scores = tl.dot(q0, tl.trans(k0))
        scores = tl.dot(q1, tl.trans(k1), scores)
        scores = tl.dot(q2, tl.trans(k2), scores)
        scores = tl.dot(q3, tl.trans(k3), scores)
    scores = tl.where(valid[None, :], scores * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # A head with no valid column yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    if TILE_SCALES:
        # Values: acc_t += (p * scale_t) @ k8_t, with scale_t / max(scale_t) in the fp16 operand
        # (<= 1, no fp16 underflow for small latents) and max(scale_t) applied after.
        acc0 = acc0 * alpha[:, None] + _pv_fp8(p, s0, v0, DOT_DTYPE)
        acc1 = acc1 * alpha[:, None] + _pv_fp8(p, s1, v1, DOT_DTYPE)
        acc2 = acc2 * alpha[:, None] + _pv_fp8(p, s2, v2, DOT_DTYPE)
        acc3 = acc3 * alpha[:, None] + _pv_fp8(p, s3, v3, DOT_DTYPE)
    else:
        pb = p.to(DOT_DTYPE)
        acc0 = tl.dot(pb, v0, acc0 * alpha[:, None])
        acc1 = tl.dot(pb, v1, acc1 * alpha[:, None])
        acc2 = tl.dot(pb, v2, acc2 * alpha[:, None])
        acc3 = tl.dot(pb, v3, acc3 * alpha[:, None])
    return m_new, l_sum, acc0, acc1, acc2, acc3


@triton.jit
def _sparse_mla_kernel(
    q_ptr, q_stride_t, q_stride_h,
    kv_ptr, kv_f32_ptr, kv_scale_ptr, row_stride, num_rows,
    idx_ptr, idx_stride_t, topk,
    out_ptr, out_stride_t, out_stride_s, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_s,
    num_heads, sm_scale_log2, split_len,
    KV_MODE: tl.constexpr,  # 0 bf16, 1 fp8_ds_mla (per-row tile scales), 2 fp8 (per-tensor)
    PARTIAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SKIP_EMPTY: tl.constexpr,
    PREFETCH: tl.constexpr,
    RELOAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    d = tl.arange(0, 128)

    q_base = q_ptr + tok * q_stride_t + heads[:, None] * q_stride_h + d[None, :]
    q0 = tl.load(q_base + 0, mask=hmask[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(q_base + 128, mask=hmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_base + 256, mask=hmask[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(q_base + 384, mask=hmask[:, None], other=0.0).to(tl.float32)
    if KV_MODE != 0:
        # fp16 operands (e4m3 -> fp16 is one exact conversion; bf16 would take several): bring
        # q into fp16 range with a power of two that the scores then undo.
        q_max = tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(q0), axis=1), axis=0),
                                      tl.max(tl.max(tl.abs(q1), axis=1), axis=0)),
                           tl.maximum(tl.max(tl.max(tl.abs(q2), axis=1), axis=0),
                                      tl.max(tl.max(tl.abs(q3), axis=1), axis=0)))
        q_shift = tl.exp2(tl.maximum(tl.ceil(tl.log2(q_max / 16384.0)), 0.0))
        q0, q1, q2, q3 = q0 / q_shift, q1 / q_shift, q2 / q_shift, q3 / q_shift
        sm_scale_log2 = sm_scale_log2 * q_shift
    k_scale = 1.0
    if KV_MODE == 2:
        # Per-tensor fp8: scores = (q . k8) * k_scale, values = (p @ k8) * k_scale.
        k_scale = tl.load(kv_scale_ptr).to(tl.float32)
        sm_scale_log2 = sm_scale_log2 * k_scale
    q0 = q0.to(DOT_DTYPE)
    q1 = q1.to(DOT_DTYPE)
    q2 = q2.to(DOT_DTYPE)
    q3 = q3.to(DOT_DTYPE)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)

    start = split * split_len
    end = tl.minimum(start + split_len, topk)
    idx_row = idx_ptr + tok * idx_stride_t
    lanes = tl.arange(0, BLOCK_N)
    if PREFETCH:
        # Register double buffering: the rows of tile i+1 are loaded (as stored: fp8 rows are
        # small) while tile i is computed, and indices two tiles ahead. Triton's own pipeliner
        # does not overlap these gathers when their values are converted before the product.
        idx = tl.load(idx_row + start + lanes, mask=start + lanes < end, other=-1)
        valid_n = (idx >= 0) & (idx < num_rows)
        rows = tl.where(valid_n, idx, 0).to(tl.int64)
        k0n, s0n = _load_tile(kv_ptr, kv_f32_ptr, rows, valid_n, 0, row_stride,
                              KV_MODE == 1, SCALE_OFFSET)
        k1n, s1n = _load_tile(kv_ptr, kv_f32_ptr, rows, valid_n, 1, row_stride,
                              KV_MODE == 1, SCALE_OFFSET)
        k2n, s2n = _load_tile(kv_ptr, kv_f32_ptr, rows, valid_n, 2, row_stride,
                              KV_MODE == 1, SCALE_OFFSET)
        k3n, s3n = _load_tile(kv_ptr, kv_f32_ptr, rows, valid_n, 3, row_stride,
                              KV_MODE == 1, SCALE_OFFSET)
        ahead = start + BLOCK_N + lanes
        idx_next = tl.load(idx_row + ahead, mask=ahead < end, other=-1)
        for n0 in range(start, end, BLOCK_N):
            valid = valid_n
            k0, s0, k1, s1, k2, s2, k3, s3 = k0n, s0n, k1n, s1n, k2n, s2n, k3n, s3n
            valid_n = (idx_next >= 0) & (idx_next < num_rows)
            rows = tl.where(valid_n, idx_next, 0).to(tl.int64)
            k0n, s0n = _load_tile(kv_ptr, kv_f32_ptr, rows, valid_n, 0, row_stride, KV_MODE == 1,
                                  SCALE_OFFSET)
            k1n, s1n = _load_tile(kv_ptr, kv_f32_ptr, rows, valid_n, 1, row_stride, KV_MODE == 1,
                                  SCALE_OFFSET)
            k2n, s2n = _load_tile(kv_ptr, kv_f32_ptr, rows, valid_n, 2, row_stride, KV_MODE == 1,
                                  SCALE_OFFSET)
            k3n, s3n = _load_tile(kv_ptr, kv_f32_ptr, rows, valid_n, 3, row_stride, KV_MODE == 1,
                                  SCALE_OFFSET)
            ahead = n0 + 2 * BLOCK_N + lanes
            idx_next = tl.load(idx_row + ahead, mask=ahead < end, other=-1)
            m, l_sum, acc0, acc1, acc2, acc3 = _attend(
                q0, q1, q2, q3, k0, k1, k2, k3, k0, k1, k2, k3, s0, s1, s2, s3, valid, m, l_sum,
                acc0, acc1, acc2, acc3, sm_scale_log2, KV_MODE == 1, DOT_DTYPE)
    else:
        # Indices one tile ahead; Triton's pipeliner (num_stages) may overlap the row loads.
        idx_next = tl.load(idx_row + start + lanes, mask=start + lanes < end, other=-1)
        for n0 in range(start, end, BLOCK_N):
            idx = idx_next
            ahead = n0 + BLOCK_N + lanes
            idx_next = tl.load(idx_row + ahead, mask=ahead < end, other=-1)
            valid = (idx >= 0) & (idx < num_rows)
            if (not SKIP_EMPTY) or tl.max(valid.to(tl.int32), axis=0) > 0:
                rows = tl.where(valid, idx, 0).to(tl.int64)
                k0, s0 = _load_tile(kv_ptr, kv_f32_ptr, rows, valid, 0, row_stride, KV_MODE == 1,
                                    SCALE_OFFSET)
                k1, s1 = _load_tile(kv_ptr, kv_f32_ptr, rows, valid, 1, row_stride, KV_MODE == 1,
                                    SCALE_OFFSET)
                k2, s2 = _load_tile(kv_ptr, kv_f32_ptr, rows, valid, 2, row_stride, KV_MODE == 1,
                                    SCALE_OFFSET)
                k3, s3 = _load_tile(kv_ptr, kv_f32_ptr, rows, valid, 3, row_stride, KV_MODE == 1,
                                    SCALE_OFFSET)
                v0, v1, v2, v3 = k0, k1, k2, k3
                if RELOAD:
                    v0 = _reload_tile(kv_ptr, rows, valid, 0, row_stride)
                    v1 = _reload_tile(kv_ptr, rows, valid, 1, row_stride)
                    v2 = _reload_tile(kv_ptr, rows, valid, 2, row_stride)
                    v3 = _reload_tile(kv_ptr, rows, valid, 3, row_stride)
                m, l_sum, acc0, acc1, acc2, acc3 = _attend(
                    q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, s0, s1, s2, s3, valid, m,
                    l_sum, acc0, acc1, acc2, acc3, sm_scale_log2, KV_MODE == 1, DOT_DTYPE)

    has_any = l_sum > 0.0
    inv = tl.where(has_any, k_scale / tl.where(has_any, l_sum, 1.0), 0.0)
    lse = tl.where(has_any, (m + tl.log2(tl.where(has_any, l_sum, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    o_base = out_ptr + tok * out_stride_t + split * out_stride_s + heads[:, None] * out_stride_h + d[None, :]
    o_dtype = out_ptr.dtype.element_ty
    tl.store(o_base + 0, (acc0 * inv[:, None]).to(o_dtype), mask=hmask[:, None])
    tl.store(o_base + 128, (acc1 * inv[:, None]).to(o_dtype), mask=hmask[:, None])
    tl.store(o_base + 256, (acc2 * inv[:, None]).to(o_dtype), mask=hmask[:, None])
    tl.store(o_base + 384, (acc3 * inv[:, None]).to(o_dtype), mask=hmask[:, None])
    tl.store(lse_ptr + tok * lse_stride_t + split * lse_stride_s + heads, lse, mask=hmask)


def launch_sparse_mla_kernel(q, kv_cache, indices, softmax_scale, out, lse, *, num_splits,
                             split_len, block_h, block_n, num_warps, num_stages, partial,
                             skip_empty=True, prefetch=False, reload=False, kv_scale=None):
    """Launch the attention kernel (shared by prefill and decode stage 1)."""
    fmt = mla_kv_format(kv_cache)
    require_kv_scale(fmt, kv_scale)
    rows = flat_rows(kv_cache)
    num_tokens, num_heads, dim = q.shape
    assert dim == LATENT_DIM and q.stride(-1) == 1 and indices.stride(-1) == 1
    if fmt == KV_BF16:
        kv, kv_f32, row_stride = rows, rows, rows.stride(0)
    elif fmt == KV_FP8:
        kv = rows.view(torch.float8_e4m3fn)
        kv_f32, row_stride = kv, rows.stride(0)  # no scales in the rows
    else:
        kv = rows.view(torch.float8_e4m3fn)
        kv_f32, row_stride = kv_cache.view(torch.float32), rows.stride(0)
    if num_tokens == 0:
        return
    grid = (num_tokens, triton.cdiv(num_heads, block_h), num_splits)
    out_strides = (out.stride(0), out.stride(1), out.stride(2)) if partial else (
        out.stride(0), 0, out.stride(1))
    lse_strides = (lse.stride(0), lse.stride(1)) if partial else (lse.stride(0), 0)
    _sparse_mla_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv, kv_f32, kv_scale if kv_scale is not None else kv_f32, row_stride, rows.shape[0],
        indices, indices.stride(0), indices.shape[1],
        out, *out_strides,
        lse, *lse_strides,
        num_heads, softmax_scale * LOG2E, split_len,
        KV_MODE=KV_MODES[fmt],
        PARTIAL=partial,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        SCALE_OFFSET=FP8_DS_MLA_SCALE_OFFSET,
        DOT_DTYPE=dot_dtype(tl.float16 if fmt != KV_BF16 else tl.bfloat16),
        SKIP_EMPTY=skip_empty,
        PREFETCH=prefetch,
        RELOAD=bool(reload) and not prefetch,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def sparse_mla_prefill(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                       softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, *,
                       kv_scale: torch.Tensor | None = None) -> None:
    """Sparse MLA for many query tokens, each with its own selection (no split-K)."""
    cfg = pick_config(PREFILL_CONFIGS, mla_kv_format(kv_cache), q.shape[1])
    launch_sparse_mla_kernel(
        q, kv_cache, indices, softmax_scale, out, lse, num_splits=1, split_len=indices.shape[1],
        block_h=cfg.block_h, block_n=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, partial=False, prefetch=cfg.prefetch, reload=cfg.reload,
        kv_scale=kv_scale,
    )


def sparse_mla_prefill_ref(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                           softmax_scale: float, out: torch.Tensor | None = None,
                           lse: torch.Tensor | None = None, *,
                           kv_scale: torch.Tensor | None = None,
                           compute_dtype: torch.dtype = torch.float32,
                           chunk_bytes: int = 1 << 28) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (gather + matmul), vectorised over tokens in memory-bounded chunks.

    Used by the CPU plugin path; ``compute_dtype=torch.float64`` gives the GPU tests' oracle.
    """
    fmt = mla_kv_format(kv_cache)
    require_kv_scale(fmt, kv_scale)
    rows = flat_rows(kv_cache)
    num_tokens, num_heads, _ = q.shape
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    topk = indices.shape[1]
    valid = (indices >= 0) & (indices < rows.shape[0])
    safe = torch.where(valid, indices, 0).long()
    per_token = max(1, topk * LATENT_DIM * torch.finfo(compute_dtype).bits // 8)
    step = max(1, chunk_bytes // per_token)
    for lo in range(0, num_tokens, step):
        hi = min(num_tokens, lo + step)
        kv = _dequant(rows[safe[lo:hi]], fmt, kv_scale).to(compute_dtype)  # [t, K, 512]
        scores = torch.einsum("thd,tkd->thk", q[lo:hi].to(compute_dtype), kv) * softmax_scale
        scores = scores.masked_fill(~valid[lo:hi, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is valid
        probs = torch.exp(scores - row_lse.nan_to_num(neginf=0.0)[..., None])
        out[lo:hi] = torch.einsum("thk,tkd->thd", probs, kv).to(out.dtype)
        lse[lo:hi] = row_lse.to(lse.dtype)
    return out, lse

