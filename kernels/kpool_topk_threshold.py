"""The kpool top-k as a threshold select: two passes over a row's logits, then an exact select
among a few hundred candidates (the kernel behind :func:`.kpool_topk.kpool_topk`; same output).

One program per row, ``n`` complete pools (``n <= select`` rows take the causal fill):

1. column maxima: pool ``p`` belongs to column ``p % COLS``; the ``select``-th largest column
   maximum ``t0`` (exact, :func:`_kth_key`) bounds the answer from below: at least ``select``
   pools (one per column of those ``select`` columns) score >= ``t0``, so the ``select`` best
   are among the pools >= ``t0``;
2. compaction: the pools >= ``t0`` (``C`` of them; a little over ``select`` for any row whose
   best pools are not bunched in a few columns) are written, in pool order, to a scratch area
   inside the row's own output (the first ``select * kpool`` columns, which step 3 overwrites
   completely);
3. if ``C <= CAP``: load the candidates, select exactly (:func:`_kth_key`: the ``select``-th
   largest key and how many of the pools equal to it to keep, lowest pools first), and write the
   chosen pools in ascending order, expanded to tokens. Otherwise (a row whose best pools crowd
   few columns) the row is selected by the radix select of :mod:`.kpool_topk_select` over all
   its logits: slower, same result.

Keys: logits map to order-preserving integers in ``[0, 2^32)``
(:func:`.kpool_topk_select._order_key`).
:func:`_kth_key` is a radix select with 4-bit digits whose 16 bin counts per step are one
block-wide sum of four int64s holding four 16-bit counters each (cheaper per element than
``tl.histogram``'s ballots; it counts at most 65535 keys, so it only sees small sets).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .kpool_topk_select import (
    _order_key,
    _select_and_write,
    _write_tail_and_padding,
    scratch_capacity,
)


@dataclass(frozen=True)
class ThresholdTopkConfig:
    """The threshold kernel's configuration: ``rows`` x ``cols`` logits per step
    of its row passes (``cols`` is also its column count), candidate capacity ``cap``,
    ``num_warps``, and ``t0_steps`` 4-bit digits of the column-maximum bound resolved (8 =
    exact; fewer = a coarser, lower bound: more candidates, fewer steps)."""

    name: str
    rows: int = 8
    cols: int = 512
    cap: int = 512
    num_warps: int = 8
    t0_steps: int = 8


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _kth_key(keys, ok, k, STEPS: tl.constexpr):
    """(key, ties): the ``k``-th largest of ``keys[ok]`` (int64 in [0, 2^32)), resolved to its
    top ``4 * STEPS`` bits (the low bits zero), and how many keys equal to it the ``k`` best
    include (exact when STEPS == 8). Needs 1 <= k <= count(ok) <= 65535."""
    bins = tl.arange(0, 16)
    prefix = tl.zeros([], tl.int64)
    remaining = tl.full([], k, tl.int32)
    for step in tl.static_range(STEPS):
        shift = 28 - 4 * step
        match = ok
        if step > 0:
            match = ok & ((keys >> (shift + 4)) == (prefix >> (shift + 4)))
        digit = ((keys >> shift) & 15).to(tl.int32)
        one = tl.where(match, tl.full(keys.shape, 1, tl.int64) << ((digit & 3) * 16).to(tl.int64),
                       0)
        word = digit >> 2
        c0, c1, c2, c3 = tl.reduce((tl.where(word == 0, one, 0), tl.where(word == 1, one, 0),
                                    tl.where(word == 2, one, 0), tl.where(word == 3, one, 0)),
                                   0, _add4)
        packed = tl.where(bins < 4, c0, tl.where(bins < 8, c1, tl.where(bins < 12, c2, c3)))
        hist = ((packed >> ((bins & 3) * 16).to(tl.int64)) & 0xFFFF).to(tl.int32)
        at_least = tl.sum(hist, axis=0) - (tl.cumsum(hist, axis=0) - hist)  # digit >= d
        chosen = tl.max(tl.where(at_least >= remaining, bins, -1), axis=0)
        chosen_count = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
        chosen_at_least = tl.sum(tl.where(bins == chosen, at_least, 0), axis=0)
        remaining -= chosen_at_least - chosen_count
        prefix = prefix | (chosen.to(tl.int64) << shift)
    return prefix, remaining


@triton.jit
def _tile_keys(row_logits, c0, n, R: tl.constexpr, COLS: tl.constexpr):
    """(pool, key, ok) of the [R, COLS] tile of pools [c0, c0 + R * COLS), row-major."""
    pool = c0 + tl.arange(0, R)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    ok = pool < n
    return pool, _order_key(tl.load(row_logits + pool, mask=ok, other=0.0)), ok


@triton.jit
def _kpool_topk_threshold_kernel(
    logits_ptr, logits_stride, starts_ptr, seq_ptr, out_ptr, out_stride, out_width,
    HAS_STARTS: tl.constexpr, KPOOL: tl.constexpr, SELECT: tl.constexpr, TAIL: tl.constexpr,
    R: tl.constexpr, COLS: tl.constexpr, CAP: tl.constexpr, T0_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seq = tl.maximum(tl.load(seq_ptr + row), 0)
    n = seq // KPOOL
    out_row = out_ptr + row * out_stride
    row_logits = logits_ptr + row * logits_stride
    if HAS_STARTS:
        row_logits += tl.load(starts_ptr + row)
    lane = tl.arange(0, BLOCK)
    sub = tl.arange(0, KPOOL)

    if n <= SELECT:
        for c0 in range(0, SELECT * KPOOL, BLOCK):
            col = c0 + lane
            tl.store(out_row + col, tl.where(col < n * KPOOL, col, -1), mask=col < SELECT * KPOOL)
    else:
        # 1. the SELECT-th largest column maximum (empty columns: key -1, never counted).
        col_max = tl.full([COLS], -1, tl.int64)
        for c0 in range(0, n, R * COLS):
            pool, key, ok = _tile_keys(row_logits, c0, n, R, COLS)
            col_max = tl.maximum(col_max, tl.max(tl.where(ok, key, -1), axis=0))
        t0, _ = _kth_key(col_max, col_max >= 0, SELECT, T0_STEPS)
        # 2. compact the pools >= t0 into the scratch: pools at [0, CAP), keys at [CAP, 2 CAP).
        found = tl.zeros([], tl.int32)
        for c0 in range(0, n, R * COLS):
            pool, key, ok = _tile_keys(row_logits, c0, n, R, COLS)
            cand = (ok & (key >= t0)).to(tl.int32)
            in_row = tl.cumsum(cand, axis=1) - cand
            row_total = tl.sum(cand, axis=1)
            pos = found + (tl.cumsum(row_total, axis=0) - row_total)[:, None] + in_row
            keep = (cand > 0) & (pos < CAP)
            tl.store(out_row + pos, pool.to(tl.int32), mask=keep)
            tl.store(out_row + CAP + pos, key.to(tl.int32), mask=keep)  # low 32 bits
            found += tl.sum(row_total, axis=0)
        tl.debug_barrier()  # the scratch written by every thread, before anyone reads it
        if found <= CAP:
            # 3. exact select among the candidates (in pool order), then write them.
            slot = tl.arange(0, CAP)
            live = slot < found
            c_pool = tl.load(out_row + slot, mask=live, other=-1)
            c_key = tl.load(out_row + CAP + slot, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
            tl.debug_barrier()  # every candidate loaded before the output overwrites them
            thr, ties = _kth_key(c_key, live, SELECT, 8)
            tie = (live & (c_key == thr)).to(tl.int32)
            take = (live & (c_key > thr)) | ((tie > 0) & (tl.cumsum(tie, axis=0) - tie < ties))
            pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
            tokens = c_pool[:, None] * KPOOL + sub[None, :]
            tl.store(out_row + pos[:, None] * KPOOL + sub[None, :], tokens, mask=take[:, None])
        else:
            _select_and_write(row_logits, seq_ptr, n, out_row, False, KPOOL, SELECT, BLOCK)

    _write_tail_and_padding(out_row, n, seq, out_width, KPOOL, SELECT, TAIL, BLOCK)


def threshold_capacity(config: ThresholdTopkConfig, select_pools: int, kpool: int) -> int:
    """The candidate capacity: the config's, halved until the scratch (pools and keys) fits in
    the first ``select_pools * kpool`` output columns; 0 when that leaves fewer than
    ``select_pools`` (the caller then uses the radix kernel)."""
    cap = scratch_capacity(config.cap, select_pools, kpool)
    return cap if cap >= select_pools else 0



def launch_kpool_topk_threshold(logits, seq_lens, out, *, kpool, select_pools, row_starts,
                                config: ThresholdTopkConfig, cap: int):
    """Launch one program per row (see module doc); ``cap`` from :func:`threshold_capacity`."""
    starts = row_starts if row_starts is not None else seq_lens
    _kpool_topk_threshold_kernel[(logits.shape[0],)](
        logits, logits.stride(0), starts, seq_lens, out, out.stride(0), out.shape[1],
        HAS_STARTS=row_starts is not None, KPOOL=kpool, SELECT=select_pools,
        TAIL=max(2, triton.next_power_of_2(kpool - 1)), R=config.rows, COLS=config.cols,
        CAP=cap, T0_STEPS=config.t0_steps, BLOCK=1024, num_warps=config.num_warps,
    )
    return out
