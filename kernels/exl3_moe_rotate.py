"""The input and output rotations of glmctl.kernels.exl3_moe_decode (the EXL3 decode-batch MoE),
and its run table: what happens per slot before and after the per-expert weight products.

  prologue  grid 2S + 1 (S slots). Program 2S builds the run table: slots sorted by expert
            (padding sorts last), cut into runs of <= ROWS slots of one expert (order, run_e,
            run_s, run_n; meta[0] = number of runs). Program 2s + p rotates slot s's token row
            for projection p (0 gate, 1 up): fp16 clamp (values beyond +-65280 counted once per
            token into `clamped`; NaN stays NaN), * suh_p[e], 128-wide Hadamard / sqrt(128) ->
            xrot[s, p] (fp16, k' order of glmctl.kernels.exl3_trellis) and xsum[s, p], the sum of
            those fp16 values (the raw products' affine epilogue needs it).
  combine   grid (T, H / (128 NBLK)): out[t, block] = sum over the token's picks j of
            Had128(sum over down splits of y[split, t * k + j, block]) / sqrt(128)
            * svh_down[e_j, block] * w_j, NBLK 128-column blocks per program (its rows: picks x
            blocks, >= 16 for the products), the picks summed in a fixed tree order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .exl3_trellis import _hadamard, _k_of_kprime

FP16_SAFE = 65280.0
_SAFE: tl.constexpr = tl.constexpr(FP16_SAFE)
_INV128: tl.constexpr = tl.constexpr(1 / math.sqrt(128))


@triton.jit
def _prologue_kernel(x_ptr, x_stride, ids_ptr, gsuh_ptr, gsuh_stride, usuh_ptr, usuh_stride, xrot_ptr, xsum_ptr,
                     clamp_ptr, order_ptr, counts_ptr, run_e_ptr, run_s_ptr, run_n_ptr, meta_ptr, S, E,
                     TOPK: tl.constexpr, H: tl.constexpr, NB_PAD: tl.constexpr, S_PAD: tl.constexpr,
                     E_PAD: tl.constexpr, MAX_CHUNKS: tl.constexpr, ROWS: tl.constexpr, CHECK: tl.constexpr,
                     PRESORTED: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 2 * S:  # the run table
        e = tl.arange(0, E_PAD)
        if PRESORTED:  # order and per-expert counts were written before the launch
            cnt = tl.load(counts_ptr + e, mask=e < E, other=0)
        else:
            s = tl.arange(0, S_PAD)
            ids = tl.load(ids_ptr + s, mask=s < S, other=E).to(tl.int32)  # padding sorts last, bin E
            tl.store(order_ptr + s, tl.sort(ids * S_PAD + s) % S_PAD, mask=s < S)
            cnt = tl.where(e < E, tl.histogram(ids, E_PAD), 0)
        first = tl.cumsum(cnt, 0) - cnt
        runs = (cnt + ROWS - 1) // ROWS
        run0 = tl.cumsum(runs, 0) - runs
        for c in tl.static_range(MAX_CHUNKS):
            m = c < runs
            tl.store(run_e_ptr + run0 + c, e, mask=m)
            tl.store(run_s_ptr + run0 + c, first + c * ROWS, mask=m)
            tl.store(run_n_ptr + run0 + c, tl.minimum(cnt - c * ROWS, ROWS), mask=m)
        tl.store(meta_ptr, tl.sum(runs, 0))
        return
    s = pid // 2
    p = pid % 2
    e = tl.load(ids_ptr + s).to(tl.int64)
    # every 128-block as its two 64-halves: H128 v = [H64 (v0 + v1), H64 (v0 - v1)]
    blk = tl.arange(0, NB_PAD)[:, None]
    lo = blk * 128 + tl.arange(0, 64)[None, :]
    inside = blk < H // 128
    xrow = x_ptr + (s // TOPK) * x_stride
    x0 = tl.load(xrow + lo, mask=inside, other=0.0).to(tl.float32)
    x1 = tl.load(xrow + lo + 64, mask=inside, other=0.0).to(tl.float32)
    if CHECK:
        if (p == 0) & (s % TOPK == 0):  # one count per token
            bad = tl.sum(tl.sum(tl.where(tl.abs(x0) <= _SAFE, 0, 1) + tl.where(tl.abs(x1) <= _SAFE, 0, 1), 1), 0)
            tl.atomic_add(clamp_ptr, bad.to(tl.int64))
        x0 = tl.where(x0 == x0, tl.minimum(tl.maximum(x0, -_SAFE), _SAFE), x0)  # NaN stays NaN
        x1 = tl.where(x1 == x1, tl.minimum(tl.maximum(x1, -_SAFE), _SAFE), x1)
    if p == 0:
        suh_row = gsuh_ptr + e * gsuh_stride
    else:
        suh_row = usuh_ptr + e * usuh_stride
    v0 = x0.to(tl.float16).to(tl.float32) * tl.load(suh_row + lo, mask=inside, other=0.0).to(tl.float32)
    v1 = x1.to(tl.float16).to(tl.float32) * tl.load(suh_row + lo + 64, mask=inside, other=0.0).to(tl.float32)
    i = tl.arange(0, 64)
    hp = _hadamard(i, _k_of_kprime(i)).to(tl.float16)  # [i, k'] = H64[i, k(k')]: output in k' order
    r0 = (tl.dot((v0 + v1).to(tl.float16), hp) * _INV128).to(tl.float16)
    r1 = (tl.dot((v0 - v1).to(tl.float16), hp) * _INV128).to(tl.float16)
    dst = xrot_ptr + s * (2 * H) + p * H + lo
    tl.store(dst, r0, mask=inside)
    tl.store(dst + 64, r1, mask=inside)
    tl.store(xsum_ptr + s * 2 + p, tl.sum(tl.sum(r0.to(tl.float32) + r1.to(tl.float32), 1), 0))


@triton.jit
def _combine_kernel(y_ptr, y_split_stride, ids_ptr, w_ptr, svh_ptr, svh_stride, out_ptr, out_stride,
                    H: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, NBLK: tl.constexpr,
                    R: tl.constexpr, DOWN_SPLIT: tl.constexpr):
    t = tl.program_id(0)
    rr = tl.arange(0, R)
    j = rr // NBLK
    ok = j < TOPK
    s = t * TOPK + j
    e = tl.load(ids_ptr + s, mask=ok, other=0).to(tl.int64)
    scale = tl.load(w_ptr + s, mask=ok, other=0.0).to(tl.float32) * _INV128
    col = (tl.program_id(1) * NBLK + rr % NBLK) * 128
    i = tl.arange(0, 64)
    src = y_ptr + s[:, None] * H + col[:, None] + i[None, :]
    y0 = tl.zeros((R, 64), dtype=tl.float32)
    y1 = tl.zeros((R, 64), dtype=tl.float32)
    for q in tl.static_range(DOWN_SPLIT):
        y0 += tl.load(src + q * y_split_stride, mask=ok[:, None], other=0.0)
        y1 += tl.load(src + q * y_split_stride + 64, mask=ok[:, None], other=0.0)
    had = _hadamard(i, i)
    sv = svh_ptr + e[:, None] * svh_stride + col[:, None] + i[None, :]
    top = tl.dot(y0 + y1, had, input_precision="tf32x3") * tl.load(sv, mask=ok[:, None], other=0.0).to(tl.float32)
    bot = tl.dot(y0 - y1, had, input_precision="tf32x3") * tl.load(sv + 64, mask=ok[:, None], other=0.0).to(tl.float32)
    top = tl.sum(tl.reshape(top * scale[:, None], [R // NBLK, NBLK, 64]), 0)
    bot = tl.sum(tl.reshape(bot * scale[:, None], [R // NBLK, NBLK, 64]), 0)
    ob = (tl.program_id(1) * NBLK + tl.arange(0, NBLK)) * 128
    dst = out_ptr + t * out_stride + ob[:, None] + i[None, :]
    tl.store(dst, top.to(out_ptr.dtype.element_ty))
    tl.store(dst + 64, bot.to(out_ptr.dtype.element_ty))


SORT_IN_KERNEL = 512  # slots up to which one program sorts and counts them (above: torch's sort first)


def prologue_launch(x, ids, gsuh, usuh, ws, clamped: torch.Tensor, top_k: int, experts: int, rows: int) -> None:
    """Run table and rotated inputs of one call into the workspace `ws` (exl3_moe_decode's).
    Above SORT_IN_KERNEL slots the order (a stable sort by expert) and the per-expert counts come
    from torch first: one program sorting 16,384 slots took 1.1 ms at 2,048 tokens (H200)."""
    tokens, hidden = x.shape
    slots = tokens * top_k
    presorted = slots > SORT_IN_KERNEL
    if presorted:
        ws.order[:slots].copy_(torch.argsort(ids, stable=True))
        ws.counts.zero_()
        ws.counts.scatter_add_(0, ids.to(torch.int64), torch.ones_like(ids))
    _prologue_kernel[(2 * slots + 1,)](
        x, x.stride(0), ids, gsuh, gsuh.stride(0), usuh, usuh.stride(0), ws.xrot, ws.xsum, clamped,
        ws.order, ws.counts, ws.run_e, ws.run_s, ws.run_n, ws.meta, slots, experts, **_prologue_constants(
            hidden, top_k, experts, tokens, rows),
        CHECK=x.dtype != torch.float16, PRESORTED=presorted, num_warps=4)


def _prologue_constants(hidden: int, top_k: int, experts: int, tokens: int, rows: int) -> dict:
    slots = tokens * top_k  # S_PAD sizes the in-kernel sort only: 1 when torch sorted first
    return dict(TOPK=top_k, H=hidden, NB_PAD=max(16, triton.next_power_of_2(hidden // 128)),
                S_PAD=triton.next_power_of_2(slots) if slots <= SORT_IN_KERNEL else 1,
                E_PAD=triton.next_power_of_2(experts + 1),
                MAX_CHUNKS=triton.cdiv(triton.next_power_of_2(tokens), rows), ROWS=rows)


def _combine_constants(hidden: int, top_k: int, down_split: int) -> dict:
    topk_pad = triton.next_power_of_2(top_k)
    nblk = 1
    while nblk * topk_pad < 16 and hidden % (256 * nblk) == 0:
        nblk *= 2
    return dict(H=hidden, TOPK=top_k, TOPK_PAD=topk_pad, NBLK=nblk, R=max(16, topk_pad * nblk),
                DOWN_SPLIT=down_split)


def combine_launch(x, ids, topk_weights, dsvh, y, y_split_stride: int, top_k: int, down_split: int):
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1)
    c = _combine_constants(hidden, top_k, down_split)
    _combine_kernel[(tokens, hidden // (128 * c["NBLK"]))](
        y, y_split_stride, ids, weights if weights.is_contiguous() else weights.contiguous(), dsvh,
        dsvh.stride(0), out, out.stride(0), **c, num_warps=4)
    return out


def rotate_configs(hidden: int, top_k: int, experts: int, target_tokens: tuple[int, ...], rows: int,
                   combine: bool = True):
    """(name, jit function, {arg: type}, {constexpr: value}, options) of the prologue and combine
    launches at the given shape, for glmctl.kernels.sm89_check."""
    i32, i64 = "i32", "i64"
    runs = dict(order_ptr="*i32", run_e_ptr="*i32", run_s_ptr="*i32", run_n_ptr="*i32", meta_ptr="*i32")
    for tokens in target_tokens:
        yield (f"exl3_decode_prologue[T{tokens}]", _prologue_kernel,
               dict(x_ptr="*bf16", x_stride=i64, ids_ptr="*i32", gsuh_ptr="*fp16", gsuh_stride=i64,
                    usuh_ptr="*fp16", usuh_stride=i64, xrot_ptr="*fp16", xsum_ptr="*fp32", clamp_ptr="*i64",
                    counts_ptr="*i32", S=i32, E=i32, **runs),
               dict(_prologue_constants(hidden, top_k, experts, tokens, rows), CHECK=True,
                    PRESORTED=tokens * top_k > SORT_IN_KERNEL),
               dict(num_warps=4, num_stages=1))
    for down_split in (1, 4) if combine else ():
        yield (f"exl3_decode_combine[d{down_split}]", _combine_kernel,
               dict(y_ptr="*fp32", y_split_stride=i64, ids_ptr="*i32", w_ptr="*fp32", svh_ptr="*fp16",
                    svh_stride=i64, out_ptr="*bf16", out_stride=i64),
               _combine_constants(hidden, top_k, down_split), dict(num_warps=4, num_stages=1))
