"""Routed experts of one MoE layer on one TP rank at decode batch sizes, EXL3 4-bit weights, in
Triton, scheduled by the routing: every expert that the batch touches is decoded once per *run*
(up to ROWS (token, expert) slots of one expert, the M of every product), by many small programs
that each take one run, one projection, 128 output columns and one K split.

Shapes: T tokens x top-k picks = S slots (slot s is token s // k, pick s % k); E experts;
H hidden (gate/up input, down output); I intermediate channels on this rank. Weights are the
glmctl-exl3/1 tensors of glmctl.quantize.exl3_format, per projection: trellis [E, in/16, out/16,
64] int16 (K = 4), suh [E, in] and svh [E, out] fp16, each expert's slice contiguous (any expert
stride, so vLLM's stacked w13 views work). Decoding follows glmctl.kernels.exl3_trellis: the
products take the raw codebook integers r and `affine_epilogue` applies v = K_INV r + K_BIAS
with the row sums of the fp16 activations (xsum, dsum below).

Launches (grids depend on T only: CUDA-graph safe, no host sync, no allocation):
  1. prologue  grid 2S + 1. Program 2S builds the run table (slots sorted by expert, cut into
     runs of <= ROWS). Program 2s + p rotates slot s's token row for projection p: fp16 clamp
     (out-of-range values counted), * suh_p[e], 128-wide Hadamard -> xrot[s, p] (k' order) and
     its sum xsum[s, p].
  2. gate/up   grid (max_runs, 2 * I / 128, SPLIT_K): one run x 128 columns of one projection
     over one K split -> fp32 partials part[split, s, p] (the affine epilogue applied, the
     activation sum once, in split 0).
  3. finish    grid (max_runs, I / 128): a run's 128-column block from its partials summed in
     split order: Hadamard * svh, SwiGLU with GLM's clamp, * down suh, Hadamard -> act[s]
     (fp16, k' order of the down trellis) and its 128-column sums dsum[s, block].
  4. down      grid (max_runs, H / BLOCK_N2, DOWN_SPLIT): one run x BLOCK_N2 output columns over
     one K split -> y[split, s] (fp32, before the output rotation).
  5. combine   grid (T, H / (128 NBLK)): per token, NBLK 128-column blocks of each pick's y
     (splits summed in order): Hadamard, * svh * routing weight, picks summed in a fixed order.
The weight kernels (2, 4) hold nothing but the decode-and-multiply loop, so their registers
(and so the warps an SM keeps in flight) are the loop's.
Hadamard products run on 64-halves (H128 = [[H64, H64], [H64, -H64]]) as dots with +-1 entries,
the 1/sqrt(128) applied in fp32: fp16 operands where exllamav3 keeps fp16 scratch (rotated
inputs, gate/up, activations), tf32x3 for the output, which exllamav3 keeps in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .exl3_moe_rotate import combine_launch, prologue_launch
from .exl3_trellis import (
    _hadamard,
    _k_of_kprime,
    _n_of_half_row,
    affine_epilogue,
    block_offsets,
    decode_block,
    decode_trellis_ref,
)
from .triton_env import dot_dtype, interpreting

ROWS = 16  # slots per run: the M of the m16n8k16 products
FP16_SAFE = 65280.0
INV_SQRT128 = 1 / math.sqrt(128)
_INV128: tl.constexpr = tl.constexpr(INV_SQRT128)
MAX_TOKENS = 64  # the largest batch this path is sized for (buffers, run table)


@dataclass(frozen=True)
class DecodeConfig:
    """One launch configuration: `split_k` K splits of each gate/up column block (the partials
    hold split_k * tokens <= 2 * MAX_TOKENS), `block_k` input rows per gate/up step,
    `down_split` K splits of the down projection, `block_n2` output columns per down program,
    `warps` / `stages` of both weight kernels, `rows` slots per run (the products' M: 16 at
    decode sizes; 64 for prefill slices, where an expert holds ~T x k / E slots);
    `rotate_in_down`: the down kernel applies the output rotation, scales and routing weight to
    its [rows, 128] blocks, and the picks are summed after it (at prefill sizes the per-token
    combine launch cost more than the down products: 0.69 vs 0.35 ms at 2,048 tokens, H200)."""

    name: str
    split_k: int
    block_k: int = 64
    down_split: int = 1
    block_n2: int = 128
    warps: int = 4
    stages: int = 1
    rows: int = ROWS
    rotate_in_down: bool = False


DECODE_CONFIGS = {c.name: c for c in (
    DecodeConfig("split16_d4", 16, down_split=4), DecodeConfig("split8_d2", 8, down_split=2),
    DecodeConfig("split8", 8), DecodeConfig("split4", 4), DecodeConfig("split2", 2), DecodeConfig("split1", 1),
    DecodeConfig("split4_s2", 4, stages=2), DecodeConfig("split4_k128", 4, block_k=128),
    DecodeConfig("split4_w8", 4, warps=8), DecodeConfig("split4_n256", 4, block_n2=256),
    DecodeConfig("split8_s2", 8, stages=2),
    DecodeConfig("prefill_r64", 1, rows=64, warps=8, rotate_in_down=True),
    DecodeConfig("prefill_r32", 1, rows=32, rotate_in_down=True),
    DecodeConfig("prefill_r64_combine", 1, rows=64, warps=8),
)}
# tokens per step -> config: gate/up programs ~ runs x 4 x split_k and down programs ~ runs x
# 32 x down_split, several waves of 132-142 SMs at every size
DEFAULT_BY_TOKENS = ((2, "split16_d4"), (4, "split8_d2"), (16, "split8"), (32, "split4"), (MAX_TOKENS, "split2"))


def default_config(tokens: int) -> DecodeConfig:
    for limit, name in DEFAULT_BY_TOKENS:
        if tokens <= limit:
            return DECODE_CONFIGS[name]
    raise ValueError(f"{tokens} tokens is above the decode path's {MAX_TOKENS}")


def max_runs(slots: int, experts: int, rows: int = ROWS) -> int:
    return min(slots, min(experts, slots) + slots // rows)


@triton.jit
def _run_slots(order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, r, ROWS: tl.constexpr, first=0):
    """Run r's expert and ROWS of its slots from the run's `first` on (masked past its end)."""
    e = tl.load(run_e_ptr + r).to(tl.int64)
    start = tl.load(run_s_ptr + r)
    m = first + tl.arange(0, ROWS)
    valid = m < tl.load(run_n_ptr + r)
    slot = tl.load(order_ptr + start + m, mask=valid, other=0).to(tl.int64)
    return e, slot, valid


@triton.jit
def _run_gemv(base, a_ptrs, valid, ROW_WORDS: tl.constexpr, KB: tl.constexpr, BKT: tl.constexpr,
              ROWS: tl.constexpr, AFFINE: tl.constexpr, FAST: tl.constexpr):
    """Products of a run's activations (a_ptrs: [ROWS, BKT*16] fp16 in k' order, advancing by
    BKT*16 per step) with KB steps of BKT tile rows x 8 tile columns of a trellis at `base`
    (int32 words): the two column-half accumulators [ROWS, 64] (rows n'' of the halves), raw
    (the MoE kernels) or of the fp16 codebook values with AFFINE (the decode-rate bench)."""
    woff, poff = block_offsets(ROW_WORDS, BKT)
    acc0 = tl.zeros((ROWS, 64), dtype=tl.float32)
    acc1 = tl.zeros((ROWS, 64), dtype=tl.float32)
    for kb in range(KB):
        koff = kb * (BKT * ROW_WORDS)
        w = tl.load(base + koff + woff).to(tl.uint32, bitcast=True)
        p = tl.load(base + koff + poff).to(tl.uint32, bitcast=True)
        at = tl.load(a_ptrs + kb * (BKT * 16), mask=valid[:, None], other=0.0)
        h0, h1 = decode_block(w, p, BKT, AFFINE, FAST)
        acc0 = tl.dot(at, tl.trans(h0), acc0)
        acc1 = tl.dot(at, tl.trans(h1), acc1)
    return acc0, acc1


@triton.jit
def _gate_up_kernel(xrot_ptr, xsum_ptr, gtr_ptr, gtr_stride, utr_ptr, utr_stride, order_ptr, run_e_ptr, run_s_ptr,
                    run_n_ptr, meta_ptr, part_ptr, part_split_stride,
                    H: tl.constexpr, INTER: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
                    BLOCK_K: tl.constexpr, FAST: tl.constexpr):
    r = tl.program_id(0)
    nb = tl.program_id(1) // 2
    p = tl.program_id(1) % 2
    ks = tl.program_id(2)
    if r >= tl.load(meta_ptr):
        return
    e, slot, valid = _run_slots(order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, r, ROWS)
    BKT: tl.constexpr = BLOCK_K // 16
    KB: tl.constexpr = H // BLOCK_K // SPLIT_K
    if p == 0:
        base = gtr_ptr + e * gtr_stride
    else:
        base = utr_ptr + e * utr_stride
    base += nb * 256 + ks * (KB * BKT * (INTER // 16) * 32)
    a_ptrs = xrot_ptr + slot[:, None] * (2 * H) + p * H + ks * (KB * BLOCK_K) + tl.arange(0, BLOCK_K)[None, :]
    acc0, acc1 = _run_gemv(base, a_ptrs, valid, (INTER // 16) * 32, KB, BKT, ROWS, False, FAST)
    xs = tl.where(ks == 0, tl.load(xsum_ptr + slot * 2 + p, mask=valid, other=0.0), 0.0)
    half_row = tl.arange(0, 64)
    pbase = part_ptr + ks * part_split_stride + slot[:, None] * (2 * INTER) + p * INTER + nb * 128
    tl.store(pbase + _n_of_half_row(half_row, 0)[None, :], affine_epilogue(acc0, xs), mask=valid[:, None])
    tl.store(pbase + _n_of_half_row(half_row, 1)[None, :], affine_epilogue(acc1, xs), mask=valid[:, None])


@triton.jit
def _finish_kernel(part_ptr, part_split_stride, gsvh_ptr, gsvh_stride, usvh_ptr, usvh_stride, dsuh_ptr, dsuh_stride,
                   order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, meta_ptr, act_ptr, dsum_ptr, act_limit,
                   INTER: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr):
    """One 128-column block of ROWS slots of a run (grid axis 2: which ROWS of a longer run; the
    work is row by row, so runs of any length are finished in 16-row pieces without spilling),
    from the summed partials to the down input, as 64-halves (H128 [g0; g1] = [H64 (g0 + g1);
    H64 (g0 - g1)]) in fp16 operands like exllamav3's fp16 gate/up scratch; rows are slots, so
    every product is [ROWS, 64] x [64, 64] (H64 is symmetric)."""
    r = tl.program_id(0)
    nb = tl.program_id(1)
    if r >= tl.load(meta_ptr):
        return
    e, slot, valid = _run_slots(order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, r, ROWS, tl.program_id(2) * ROWS)
    i = tl.arange(0, 64)
    g0 = tl.zeros((ROWS, 64), dtype=tl.float32)
    g1 = tl.zeros((ROWS, 64), dtype=tl.float32)
    u0 = tl.zeros((ROWS, 64), dtype=tl.float32)
    u1 = tl.zeros((ROWS, 64), dtype=tl.float32)
    for q in range(SPLIT_K):  # in split order
        src = part_ptr + q * part_split_stride + slot[:, None] * (2 * INTER) + nb * 128 + i[None, :]
        g0 += tl.load(src, mask=valid[:, None], other=0.0)
        g1 += tl.load(src + 64, mask=valid[:, None], other=0.0)
        u0 += tl.load(src + INTER, mask=valid[:, None], other=0.0)
        u1 += tl.load(src + INTER + 64, mask=valid[:, None], other=0.0)
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
    out0 = (tl.dot((a0 + a1).to(tl.float16), hp) * _INV128).to(tl.float16)
    out1 = (tl.dot((a0 - a1).to(tl.float16), hp) * _INV128).to(tl.float16)
    dst = act_ptr + slot[:, None] * INTER + col[None, :]
    tl.store(dst, out0, mask=valid[:, None])
    tl.store(dst + 64, out1, mask=valid[:, None])
    # the sums of the fp16 values the down products read (their affine epilogue)
    tl.store(dsum_ptr + slot * (INTER // 128) + nb, tl.sum(out0.to(tl.float32) + out1.to(tl.float32), 1),
             mask=valid)


@triton.jit
def _hi_lo(a, DOT_T: tl.constexpr):
    """fp32 a as hi + lo in DOT_T (bf16: 16 significant bits together, for products with +-1
    matrices accumulated in fp32; fp32 under the interpreter: lo = 0)."""
    hi = a.to(DOT_T)
    return hi, (a - hi.to(tl.float32)).to(DOT_T)


@triton.jit
def _swiglu(g, u, limit):
    if limit > 0:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def _down_kernel(act_ptr, dsum_ptr, dtr_ptr, dtr_stride, order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, meta_ptr,
                 y_ptr, y_split_stride, w_ptr, svh_ptr, svh_stride,
                 H: tl.constexpr, INTER: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N2: tl.constexpr, DOWN_SPLIT: tl.constexpr, FAST: tl.constexpr, ROTATE: tl.constexpr,
                 DOT_T: tl.constexpr):
    """y[split, slot] before the output rotation (the combine applies it), or with ROTATE the
    slot's finished contribution: Had128 per 128-column block / sqrt(128) * svh * routing weight,
    in natural column order (the products' columns are the block's 8-of-16 halves, so the
    rotation is four [ROWS, 64] x [64, 64] products with the Hadamard's rows permuted to match);
    w_ptr / svh_ptr are read only with ROTATE."""
    r = tl.program_id(0)
    nb = tl.program_id(1)
    ks = tl.program_id(2)
    if r >= tl.load(meta_ptr):
        return
    e, slot, valid = _run_slots(order_ptr, run_e_ptr, run_s_ptr, run_n_ptr, r, ROWS)
    BKT: tl.constexpr = BLOCK_K // 16
    KB: tl.constexpr = INTER // BLOCK_K // DOWN_SPLIT
    ROW_WORDS: tl.constexpr = (H // 16) * 32
    a_ptrs = act_ptr + slot[:, None] * INTER + ks * (KB * BLOCK_K) + tl.arange(0, BLOCK_K)[None, :]
    nblk = tl.arange(0, INTER // 128)
    ds = tl.sum(tl.load(dsum_ptr + slot[:, None] * (INTER // 128) + nblk[None, :], mask=valid[:, None],
                        other=0.0), 1)
    ds = tl.where(ks == 0, ds, 0.0)
    half_row = tl.arange(0, 64)
    for sub in tl.static_range(BLOCK_N2 // 128):
        col0 = nb * BLOCK_N2 + sub * 128
        base = dtr_ptr + e * dtr_stride + (col0 // 16) * 32 + ks * (KB * BKT * ROW_WORDS)
        acc0, acc1 = _run_gemv(base, a_ptrs, valid, ROW_WORDS, KB, BKT, ROWS, False, FAST)
        dst = y_ptr + ks * y_split_stride + slot[:, None] * H + col0
        if ROTATE:
            y0, y1 = affine_epilogue(acc0, ds), affine_epilogue(acc1, ds)
            y0h, y0l = _hi_lo(y0, DOT_T)
            y1h, y1l = _hi_lo(y1, DOT_T)
            n0, n1 = _n_of_half_row(half_row, 0), _n_of_half_row(half_row, 1)
            scale = tl.load(w_ptr + slot, mask=valid, other=0.0).to(tl.float32) * _INV128
            sv = svh_ptr + e * svh_stride + col0 + half_row
            for half in tl.static_range(2):  # output columns [0, 64) then [64, 128) of the block
                h0 = _hadamard(n0, half_row + 64 * half).to(DOT_T)
                h1 = _hadamard(n1, half_row + 64 * half).to(DOT_T)
                out = tl.dot(y0h, h0) + tl.dot(y0l, h0) + tl.dot(y1h, h1) + tl.dot(y1l, h1)
                out = out * scale[:, None] * tl.load(sv + 64 * half).to(tl.float32)[None, :]
                tl.store(dst + 64 * half + half_row[None, :], out, mask=valid[:, None])
        else:
            tl.store(dst + _n_of_half_row(half_row, 0)[None, :], affine_epilogue(acc0, ds), mask=valid[:, None])
            tl.store(dst + _n_of_half_row(half_row, 1)[None, :], affine_epilogue(acc1, ds), mask=valid[:, None])


class DecodeWorkspace:
    """Scratch of one (device, shape): run table, rotated inputs and their sums, split partials,
    activations and their sums, slot outputs."""

    def __init__(self, device, hidden: int, intermediate: int, top_k: int, experts: int,
                 max_tokens: int = MAX_TOKENS, splits: int = 2) -> None:
        s = max_tokens * top_k
        i32, f32 = dict(dtype=torch.int32, device=device), dict(dtype=torch.float32, device=device)
        self.slots, self.runs = s, max_runs(s, experts)  # ROWS-slot runs: the most any config cuts
        self.order = torch.zeros(s, **i32)
        self.counts = torch.zeros(experts + 1, **i32)  # slots per expert (torch-sorted run tables)
        self.run_e, self.run_s, self.run_n = (torch.zeros(self.runs, **i32) for _ in range(3))
        self.meta = torch.zeros(1, **i32)
        self.xrot = torch.empty((s, 2, hidden), dtype=torch.float16, device=device)
        self.xsum = torch.empty((s, 2), **f32)
        # split partials: split_k * tokens <= splits * max_tokens; slot outputs: down_split *
        # tokens <= splits * max_tokens (the decode configs split more only where there are fewer
        # tokens; the prefill workspace holds one split)
        self.part = torch.empty((splits * s, 2, intermediate), **f32)
        self.act = torch.empty((s, intermediate), dtype=torch.float16, device=device)
        self.dsum = torch.empty((s, intermediate // 128), **f32)
        self.y = torch.empty((splits * s, hidden), **f32)


def _words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An int16 trellis view [E, in/16, out/16, 64] as int32 words and its expert stride in words."""
    if t.shape[-1] != 64 or t.stride(-1) != 1 or not t[0].is_contiguous():
        raise ValueError(f"need 4-bit trellis [E, in/16, out/16, 64] with contiguous experts, got "
                         f"{tuple(t.shape)} strides {tuple(t.stride())}")
    return t.view(torch.int32), t.stride(0) // 2


def check_config(cfg: DecodeConfig, tokens: int, top_k: int, hidden: int, inter: int, ws: DecodeWorkspace) -> None:
    slots = tokens * top_k
    bad = [why for why, ok in (
        (f"{slots} slots > workspace {ws.slots}", slots <= ws.slots),
        ("split_k partials beyond the workspace", cfg.split_k * slots <= ws.part.shape[0]),
        ("down_split outputs beyond the workspace", cfg.down_split * slots <= ws.y.shape[0]),
        ("block_n2 must divide hidden", hidden % cfg.block_n2 == 0 and cfg.block_n2 % 128 == 0),
        ("intermediate must be a multiple of 128", inter % 128 == 0),
        ("rows must be 16, 32 or 64", cfg.rows in (16, 32, 64)),
        ("split_k must divide hidden / block_k", (hidden // cfg.block_k) % cfg.split_k == 0),
        ("down_split must divide intermediate / 64", (inter // 64) % cfg.down_split == 0),
    ) if not ok]
    if bad:
        raise ValueError(f"{tokens} tokens x top-{top_k} / config {cfg.name}: {'; '.join(bad)}")


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
    check_config(cfg, tokens, top_k, hidden, inter, ws)
    fast = not interpreting() and x.is_cuda
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    (gtr, gst), (utr, ust), (dtr, dst) = _words(gate[0]), _words(up[0]), _words(down[0])
    rows = cfg.rows
    runs = max_runs(slots, experts, rows)
    prologue_launch(x, ids, gate[1], up[1], ws, clamped, top_k, experts, rows)
    run_table = (ws.order, ws.run_e, ws.run_s, ws.run_n, ws.meta)
    _gate_up_kernel[(runs, 2 * (inter // 128), cfg.split_k)](
        ws.xrot, ws.xsum, gtr, gst, utr, ust, *run_table, ws.part, slots * 2 * inter,
        H=hidden, INTER=inter, ROWS=rows, SPLIT_K=cfg.split_k, BLOCK_K=cfg.block_k, FAST=fast,
        num_warps=cfg.warps, num_stages=cfg.stages)
    _finish_kernel[(runs, inter // 128, rows // ROWS)](
        ws.part, slots * 2 * inter, gate[2], gate[2].stride(0), up[2], up[2].stride(0), down[1], down[1].stride(0),
        *run_table, ws.act, ws.dsum, float(act_limit or 0.0), INTER=inter, ROWS=ROWS, SPLIT_K=cfg.split_k,
        num_warps=4)
    weights = topk_weights.reshape(-1)
    weights = weights if weights.is_contiguous() else weights.contiguous()
    _down_kernel[(runs, hidden // cfg.block_n2, cfg.down_split)](
        ws.act, ws.dsum, dtr, dst, *run_table, ws.y, slots * hidden, weights, down[2], down[2].stride(0),
        H=hidden, INTER=inter, ROWS=rows, BLOCK_K=64, BLOCK_N2=cfg.block_n2, DOWN_SPLIT=cfg.down_split,
        FAST=fast, ROTATE=cfg.rotate_in_down, DOT_T=dot_dtype(), num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.rotate_in_down:  # each slot's finished contribution: the token's picks summed in order
        y = ws.y[: cfg.down_split * slots].view(cfg.down_split, tokens, top_k, hidden)
        return y.sum(dim=(0, 2)).to(x.dtype)
    return combine_launch(x, ids, weights, down[2], ws.y, slots * hidden, top_k, cfg.down_split)


# -- reference ---------------------------------------------------------------------------------------
def dequantize_ref(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """fp32 (in, out) weight W = diag(suh) Had T Had diag(svh), T from `decode_trellis_ref`, on the
    trellis's device."""
    t = decode_trellis_ref(trellis, bits).float()
    k, n = t.shape
    h = torch.ones((1, 1), device=t.device)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(128)
    w = (h @ t.view(k // 128, 128, n)).reshape(k, n) * suh.float().unsqueeze(1)
    return (w.view(k, n // 128, 128) @ h).reshape(k, n) * svh.float().unsqueeze(0)


def exl3_moe_decode_ref(x, topk_ids, topk_weights, gate, up, down, act_limit: float) -> torch.Tensor:
    """fp32 routed-expert sum with the weights dequantised from the format's definition, inputs
    clamped to fp16 as the kernel sees them."""
    xf = x.float().clamp(-FP16_SAFE, FP16_SAFE).half().float().cpu()
    out = torch.zeros_like(xf)
    ids, w = topk_ids.cpu().long(), topk_weights.cpu().float()
    for e in ids.unique().tolist():
        tok, pick = (ids == e).nonzero(as_tuple=True)
        wg, wu, wd = (dequantize_ref(p[0][e].cpu(), p[1][e].cpu(), p[2][e].cpu()) for p in (gate, up, down))
        g, u = xf[tok] @ wg, xf[tok] @ wu
        if act_limit:
            g, u = g.clamp(max=act_limit), u.clamp(-act_limit, act_limit)
        out.index_add_(0, tok, (torch.nn.functional.silu(g) * u) @ wd * w[tok, pick].unsqueeze(1))
    return out

