"""Routed experts of one MoE layer on one TP rank at decode batch sizes, EXL3 4-bit weights, in
Triton, scheduled by the routing: every expert that the batch touches is read once, by programs
that each take one *run* (up to ROWS (token, expert) slots of one expert) with all its tokens.

Shapes: T tokens x top-k picks = S slots (slot s is token s // k, pick s % k); E experts;
H hidden (gate/up input, down output); I intermediate channels on this rank. Weights are the
glmctl-exl3/1 tensors of glmctl.quantize.exl3_format, per projection: trellis [E, in/16, out/16,
64] int16 (K = 4), suh [E, in] and svh [E, out] fp16, each expert's slice contiguous (any expert
stride, so vLLM's stacked w13 views work). Decoding follows glmctl.kernels.exl3_trellis exactly.

Launches (grids depend on T only: CUDA-graph safe, no host sync, no allocation):
  1. prologue  grid 2S + 1. Program 2S builds the run table (slots sorted by expert, cut into
     runs of <= ROWS). Program 2s + p rotates slot s's token row for projection p: fp16 clamp
     (out-of-range values counted), * suh_p[e], 128-wide Hadamard -> xrot[s, p] (k' order).
  2. gate/up   grid (max_runs, I / 128, SPLIT_K): a run's rows x 128 gate and up columns over one
     K split -> fp32 partials part[split, s, p]. The last split to arrive (self-resetting counter
     per (run, column block)) sums the splits in order and finishes the block: Hadamard * svh,
     SwiGLU with GLM's clamp, * down suh, Hadamard -> act[s] (fp16, k' order of the down trellis).
  3. down      grid (max_runs, H / BLOCK_N2): a run's rows x BLOCK_N2 output columns, Hadamard
     * svh * routing weight -> y[s] (fp32).
  4. combine   grid (T, H / 1024): out[t] = sum of y over the token's picks in pick order.
Hadamard products run on 64-halves (H128 = [[H64, H64], [H64, -H64]]) as dots with +-1 entries,
the 1/sqrt(128) applied in fp32: fp16 operands where exllamav3 keeps fp16 scratch (rotated
inputs, gate/up, activations), tf32 for the down output, which exllamav3 keeps in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .exl3_trellis import (
    _hadamard,
    _k_of_kprime,
    _n_of_half_row,
    decode_tile_half,
    decode_trellis_ref,
)
from .triton_env import interpreting

ROWS = 16  # slots per run: the N of the m16n8k16 products
FP16_SAFE = 65280.0
INV_SQRT128 = 1 / math.sqrt(128)
_SAFE: tl.constexpr = tl.constexpr(FP16_SAFE)
_INV128: tl.constexpr = tl.constexpr(INV_SQRT128)
MAX_TOKENS = 64  # the largest batch this path is sized for (buffers, run table)


@dataclass(frozen=True)
class DecodeConfig:
    """One launch configuration; `split_k` K splits of the gate/up GEMV, `block_k` input rows per
    step, `block_n2` output columns per down program."""

    name: str
    split_k: int
    block_k: int = 64
    block_n2: int = 256
    warps: int = 4
    stages: int = 2


DECODE_CONFIGS = {c.name: c for c in (
    DecodeConfig("split8", 8), DecodeConfig("split4", 4), DecodeConfig("split2", 2),
    DecodeConfig("split1", 1), DecodeConfig("split1_k128_w8", 1, block_k=128, warps=8),
    DecodeConfig("split2_n512", 2, block_n2=512), DecodeConfig("split4_k128_w8", 4, block_k=128, warps=8),
)}
# tokens per step -> config: enough gate/up programs to cover the SMs at ~T*k/1.1 runs
DEFAULT_BY_TOKENS = ((2, "split8"), (8, "split4"), (16, "split2"), (MAX_TOKENS, "split1"))


def default_config(tokens: int) -> DecodeConfig:
    for limit, name in DEFAULT_BY_TOKENS:
        if tokens <= limit:
            return DECODE_CONFIGS[name]
    raise ValueError(f"{tokens} tokens is above the decode path's {MAX_TOKENS}")


def max_runs(slots: int, experts: int) -> int:
    return min(slots, min(experts, slots) + slots // ROWS)


@triton.jit
def _prologue_kernel(x_ptr, x_stride, ids_ptr, gsuh_ptr, gsuh_stride, usuh_ptr, usuh_stride, xrot_ptr,
                     clamp_ptr, order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, meta_ptr, S, E,
                     TOPK: tl.constexpr, H: tl.constexpr, NB_PAD: tl.constexpr, S_PAD: tl.constexpr,
                     E_PAD: tl.constexpr, MAX_CHUNKS: tl.constexpr, ROWS: tl.constexpr, CHECK: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 2 * S:  # the run table
        s = tl.arange(0, S_PAD)
        ids = tl.load(ids_ptr + s, mask=s < S, other=E).to(tl.int32)  # padding sorts last, bin E
        tl.store(order_ptr + s, tl.sort(ids * S_PAD + s) % S_PAD, mask=s < S)
        e = tl.arange(0, E_PAD)
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
    dst = xrot_ptr + s * (2 * H) + p * H + lo
    tl.store(dst, (tl.dot((v0 + v1).to(tl.float16), hp) * _INV128).to(tl.float16), mask=inside)
    tl.store(dst + 64, (tl.dot((v0 - v1).to(tl.float16), hp) * _INV128).to(tl.float16), mask=inside)


@triton.jit
def _word_offsets(ROW_WORDS: tl.constexpr, BKT: tl.constexpr):
    """Offsets of words [nt, c0, kt, jr] of an 8-tile-wide column block and of their predecessors."""
    nt = tl.arange(0, 8)[:, None, None, None]
    c0 = tl.arange(0, 8)[None, :, None, None]
    kt = tl.arange(0, BKT)[None, None, :, None]
    jr = tl.arange(0, 4)[None, None, None, :]
    tile = nt * 32 + kt * ROW_WORDS
    return tile + c0 * 4 + jr, tile + (c0 * 4 + jr + 31) % 32


@triton.jit
def _run_slots(order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, r, ROWS: tl.constexpr):
    e = tl.load(run_e_ptr + r).to(tl.int64)
    start = tl.load(run_s_ptr + r)
    m = tl.arange(0, ROWS)
    valid = m < tl.load(run_n_ptr + r)
    slot = tl.load(order_ptr + start + m, mask=valid, other=0).to(tl.int64)
    return e, slot, valid


@triton.jit
def _gate_up_kernel(xrot_ptr, gtr_ptr, gtr_stride, utr_ptr, utr_stride, gsvh_ptr, gsvh_stride, usvh_ptr,
                    usvh_stride, dsuh_ptr, dsuh_stride, order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, meta_ptr,
                    part_ptr, part_split_stride, ctr_ptr, act_ptr, act_limit,
                    H: tl.constexpr, INTER: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
                    BLOCK_K: tl.constexpr, FAST: tl.constexpr):
    r = tl.program_id(0)
    nb = tl.program_id(1)
    ks = tl.program_id(2)
    if r >= tl.load(meta_ptr):
        return
    e, slot, valid = _run_slots(order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, r, ROWS)
    BKT: tl.constexpr = BLOCK_K // 16
    ROW_WORDS: tl.constexpr = (INTER // 16) * 32
    woff, poff = _word_offsets(ROW_WORDS, BKT)
    gbase = gtr_ptr + e * gtr_stride + nb * 256
    ubase = utr_ptr + e * utr_stride + nb * 256
    a_ptrs = xrot_ptr + slot[:, None] * (2 * H) + tl.arange(0, BLOCK_K)[None, :]
    acc_g0 = tl.zeros((ROWS, 64), dtype=tl.float32)
    acc_g1 = tl.zeros((ROWS, 64), dtype=tl.float32)
    acc_u0 = tl.zeros((ROWS, 64), dtype=tl.float32)
    acc_u1 = tl.zeros((ROWS, 64), dtype=tl.float32)
    KB: tl.constexpr = H // BLOCK_K // SPLIT_K
    for i in range(KB):
        kb = ks * KB + i
        koff = kb * (BKT * ROW_WORDS)
        at_g = tl.load(a_ptrs + kb * BLOCK_K, mask=valid[:, None], other=0.0)
        at_u = tl.load(a_ptrs + H + kb * BLOCK_K, mask=valid[:, None], other=0.0)
        w = tl.load(gbase + koff + woff).to(tl.uint32, bitcast=True)
        p = tl.load(gbase + koff + poff).to(tl.uint32, bitcast=True)
        acc_g0 = tl.dot(at_g, tl.trans(decode_tile_half(w, p, 0, 8, BKT, FAST)), acc_g0)
        acc_g1 = tl.dot(at_g, tl.trans(decode_tile_half(w, p, 1, 8, BKT, FAST)), acc_g1)
        w = tl.load(ubase + koff + woff).to(tl.uint32, bitcast=True)
        p = tl.load(ubase + koff + poff).to(tl.uint32, bitcast=True)
        acc_u0 = tl.dot(at_u, tl.trans(decode_tile_half(w, p, 0, 8, BKT, FAST)), acc_u0)
        acc_u1 = tl.dot(at_u, tl.trans(decode_tile_half(w, p, 1, 8, BKT, FAST)), acc_u1)
    half_row = tl.arange(0, 64)
    pbase = part_ptr + ks * part_split_stride + slot[:, None] * (2 * INTER) + nb * 128
    tl.store(pbase + _n_of_half_row(half_row, 0)[None, :], acc_g0, mask=valid[:, None])
    tl.store(pbase + _n_of_half_row(half_row, 1)[None, :], acc_g1, mask=valid[:, None])
    tl.store(pbase + INTER + _n_of_half_row(half_row, 0)[None, :], acc_u0, mask=valid[:, None])
    tl.store(pbase + INTER + _n_of_half_row(half_row, 1)[None, :], acc_u1, mask=valid[:, None])
    tl.debug_barrier()
    if SPLIT_K > 1:  # only the last split to arrive goes on
        counter = ctr_ptr + r * (INTER // 128) + nb
        if tl.atomic_add(counter, 1, sem="acq_rel") != SPLIT_K - 1:
            return
        tl.atomic_xchg(counter, 0)  # ready for the next call
    # finish the 128-column block, as 64-halves (H128 [g0; g1] = [H64 (g0 + g1); H64 (g0 - g1)]),
    # in fp16 operands like exllamav3's fp16 gate/up scratch; rows are slots, so every product
    # below is [ROWS, 64] x [64, 64] (H64 is symmetric: x H64 = (H64 x^T)^T)
    i = tl.arange(0, 64)
    g0 = tl.zeros((ROWS, 64), dtype=tl.float32)
    g1 = tl.zeros((ROWS, 64), dtype=tl.float32)
    u0 = tl.zeros((ROWS, 64), dtype=tl.float32)
    u1 = tl.zeros((ROWS, 64), dtype=tl.float32)
    for q in tl.static_range(SPLIT_K):
        src = part_ptr + q * part_split_stride + slot[:, None] * (2 * INTER) + nb * 128 + i[None, :]
        g0 += tl.load(src, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        g1 += tl.load(src + 64, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        u0 += tl.load(src + INTER, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        u1 += tl.load(src + INTER + 64, mask=valid[:, None], other=0.0, cache_modifier=".cg")
    had = _hadamard(i, i).to(tl.float16)
    col = nb * 128 + i
    gs = gsvh_ptr + e * gsvh_stride + col
    us = usvh_ptr + e * usvh_stride + col
    ds = dsuh_ptr + e * dsuh_stride + col
    a0 = _swiglu(tl.dot((g0 + g1).to(tl.float16), had) * (tl.load(gs).to(tl.float32) * _INV128)[None, :],
                 tl.dot((u0 + u1).to(tl.float16), had) * (tl.load(us).to(tl.float32) * _INV128)[None, :],
                 act_limit) * tl.load(ds).to(tl.float32)[None, :]
    a1 = _swiglu(tl.dot((g0 - g1).to(tl.float16), had) * (tl.load(gs + 64).to(tl.float32) * _INV128)[None, :],
                 tl.dot((u0 - u1).to(tl.float16), had) * (tl.load(us + 64).to(tl.float32) * _INV128)[None, :],
                 act_limit) * tl.load(ds + 64).to(tl.float32)[None, :]
    hp = _hadamard(i, _k_of_kprime(i)).to(tl.float16)  # [i, k'] = H64[i, k(k')]: columns in k' order
    dst = act_ptr + slot[:, None] * INTER + col[None, :]
    tl.store(dst, (tl.dot((a0 + a1).to(tl.float16), hp) * _INV128).to(tl.float16), mask=valid[:, None])
    tl.store(dst + 64, (tl.dot((a0 - a1).to(tl.float16), hp) * _INV128).to(tl.float16), mask=valid[:, None])


@triton.jit
def _swiglu(g, u, limit):
    if limit > 0:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def _down_kernel(act_ptr, dtr_ptr, dtr_stride, dsvh_ptr, dsvh_stride, rw_ptr, order_ptr, run_e_ptr, run_s_ptr,
                 run_n_ptr, meta_ptr, y_ptr,
                 H: tl.constexpr, INTER: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N2: tl.constexpr, FAST: tl.constexpr):
    r = tl.program_id(0)
    nb = tl.program_id(1)
    if r >= tl.load(meta_ptr):
        return
    e, slot, valid = _run_slots(order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, r, ROWS)
    BKT: tl.constexpr = BLOCK_K // 16
    ROW_WORDS: tl.constexpr = (H // 16) * 32
    woff, poff = _word_offsets(ROW_WORDS, BKT)
    a_ptrs = act_ptr + slot[:, None] * INTER + tl.arange(0, BLOCK_K)[None, :]
    scale = tl.load(rw_ptr + slot, mask=valid, other=0.0).to(tl.float32) * _INV128
    # output Hadamard from the two column-half accumulators (rows: slots, columns: n''): with
    # A[n'', j] = H64[n(0, n'') % 64, j], D = (-1)^bit3(j) (half 1 sits 8 columns right) and
    # S = diag(-1 on n'' >= 32, the right 64 columns): y[:, :64] = acc0 A + D (acc1 A),
    # y[:, 64:] = acc0 S A + D (acc1 S A)
    i = tl.arange(0, 64)
    amat = _hadamard(_n_of_half_row(i, 0) % 64, i)
    amat_s = amat * tl.where(i < 32, 1.0, -1.0)[:, None]
    dsign = (1 - 2 * ((i // 8) % 2)).to(tl.float32)[None, :]
    for sub in range(BLOCK_N2 // 128):
        col0 = nb * BLOCK_N2 + sub * 128
        base = dtr_ptr + e * dtr_stride + (col0 // 16) * 32
        acc0 = tl.zeros((ROWS, 64), dtype=tl.float32)
        acc1 = tl.zeros((ROWS, 64), dtype=tl.float32)
        for kb in range(INTER // BLOCK_K):
            koff = kb * (BKT * ROW_WORDS)
            at = tl.load(a_ptrs + kb * BLOCK_K, mask=valid[:, None], other=0.0)
            w = tl.load(base + koff + woff).to(tl.uint32, bitcast=True)
            p = tl.load(base + koff + poff).to(tl.uint32, bitcast=True)
            acc0 = tl.dot(at, tl.trans(decode_tile_half(w, p, 0, 8, BKT, FAST)), acc0)
            acc1 = tl.dot(at, tl.trans(decode_tile_half(w, p, 1, 8, BKT, FAST)), acc1)
        top = (tl.dot(acc0, amat, input_precision="tf32")
               + dsign * tl.dot(acc1, amat, input_precision="tf32"))
        bot = (tl.dot(acc0, amat_s, input_precision="tf32")
               + dsign * tl.dot(acc1, amat_s, input_precision="tf32"))
        sv = dsvh_ptr + e * dsvh_stride + col0 + i
        dst = y_ptr + slot[:, None] * H + col0 + i[None, :]
        tl.store(dst, top * tl.load(sv).to(tl.float32)[None, :] * scale[:, None], mask=valid[:, None])
        tl.store(dst + 64, bot * tl.load(sv + 64).to(tl.float32)[None, :] * scale[:, None], mask=valid[:, None])


@triton.jit
def _combine_kernel(y_ptr, out_ptr, out_stride, H: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j) * H + cols)
    tl.store(out_ptr + t * out_stride + cols, acc.to(out_ptr.dtype.element_ty))


class DecodeWorkspace:
    """Scratch of one (device, shape): run table, rotated inputs, partials, activations, slot
    outputs, and the zeroed completion counters the gate/up kernel leaves at zero."""

    def __init__(self, device, hidden: int, intermediate: int, top_k: int, experts: int,
                 max_tokens: int = MAX_TOKENS) -> None:
        s = max_tokens * top_k
        i32 = dict(dtype=torch.int32, device=device)
        self.slots, self.runs = s, max_runs(s, experts)
        self.order = torch.zeros(s, **i32)
        self.run_e, self.run_s, self.run_n = (torch.zeros(self.runs, **i32) for _ in range(3))
        self.meta = torch.zeros(1, **i32)
        self.counters = torch.zeros(self.runs * (intermediate // 128), **i32)
        self.xrot = torch.empty((s, 2, hidden), dtype=torch.float16, device=device)
        # split-k partials [split * slots]: room for two splits at the largest batch (the configs
        # split more only where there are fewer slots)
        self.part = torch.empty((2 * s, 2, intermediate), dtype=torch.float32, device=device)
        self.act = torch.empty((s, intermediate), dtype=torch.float16, device=device)
        self.y = torch.empty((s, hidden), dtype=torch.float32, device=device)


def _words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An int16 trellis view [E, in/16, out/16, 64] as int32 words and its expert stride in words."""
    if t.shape[-1] != 64 or t.stride(-1) != 1 or not t[0].is_contiguous():
        raise ValueError(f"need 4-bit trellis [E, in/16, out/16, 64] with contiguous experts, got "
                         f"{tuple(t.shape)} strides {tuple(t.stride())}")
    return t.view(torch.int32), t.stride(0) // 2


def exl3_moe_decode(x, topk_ids, topk_weights, gate, up, down, act_limit: float, clamped: torch.Tensor,
                    ws: DecodeWorkspace, config: DecodeConfig | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] in x's dtype. gate/up/down: (trellis, suh, svh) per projection
    (glmctl.plugin.quantization.exl3_experts.Exl3Projection works); `clamped` (int64, 0-d) counts the inputs
    beyond fp16's range."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    slots = tokens * top_k
    experts, inter = gate[0].shape[0], gate[2].shape[1]
    cfg = config or default_config(tokens)
    if (slots > ws.slots or cfg.split_k * slots > ws.part.shape[0] or hidden % cfg.block_n2 or inter % 128
            or (hidden // cfg.block_k) % cfg.split_k):
        raise ValueError(f"{tokens} tokens x top-{top_k} / config {cfg.name} exceed the workspace or shape")
    fast = not interpreting() and x.is_cuda
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    (gtr, gst), (utr, ust), (dtr, dst) = _words(gate[0]), _words(up[0]), _words(down[0])
    runs = max_runs(slots, experts)
    _prologue_kernel[(2 * slots + 1,)](
        x, x.stride(0), ids, gate[1], gate[1].stride(0), up[1], up[1].stride(0), ws.xrot, clamped,
        ws.order, ws.run_e, ws.run_s, ws.run_n, ws.meta, slots, experts,
        TOPK=top_k, H=hidden, NB_PAD=max(16, triton.next_power_of_2(hidden // 128)),
        S_PAD=triton.next_power_of_2(slots), E_PAD=triton.next_power_of_2(experts + 1),
        MAX_CHUNKS=triton.cdiv(tokens, ROWS), ROWS=ROWS, CHECK=x.dtype != torch.float16, num_warps=4)
    _gate_up_kernel[(runs, inter // 128, cfg.split_k)](
        ws.xrot, gtr, gst, utr, ust, gate[2], gate[2].stride(0), up[2], up[2].stride(0), down[1],
        down[1].stride(0), ws.order, ws.run_e, ws.run_s, ws.run_n, ws.meta, ws.part, slots * 2 * inter,
        ws.counters, ws.act, float(act_limit or 0.0),
        H=hidden, INTER=inter, ROWS=ROWS, SPLIT_K=cfg.split_k, BLOCK_K=cfg.block_k, FAST=fast,
        num_warps=cfg.warps, num_stages=cfg.stages)
    weights = topk_weights.reshape(-1)
    _down_kernel[(runs, hidden // cfg.block_n2)](
        ws.act, dtr, dst, down[2], down[2].stride(0), weights if weights.is_contiguous() else weights.contiguous(),
        ws.order, ws.run_e, ws.run_s, ws.run_n, ws.meta, ws.y,
        H=hidden, INTER=inter, ROWS=ROWS, BLOCK_K=64, BLOCK_N2=cfg.block_n2, FAST=fast,
        num_warps=cfg.warps, num_stages=cfg.stages)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    block = min(1024, hidden)
    _combine_kernel[(tokens, hidden // block)](ws.y, out, out.stride(0), H=hidden, TOPK=top_k, BLOCK=block,
                                               num_warps=4)
    return out


# -- reference ---------------------------------------------------------------------------------------
def dequantize_ref(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """fp32 (in, out) weight W = diag(suh) Had T Had diag(svh), T from `decode_trellis_ref`."""
    t = decode_trellis_ref(trellis.cpu(), bits).float()
    k, n = t.shape
    h = torch.ones((1, 1))
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(128)
    w = (h @ t.view(k // 128, 128, n)).reshape(k, n) * suh.cpu().float().unsqueeze(1)
    return (w.view(k, n // 128, 128) @ h).reshape(k, n) * svh.cpu().float().unsqueeze(0)


def exl3_moe_decode_ref(x, topk_ids, topk_weights, gate, up, down, act_limit: float) -> torch.Tensor:
    """fp32 routed-expert sum with the weights dequantised from the format's definition, inputs
    clamped to fp16 as the kernel sees them."""
    xf = x.float().clamp(-FP16_SAFE, FP16_SAFE).half().float().cpu()
    out = torch.zeros_like(xf)
    ids, w = topk_ids.cpu().long(), topk_weights.cpu().float()
    for e in ids.unique().tolist():
        tok, pick = (ids == e).nonzero(as_tuple=True)
        wg, wu, wd = (dequantize_ref(p[0][e], p[1][e], p[2][e]) for p in (gate, up, down))
        g, u = xf[tok] @ wg, xf[tok] @ wu
        if act_limit:
            g, u = g.clamp(max=act_limit), u.clamp(-act_limit, act_limit)
        out.index_add_(0, tok, (torch.nn.functional.silu(g) * u) @ wd * w[tok, pick].unsqueeze(1))
    return out


def shipped_configs(hidden: int = 4096, intermediate: int = 256, top_k: int = 8, experts: int = 288,
                    target_tokens: tuple[int, ...] = (1, 32)):
    """(name, jit function, {arg: type}, {constexpr: value}, options) of every launch the path
    makes at GLM-5.3-Flash's TP8 shape, for a cross-compile check (glmctl.kernels.sm89_check)."""
    i32, i64, f32 = "i32", "i64", "fp32"
    runs = dict(order_ptr="*i32", run_e_ptr="*i32", run_s_ptr="*i32", run_n_ptr="*i32", meta_ptr="*i32")
    for tokens in target_tokens:
        slots = tokens * top_k
        yield (f"exl3_decode_prologue[T{tokens}]", _prologue_kernel,
               dict(x_ptr="*bf16", x_stride=i64, ids_ptr="*i32", gsuh_ptr="*fp16", gsuh_stride=i64,
                    usuh_ptr="*fp16", usuh_stride=i64, xrot_ptr="*fp16", clamp_ptr="*i64", S=i32, E=i32, **runs),
               dict(TOPK=top_k, H=hidden, NB_PAD=max(16, hidden // 128), S_PAD=triton.next_power_of_2(slots),
                    E_PAD=triton.next_power_of_2(experts + 1), MAX_CHUNKS=triton.cdiv(tokens, ROWS), ROWS=ROWS,
                    CHECK=True),
               dict(num_warps=4, num_stages=1))
    for cfg in DECODE_CONFIGS.values():
        yield (f"exl3_decode_gate_up[{cfg.name}]", _gate_up_kernel,
               dict(xrot_ptr="*fp16", gtr_ptr="*i32", gtr_stride=i64, utr_ptr="*i32", utr_stride=i64,
                    gsvh_ptr="*fp16", gsvh_stride=i64, usvh_ptr="*fp16", usvh_stride=i64, dsuh_ptr="*fp16",
                    dsuh_stride=i64, part_ptr="*fp32", part_split_stride=i64, ctr_ptr="*i32", act_ptr="*fp16",
                    act_limit=f32, **runs),
               dict(H=hidden, INTER=intermediate, ROWS=ROWS, SPLIT_K=cfg.split_k, BLOCK_K=cfg.block_k, FAST=True),
               dict(num_warps=cfg.warps, num_stages=cfg.stages))
        yield (f"exl3_decode_down[{cfg.name}]", _down_kernel,
               dict(act_ptr="*fp16", dtr_ptr="*i32", dtr_stride=i64, dsvh_ptr="*fp16", dsvh_stride=i64,
                    rw_ptr="*fp32", y_ptr="*fp32", **runs),
               dict(H=hidden, INTER=intermediate, ROWS=ROWS, BLOCK_K=64, BLOCK_N2=cfg.block_n2,
                    FAST=True),
               dict(num_warps=cfg.warps, num_stages=cfg.stages))
    yield ("exl3_decode_combine", _combine_kernel, dict(y_ptr="*fp32", out_ptr="*bf16", out_stride=i64),
           dict(H=hidden, TOPK=top_k, BLOCK=1024), dict(num_warps=4, num_stages=1))
