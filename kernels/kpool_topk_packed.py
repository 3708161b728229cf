"""The kpool top-k with packed-counter radix steps: one program per row, a short chain of
block-wide reductions, and (for decode) the row's length computed from vLLM's positions and
context lengths in the kernel. Same output as :func:`.kpool_topk.kpool_topk_ref`.

One program per row of ``n`` complete pools (``n <= select`` rows take the causal fill):

1. column maxima: pool ``p`` belongs to column ``p % COLS`` (``COLS >= select``); the
   ``select``-th largest column maximum ``t0`` (resolved to its top ``4 * t0_steps`` bits, a
   lower bound) bounds the answer from below: at least ``select`` pools score >= ``t0``;
2. compaction: the pools >= ``t0`` (``C`` of them, in pool order) go to a scratch area inside the
   row's own output (pools at ``[0, CAP)``, keys at ``[CAP, 2 CAP)``; step 3 overwrites the first
   ``select * kpool`` columns completely);
3. ``C <= CAP``: the exact ``select``-th largest candidate key and how many of its ties to keep
   (lowest pools first), then one scan gives every kept candidate its output slot; the pools are
   written in ascending order, expanded to tokens. ``C > CAP`` (ties crowding the bound): the
   radix select of :mod:`.kpool_topk_select` over the whole row, slower, same result.

What makes it short: a radix step is ONE block-wide reduction. Keys are 32-bit; a step resolves
4 bits: every key that matches the prefix so far adds a one to a 16-bit lane of one of four
int64 words (16 bins), the four words are summed across the block, and the rest of the step
(suffix counts of the 16 bins, the bin holding the k-th key, how many keys lie above it) is
SWAR arithmetic on those four scalars, which every thread does alike: no per-bin tensors, no
further reductions. Lanes never carry: a select counts at most ``max(COLS, CAP) <= 8192`` keys.
The steps are a loop, not unrolled, which keeps the kernel's code small.

Keys: fp32 -> int32 in signed order (:func:`order_key32`, -0.0 == +0.0); the radix works on the
same bits with the sign bit flipped (unsigned order).

Row lengths: ``seq_lens[row]`` (int32 tokens), or, for decode rows,
``min(positions[row] + 1, (context_pools[row] + 1) * kpool - 1)`` from vLLM's int64 positions
and int32 pool-granular context lengths (a row's complete pools never exceed its context, whose
logits are the only ones written). Rows at or past ``valid_rows`` are written -1 in full
(CUDA-graph padding). Graph safe: no allocation, no host sync, one program per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kpool_topk_select import _select_and_write, _write_tail_and_padding, scratch_capacity

INT_MIN = tl.constexpr(-2147483648)
LANES = tl.constexpr(0x0001000100010001)  # a one in each 16-bit lane of an int64
FLAGS = tl.constexpr(0x4000400040004000)  # bit 14 of each lane: lanes hold < 2^14
MAX_COUNTED = 8192  # the most keys one packed select counts (COLS, CAP)


@dataclass(frozen=True)
class PackedTopkConfig:
    """``rows`` x ``cols`` logits per step of the row passes (``cols`` >= select is also the
    number of columns of the bound), candidate capacity ``cap`` (halved to fit the scratch, see
    :func:`packed_capacity`), ``num_warps``, and ``t0_steps`` 4-bit digits of the bound."""

    name: str
    rows: int = 8
    cols: int = 256
    cap: int = 512
    num_warps: int = 4
    t0_steps: int = 4


@triton.jit
def order_key32(x):
    """fp32 -> int32 with the same order as signed integers; -0.0 and +0.0 get one key (they
    are equal: the lower pool wins, as in the reference)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _suffix_lanes(c):
    """Lane j of the result = sum of lanes >= j of ``c`` (non-negative, no lane overflow)."""
    return c + (c >> 16) + (c >> 32) + (c >> 48)


@triton.jit
def _lanes_at_least(s, r_lanes):
    """How many of the four lanes of ``s`` are >= the lane value of ``r_lanes`` (SWAR: bit 14
    of ``(lane | 2^14) - r`` survives iff lane >= r; lanes and r are < 2^14)."""
    f = (((s | FLAGS) - r_lanes) & FLAGS) >> 14
    return (f + (f >> 16) + (f >> 32) + (f >> 48)) & 0xFFFF


@triton.jit
def _kth_packed(u, ok, k, STEPS: tl.constexpr):
    """(prefix, ties): the ``k``-th largest of ``u[ok]`` (int32 bits read unsigned) resolved to
    its top ``4 * STEPS`` bits (lower bits zero), and how many keys equal to it the ``k`` best
    include (exact when STEPS == 8). Needs 1 <= k <= count(ok) <= MAX_COUNTED."""
    prefix = tl.zeros([], tl.int32)
    remaining = tl.full([], k, tl.int64)
    for step in range(STEPS):
        shift = 28 - 4 * step
        diff = (u ^ prefix) >> shift  # arithmetic: the bits above the digit are 0 iff matching
        match = ok & (((diff >> 4) == 0) | (step == 0))
        digit = diff & 15
        one = tl.where(match, tl.full(u.shape, 1, tl.int64) << ((digit & 3) * 16).to(tl.int64), 0)
        word = digit >> 2
        c0, c1, c2, c3 = tl.reduce((tl.where(word == 0, one, 0), tl.where(word == 1, one, 0),
                                    tl.where(word == 2, one, 0), tl.where(word == 3, one, 0)),
                                   0, _add4)
        s0, s1, s2, s3 = _suffix_lanes(c0), _suffix_lanes(c1), _suffix_lanes(c2), _suffix_lanes(c3)
        # keys in the words above: digit d = 4 w + j counts s_w's lane j plus every higher word
        a3 = tl.zeros([], tl.int64)
        a2 = s3 & 0xFFFF
        a1 = a2 + (s2 & 0xFFFF)
        a0 = a1 + (s1 & 0xFFFF)
        s0 += a0 * LANES
        s1 += a1 * LANES
        s2 += a2 * LANES
        r_lanes = remaining * LANES
        # suffix counts fall with the digit: the chosen digit is the last one still >= remaining
        chosen = (_lanes_at_least(s0, r_lanes) + _lanes_at_least(s1, r_lanes)
                  + _lanes_at_least(s2, r_lanes) + _lanes_at_least(s3, r_lanes) - 1)
        w = chosen >> 2
        j = chosen & 3
        s_w = tl.where(w == 0, s0, tl.where(w == 1, s1, tl.where(w == 2, s2, s3)))
        a_w = tl.where(w == 0, a0, tl.where(w == 1, a1, tl.where(w == 2, a2, a3)))
        above = tl.where(j == 3, a_w, (s_w >> (16 * tl.minimum(j + 1, 3))) & 0xFFFF)
        remaining -= above
        prefix = prefix | (chosen.to(tl.int32) << shift)
    return prefix, remaining


@triton.jit
def _kpool_topk_packed_kernel(
    logits_ptr, logits_stride, starts_ptr, seq_ptr, pos_ptr, ctx_ptr, out_ptr, out_stride,
    out_width, valid_rows,
    HAS_STARTS: tl.constexpr, FROM_POSITIONS: tl.constexpr, KPOOL: tl.constexpr,
    SELECT: tl.constexpr, TAIL: tl.constexpr, R: tl.constexpr, COLS: tl.constexpr,
    CAP: tl.constexpr, T0_STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    live_row = row < valid_rows
    row = row.to(tl.int64)
    if FROM_POSITIONS:
        pos = tl.load(pos_ptr + row, mask=live_row, other=-1).to(tl.int64)
        ctx = tl.load(ctx_ptr + row, mask=live_row, other=0).to(tl.int64)
        seq = tl.maximum(tl.minimum(pos + 1, (ctx + 1) * KPOOL - 1), 0).to(tl.int32)
    else:
        seq = tl.maximum(tl.load(seq_ptr + row, mask=live_row, other=0), 0)
    n = seq // KPOOL
    out_row = out_ptr + row * out_stride
    row_logits = logits_ptr + row * logits_stride
    if HAS_STARTS:
        row_logits += tl.load(starts_ptr + row, mask=live_row, other=0)
    lane = tl.arange(0, BLOCK)
    sub = tl.arange(0, KPOOL)

    if n <= SELECT:
        for c0 in range(0, SELECT * KPOOL, BLOCK):
            col = c0 + lane
            tl.store(out_row + col, tl.where(col < n * KPOOL, col, -1), mask=col < SELECT * KPOOL)
    else:
        # 1. the bound: the SELECT-th largest column maximum (empty columns are not counted).
        cols = tl.arange(0, COLS)
        tile = tl.arange(0, R)[:, None] * COLS + cols[None, :]
        acc = tl.full([R, COLS], INT_MIN, tl.int32)
        for c0 in range(0, n, R * COLS):
            ok = c0 + tile < n
            key = order_key32(tl.load(row_logits + c0 + tile, mask=ok, other=0.0))
            acc = tl.maximum(acc, tl.where(ok, key, INT_MIN))
        col_max = tl.max(acc, axis=0)
        t0, _ = _kth_packed(col_max ^ INT_MIN, cols < n, SELECT, T0_STEPS)
        t0 = t0 ^ INT_MIN
        # 2. compact the pools >= t0, in pool order, into the scratch.
        flat = tl.arange(0, R * COLS)
        found = tl.zeros([], tl.int32)
        for c0 in range(0, n, R * COLS):
            pool = c0 + flat
            ok = pool < n
            key = order_key32(tl.load(row_logits + pool, mask=ok, other=0.0))
            cand = (ok & (key >= t0)).to(tl.int32)
            at = found + tl.cumsum(cand, axis=0) - cand
            keep = (cand > 0) & (at < CAP)
            tl.store(out_row + at, pool, mask=keep)
            tl.store(out_row + CAP + at, key, mask=keep)
            found += tl.sum(cand, axis=0)
        tl.debug_barrier()  # the scratch written by every thread, before anyone reads it
        if found <= CAP:
            # 3. the exact select among the candidates, then each kept one's output slot.
            slot = tl.arange(0, CAP)
            live = slot < found
            c_pool = tl.load(out_row + slot, mask=live, other=0)
            c_key = tl.load(out_row + CAP + slot, mask=live, other=0)
            tl.debug_barrier()  # every candidate loaded before the output overwrites them
            thr, ties = _kth_packed(c_key ^ INT_MIN, live, SELECT, 8)
            thr = thr ^ INT_MIN
            above = live & (c_key > thr)
            tie = live & (c_key == thr)
            packed = above.to(tl.int32) + (tie.to(tl.int32) << 16)
            before = tl.cumsum(packed, axis=0) - packed  # counts of earlier candidates
            ties_before = before >> 16
            take = above | (tie & (ties_before < ties))
            at = (before & 0xFFFF) + tl.minimum(ties_before, ties)
            tokens = c_pool[:, None] * KPOOL + sub[None, :]
            tl.store(out_row + at[:, None] * KPOOL + sub[None, :], tokens, mask=take[:, None])
        else:
            _select_and_write(row_logits, seq_ptr, n, out_row, False, KPOOL, SELECT, 1024)

    _write_tail_and_padding(out_row, n, seq, out_width, KPOOL, SELECT, TAIL, BLOCK)


def packed_capacity(config: PackedTopkConfig, select_pools: int, kpool: int) -> int:
    """The candidate capacity: the config's, halved until the scratch (pools and keys) fits in
    the first ``select_pools * kpool`` output columns; 0 when that leaves fewer than
    ``select_pools`` or the config's columns cannot bound ``select_pools`` (the caller then
    uses another kernel)."""
    cap = scratch_capacity(min(config.cap, MAX_COUNTED), select_pools, kpool)
    fits = cap >= select_pools and select_pools <= config.cols <= MAX_COUNTED
    return cap if fits else 0


def launch_kpool_topk_packed(logits: torch.Tensor, out: torch.Tensor, *, kpool: int,
                             select_pools: int, config: PackedTopkConfig, cap: int,
                             seq_lens: torch.Tensor | None = None,
                             positions: torch.Tensor | None = None,
                             context_pools: torch.Tensor | None = None,
                             row_starts: torch.Tensor | None = None,
                             valid_rows: int | None = None) -> torch.Tensor:
    """One program per row of ``out`` (see module doc): lengths from ``seq_lens`` (int32), or
    from ``positions`` (int64 or int32) and ``context_pools`` (int32), one per valid row;
    ``cap`` from :func:`packed_capacity`. Rows from ``valid_rows`` (default: all) are -1."""
    from_positions = seq_lens is None
    if from_positions:
        assert positions is not None and context_pools is not None
        assert positions.is_contiguous() and context_pools.is_contiguous()
    rows = out.shape[0]
    valid = rows if valid_rows is None else min(valid_rows, rows)
    seq = seq_lens if not from_positions else positions
    _kpool_topk_packed_kernel[(rows,)](
        logits, logits.stride(0), row_starts if row_starts is not None else seq, seq,
        positions if from_positions else seq, context_pools if from_positions else seq,
        out, out.stride(0), out.shape[1], valid,
        HAS_STARTS=row_starts is not None, FROM_POSITIONS=from_positions, KPOOL=kpool,
        SELECT=select_pools, TAIL=max(2, triton.next_power_of_2(kpool - 1)), R=config.rows,
        COLS=config.cols, CAP=cap, T0_STEPS=config.t0_steps, BLOCK=1024,
        num_warps=config.num_warps,
    )
    return out


def _packed_configs():
    C = PackedTopkConfig
    shipped = C("packed-r8-c256-cap512-w4-t4")
    candidates = [
        shipped,
        C("packed-r8-c256-cap512-w8-t4", num_warps=8),
        C("packed-r8-c256-cap256-w4-t4", cap=256),
        C("packed-r4-c512-cap512-w4-t4", rows=4, cols=512),
        C("packed-r8-c256-cap512-w4-t8", t0_steps=8),
    ]
    return shipped, candidates


# The shipped configuration (chosen from the design's arithmetic, not from a measurement;
# bench/gpu/topk_bench.py times every candidate) and what the bench sweeps; each is compiled
# for sm_89 in tests/unit/test_kernels_sm89.py.
PACKED_CONFIG, PACKED_CANDIDATES = _packed_configs()
