"""Sparse MLA attention with the heads on the N side of the matrix products (few heads per rank).

Same tensors and results as :mod:`.sparse_mla_prefill`'s kernel (``q [T, H, 512]`` bf16, the
three latent-cache layouts, ``indices [T, K]`` flat rows, -1 = none; out / lse, or split-K
partials), for ``H <= 16`` heads per rank (TP8 has 8). One program per (token, block of ``HP``
heads, split). Why a second kernel: with the heads as the M side, an MMA tile is 16 rows, so 8
heads pad every product to twice its work and every warp holds the whole ``[16, 512]`` query
operand and a ``[16, 512]`` fp32 accumulator. Here the products are transposed:

* scores: ``s^T [BLOCK_N, HP] = k_t [BLOCK_N, 128] @ q_t^T [128, HP]``, summed over the four
  128-wide tiles ``t`` (the selected rows are the M operand, split across the warps);
* values: ``out_t^T [128, HP] += k_t^T [128, BLOCK_N] @ p^T [BLOCK_N, HP]``.

``HP`` = 8 is a native MMA N (m16n8k16): no padding, and the accumulator is ``[512, 8]`` fp32
(32 registers per thread with 4 warps) instead of ``[16, 512]``.

fp8 tiles enter the products as fp16 (exact), bf16 tiles as bf16; ``fp8`` folds ``k_scale`` into
the softmax scale and the final normalisation, ``fp8_ds_mla`` scales the score rows and the
value operand per row and tile (as in :mod:`.sparse_mla_prefill`). With ``RELOAD`` the value
product reads its own copy of the tile (from L1/L2): a loaded tile with a single consumer is one
Triton's software pipeliner stages through shared memory (``num_stages``, cp.async), while a
converted tile shared by both products is loaded synchronously.
"""

from __future__ import annotations

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
from .triton_env import dot_dtype

LOG2E = 1.4426950408889634
KV_MODES = {KV_BF16: 0, KV_FP8_DS_MLA: 1, KV_FP8: 2}
MAX_HEADS = 16


@triton.jit
def _rows_tile(kv_ptr, rows, valid, t: tl.constexpr, EVICT: tl.constexpr):
    d = tl.arange(0, 128)
    ptrs = kv_ptr + rows[:, None] + t * 128 + d[None, :]
    if EVICT:  # a distinct load (not merged with the scores' one), so it can be pipelined
        return tl.load(ptrs, mask=valid[:, None], other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=valid[:, None], other=0.0)


@triton.jit
def _row_scales(kv_f32_ptr, rows, valid, t: tl.constexpr, SCALE_OFFSET: tl.constexpr):
    return tl.load(kv_f32_ptr + (rows + SCALE_OFFSET) // 4 + t, mask=valid, other=0.0)


@triton.jit
def _value_product(k, p_t, scale, acc, alpha, TILE_SCALES: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """``acc * alpha + k^T @ (p^T * scale)`` ([128, HP]); a per-row scale enters the fp16 operand
    divided by its tile maximum (<= 1, no fp16 underflow) and the maximum multiplies after."""
    k = k.to(DOT_DTYPE)
    if TILE_SCALES:
        top = tl.max(scale, axis=0)
        top = tl.where(top > 0.0, top, 1.0)
        pv = tl.dot(tl.trans(k), (p_t * (scale / top)[:, None]).to(DOT_DTYPE))
        return acc * alpha[None, :] + pv * top
    return tl.dot(tl.trans(k), p_t.to(DOT_DTYPE), acc * alpha[None, :])


@triton.jit
def _sparse_mla_heads_n_kernel(
    q_ptr, q_stride_t, q_stride_h,
    kv_ptr, kv_f32_ptr, kv_scale_ptr, row_stride, num_rows,
    idx_ptr, idx_stride_t, topk,
    out_ptr, out_stride_t, out_stride_s, out_stride_h,
    lse_ptr, lse_stride_t, lse_stride_s,
    num_heads, sm_scale_log2, split_len,
    KV_MODE: tl.constexpr,  # 0 bf16, 1 fp8_ds_mla (per-row tile scales), 2 fp8 (per-tensor)
    HP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    RELOAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HP + tl.arange(0, HP)
    split = tl.program_id(2)
    hmask = heads < num_heads
    d = tl.arange(0, 128)

    # q^T tiles [128, HP] (the B operand of the score product).
    q_base = q_ptr + tok * q_stride_t + heads[None, :] * q_stride_h + d[:, None]
    q0 = tl.load(q_base + 0, mask=hmask[None, :], other=0.0).to(tl.float32)
    q1 = tl.load(q_base + 128, mask=hmask[None, :], other=0.0).to(tl.float32)
    q2 = tl.load(q_base + 256, mask=hmask[None, :], other=0.0).to(tl.float32)
    q3 = tl.load(q_base + 384, mask=hmask[None, :], other=0.0).to(tl.float32)
    if KV_MODE != 0:
        # fp16 operands: bring q into fp16 range with a power of two the scores then undo.
        q_max = tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(q0), axis=1), axis=0),
                                      tl.max(tl.max(tl.abs(q1), axis=1), axis=0)),
                           tl.maximum(tl.max(tl.max(tl.abs(q2), axis=1), axis=0),
                                      tl.max(tl.max(tl.abs(q3), axis=1), axis=0)))
        q_shift = tl.exp2(tl.maximum(tl.ceil(tl.log2(q_max / 16384.0)), 0.0))
        q0, q1, q2, q3 = q0 / q_shift, q1 / q_shift, q2 / q_shift, q3 / q_shift
        sm_scale_log2 = sm_scale_log2 * q_shift
    k_scale = 1.0
    if KV_MODE == 2:
        k_scale = tl.load(kv_scale_ptr).to(tl.float32)
        sm_scale_log2 = sm_scale_log2 * k_scale
    q0 = q0.to(DOT_DTYPE)
    q1 = q1.to(DOT_DTYPE)
    q2 = q2.to(DOT_DTYPE)
    q3 = q3.to(DOT_DTYPE)

    m = tl.full([HP], float("-inf"), tl.float32)
    l_sum = tl.zeros([HP], tl.float32)
    acc0 = tl.zeros([128, HP], tl.float32)
    acc1 = tl.zeros([128, HP], tl.float32)
    acc2 = tl.zeros([128, HP], tl.float32)
    acc3 = tl.zeros([128, HP], tl.float32)

    start = split * split_len
    end = tl.minimum(start + split_len, topk)
    idx_row = idx_ptr + tok * idx_stride_t
    lanes = tl.arange(0, BLOCK_N)
    idx_next = tl.load(idx_row + start + lanes, mask=start + lanes < end, other=-1)
    for n0 in range(start, end, BLOCK_N):
        idx = idx_next
        ahead = n0 + BLOCK_N + lanes
        idx_next = tl.load(idx_row + ahead, mask=ahead < end, other=-1)
        valid = (idx >= 0) & (idx < num_rows)
        rows = tl.where(valid, idx, 0).to(tl.int64) * row_stride
        k0 = _rows_tile(kv_ptr, rows, valid, 0, False)
        k1 = _rows_tile(kv_ptr, rows, valid, 1, False)
        k2 = _rows_tile(kv_ptr, rows, valid, 2, False)
        k3 = _rows_tile(kv_ptr, rows, valid, 3, False)
        if KV_MODE == 1:
            s0 = _row_scales(kv_f32_ptr, rows, valid, 0, SCALE_OFFSET)
            s1 = _row_scales(kv_f32_ptr, rows, valid, 1, SCALE_OFFSET)
            s2 = _row_scales(kv_f32_ptr, rows, valid, 2, SCALE_OFFSET)
            s3 = _row_scales(kv_f32_ptr, rows, valid, 3, SCALE_OFFSET)
            scores = tl.dot(k0.to(DOT_DTYPE), q0) * s0[:, None]
            scores += tl.dot(k1.to(DOT_DTYPE), q1) * s1[:, None]
            scores += tl.dot(k2.to(DOT_DTYPE), q2) * s2[:, None]
            scores += tl.dot(k3.to(DOT_DTYPE), q3) * s3[:, None]
        else:
            s0 = tl.full([BLOCK_N], 1.0, tl.float32)
            s1 = s0
            s2 = s0
            s3 = s0
            scores = tl.dot(k0.to(DOT_DTYPE), q0)
            scores = tl.dot(k1.to(DOT_DTYPE), q1, scores)
            scores = tl.dot(k2.to(DOT_DTYPE), q2, scores)
            scores = tl.dot(k3.to(DOT_DTYPE), q3, scores)
        scores = tl.where(valid[:, None], scores * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        # A head with no valid row yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        p_t = tl.exp2(scores - m_shift[None, :])
        l_sum = l_sum * alpha + tl.sum(p_t, axis=0)
        m = m_new
        if RELOAD:
            k0 = _rows_tile(kv_ptr, rows, valid, 0, True)
            k1 = _rows_tile(kv_ptr, rows, valid, 1, True)
            k2 = _rows_tile(kv_ptr, rows, valid, 2, True)
            k3 = _rows_tile(kv_ptr, rows, valid, 3, True)
        acc0 = _value_product(k0, p_t, s0, acc0, alpha, KV_MODE == 1, DOT_DTYPE)
        acc1 = _value_product(k1, p_t, s1, acc1, alpha, KV_MODE == 1, DOT_DTYPE)
        acc2 = _value_product(k2, p_t, s2, acc2, alpha, KV_MODE == 1, DOT_DTYPE)
        acc3 = _value_product(k3, p_t, s3, acc3, alpha, KV_MODE == 1, DOT_DTYPE)

    has_any = l_sum > 0.0
    inv = tl.where(has_any, k_scale / tl.where(has_any, l_sum, 1.0), 0.0)
    lse = tl.where(has_any, (m + tl.log2(tl.where(has_any, l_sum, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    o_base = (out_ptr + tok * out_stride_t + split * out_stride_s + heads[None, :] * out_stride_h
              + d[:, None])
    o_dtype = out_ptr.dtype.element_ty
    tl.store(o_base + 0, (acc0 * inv[None, :]).to(o_dtype), mask=hmask[None, :])
    tl.store(o_base + 128, (acc1 * inv[None, :]).to(o_dtype), mask=hmask[None, :])
    tl.store(o_base + 256, (acc2 * inv[None, :]).to(o_dtype), mask=hmask[None, :])
    tl.store(o_base + 384, (acc3 * inv[None, :]).to(o_dtype), mask=hmask[None, :])
    tl.store(lse_ptr + tok * lse_stride_t + split * lse_stride_s + heads, lse, mask=hmask)


def heads_n_block(num_heads: int) -> int:
    """The kernel's head block: the next power of two >= max(8, heads); heads <= MAX_HEADS."""
    if num_heads > MAX_HEADS:
        raise ValueError(f"the heads-as-N sparse-MLA kernel takes <= {MAX_HEADS} heads per rank, "
                         f"got {num_heads}")
    return max(8, triton.next_power_of_2(num_heads))


def launch_sparse_mla_heads_n(q, kv_cache, indices, softmax_scale, out, lse, *, num_splits,
                              split_len, block_n, num_warps, num_stages, partial, reload=False,
                              kv_scale=None):
    """Launch the heads-as-N attention kernel (arguments as
    :func:`.sparse_mla_prefill.launch_sparse_mla_kernel`)."""
    import torch

    fmt = mla_kv_format(kv_cache)
    require_kv_scale(fmt, kv_scale)
    rows = flat_rows(kv_cache)
    num_tokens, num_heads, dim = q.shape
    assert dim == LATENT_DIM and q.stride(-1) == 1 and indices.stride(-1) == 1
    hp = heads_n_block(num_heads)
    if fmt == KV_BF16:
        kv, kv_f32 = rows, rows
    elif fmt == KV_FP8:
        kv = rows.view(torch.float8_e4m3fn)
        kv_f32 = kv
    else:
        kv = rows.view(torch.float8_e4m3fn)
        kv_f32 = kv_cache.view(torch.float32)
    if num_tokens == 0:
        return
    out_strides = (out.stride(0), out.stride(1), out.stride(2)) if partial else (
        out.stride(0), 0, out.stride(1))
    lse_strides = (lse.stride(0), lse.stride(1)) if partial else (lse.stride(0), 0)
    _sparse_mla_heads_n_kernel[(num_tokens, triton.cdiv(num_heads, hp), num_splits)](
        q, q.stride(0), q.stride(1),
        kv, kv_f32, kv_scale if kv_scale is not None else kv_f32, rows.stride(0), rows.shape[0],
        indices, indices.stride(0), indices.shape[1],
        out, *out_strides,
        lse, *lse_strides,
        num_heads, softmax_scale * LOG2E, split_len,
        KV_MODE=KV_MODES[fmt], HP=hp, BLOCK_N=block_n, SCALE_OFFSET=FP8_DS_MLA_SCALE_OFFSET,
        DOT_DTYPE=dot_dtype(tl.float16 if fmt != KV_BF16 else tl.bfloat16),
        RELOAD=bool(reload),
        num_warps=num_warps, num_stages=num_stages,
    )
