"""The radix select the kpool top-k kernels use (:mod:`.kpool_topk` and, for the rows whose
candidates overflow, :mod:`.kpool_topk_threshold` and :mod:`.kpool_topk_packed`): logits as
order-preserving 32-bit keys, the k-th largest key by four 8-bit digit histograms, the write of
the chosen pools as token ranges in pool order (ties to the lowest pools), and the row's tail and
padding every kernel writes after them."""

from __future__ import annotations

import triton
import triton.language as tl


def scratch_capacity(cap: int, select_pools: int, kpool: int) -> int:
    """``cap`` halved until the candidates' scratch (pools and keys) fits in the first
    ``select_pools * kpool`` output columns, where it lives until the output overwrites it."""
    while cap > 1 and 2 * cap > select_pools * kpool:
        cap //= 2
    return cap


@triton.jit
def _order_key(x):
    """fp32 -> int64 in [0, 2^32) with the same order (negative floats below positive ones).
    -0.0 and +0.0 get one key: they are equal, so pools scored by either tie and the lower pool
    wins, as in the reference (a ReLU'd indexer logit is -0.0 or +0.0 by summation order, which
    changes with the batch, the GPU and the kernel: telling them apart picked other pools)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    low = bits.to(tl.int64) & 0xFFFFFFFF
    return tl.where(bits < 0, 0xFFFFFFFF - low, low + 0x80000000)


@triton.jit
def _threshold(vals, idxs, count, k, HAS_IDX: tl.constexpr, BLOCK: tl.constexpr):
    """(key, ties) such that the k largest of vals[0:count] are the keys above ``key`` plus the
    first ``ties`` equal to it; with HAS_IDX, entries whose idxs < 0 are ignored."""
    lane = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    first_half = (tl.arange(0, 2) == 0).to(tl.int32)
    prefix = tl.zeros([], tl.int64)
    remaining = tl.full([], k, tl.int32)
    for step in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, count, BLOCK):
            offs = c0 + lane
            inside = offs < count
            if HAS_IDX:
                inside = inside & (tl.load(idxs + offs, mask=inside, other=-1) >= 0)
            key = _order_key(tl.load(vals + offs, mask=inside, other=0.0))
            match = inside
            if step > 0:
                match = inside & ((key >> (32 - 8 * step)) == (prefix >> (32 - 8 * step)))
            # Keys that do not match go to bins 256..511, which are dropped.
            digit = tl.where(match, (key >> (24 - 8 * step)) & 255, 256).to(tl.int32)
            both = tl.reshape(tl.histogram(digit, 512), [2, 256])
            hist += tl.sum(both * first_half[:, None], axis=0)
        matched = tl.sum(hist, axis=0)
        at_least = matched - (tl.cumsum(hist, axis=0) - hist)  # keys with digit >= d
        chosen = tl.max(tl.where(at_least >= remaining, bins, -1), axis=0)
        chosen_count = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
        chosen_at_least = tl.sum(tl.where(bins == chosen, at_least, 0), axis=0)
        remaining -= chosen_at_least - chosen_count
        prefix = prefix | (chosen.to(tl.int64) << (24 - 8 * step))
    return prefix, remaining


@triton.jit
def _select_and_write(vals_ptr, idx_ptr, count, out_row, HAS_IDX: tl.constexpr,
                      KPOOL: tl.constexpr, SELECT: tl.constexpr, BLOCK: tl.constexpr):
    """Write the SELECT best of vals[0:count] (pool = position, or idx[position] with HAS_IDX;
    idx < 0 = not a candidate) as token ranges, in pool order."""
    prefix, remaining = _threshold(vals_ptr, idx_ptr, count, SELECT, HAS_IDX, BLOCK)
    lane = tl.arange(0, BLOCK)
    sub = tl.arange(0, KPOOL)
    written = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for c0 in range(0, count, BLOCK):
        offs = c0 + lane
        inside = offs < count
        if HAS_IDX:
            pool = tl.load(idx_ptr + offs, mask=inside, other=-1)
            inside = inside & (pool >= 0)
        else:
            pool = offs
        key = _order_key(tl.load(vals_ptr + offs, mask=inside, other=0.0))
        above = inside & (key > prefix)
        tie = (inside & (key == prefix)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        take = above | ((tie > 0) & (tie_rank < remaining))
        pos = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tokens = pool[:, None] * KPOOL + sub[None, :]
        tl.store(out_row + pos[:, None] * KPOOL + sub[None, :], tokens, mask=take[:, None])
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie, axis=0)


@triton.jit
def _write_tail_and_padding(out_row, n, seq, out_width, KPOOL: tl.constexpr, SELECT: tl.constexpr,
                            TAIL: tl.constexpr, BLOCK: tl.constexpr):
    """After the SELECT chosen pools: the query's own incomplete pool (tokens n * KPOOL .. seq - 1,
    -1 beyond), then -1 up to the row's width."""
    tail = tl.arange(0, TAIL)
    tail_tok = n * KPOOL + tail
    tl.store(out_row + SELECT * KPOOL + tail, tl.where(tail_tok < seq, tail_tok, -1),
             mask=tail < KPOOL - 1)
    lane = tl.arange(0, BLOCK)
    for c0 in range(SELECT * KPOOL + KPOOL - 1, out_width, BLOCK):
        col = c0 + lane
        tl.store(out_row + col, tl.full([BLOCK], -1, tl.int32), mask=col < out_width)
