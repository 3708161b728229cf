"""Triton kernels of the direct path (`direct.py` holds the protocol) and their launchers.

Every kernel runs `DIRECT_PROGRAMS` programs; program c keeps its own call counter `epochs[c]`
(device memory), the same on every rank since every rank makes the same calls, and only the last
kernel of a call stores the new count (`BUMP`). A call's epoch is e = epochs[c] + 1, its parity
e & 1 picks the slot it writes.

- `_ll_kernel`, a whole LL call. Publish: the program's share of the message as LL words (4 payload
  bytes and the 4-byte epoch, one 8-byte store) into the rank's LL slot. Collect: poll every
  peer's words of that share until each carries e, then reduce or gather.
- `_publish_kernel`: the program's share of the native message into the rank's native slot; a
  two-shot call leaves out the rank's own chunk (nobody reads it).
- `_collect_kernel`, one flag round of a native call (the fence before it makes the payload
  visible): announce (e into this rank's word of each peer's line of the round), poll the own
  line until every peer's word reaches e, then, by `MODE`: reduce the message (one shot), gather
  it, reduce the rank's chunk and publish the sum (two-shot round 0), or gather the peers' sums
  (two-shot round 1). `lo`, `hi`: the elements the round covers (the launcher's `span`).

Reads of peers go out together: a program loads a tile of [ranks x BLOCK] (every peer's part of
one block in one set of loads, one round trip per block rather than one per peer) and sums its
rows in rank order in fp32 (a row is picked out exactly: the others are -0.0), so every rank's
result is bitwise the same and equal to the plain sequential sum. Polls are volatile loads, peer
payloads `.cv` loads: no line an earlier call cached is reused. A program that waits reads the
abort word every `ABORT_EVERY` polls and gives up once it is set (the watchdog sets it when the
group breaks), so a lost peer never hangs the GPU.

`PHASE` splits announce/publish (1) from poll/collect (2) for the CPU simulation (the Triton
interpreter runs one kernel at a time, so a kernel that waits for a peer must end first); the GPU
always runs both (3). Registers: a tile is `TILE` elements (at most 2048 x 8 bytes over 128
threads), no shared memory beyond Triton's reduction scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glmctl.collectives.kernels import MappedPtr, _tick, _tick_args
from glmctl.collectives.segment import DIRECT, DIRECT_PROGRAMS
from glmctl.collectives.staging import DirectArea

TILE = 2048  # elements (or LL words) of all ranks one program handles per loop step
PUBLISH_BLOCK = 2048
WAIT_STATUS, DONE_STATUS = 2 * DIRECT + 1, 2 * DIRECT + 2  # protocol.waiting_flag's encoding
ABORT_EVERY = tl.constexpr(256)  # polls between two reads of the abort word
REDUCE, GATHER, REDUCE_SCATTER, GATHER_SUMS = 0, 1, 2, 3  # `_collect_kernel`'s MODE
_GATHER, _REDUCE_SCATTER, _GATHER_SUMS = (tl.constexpr(m) for m in (GATHER, REDUCE_SCATTER,
                                                                     GATHER_SUMS))


@triton.jit
def _pack(x, u, numel, EPW: tl.constexpr):
    """The 4 payload bytes of unit u (EPW elements of x) as int32."""
    if EPW == 2:
        a = tl.load(x + 2 * u, mask=2 * u < numel, other=0.0)
        b = tl.load(x + 2 * u + 1, mask=2 * u + 1 < numel, other=0.0)
        lo = a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = b.to(tl.int16, bitcast=True).to(tl.int32) << 16
        return lo | hi
    else:
        return tl.load(x + u, mask=u < numel, other=0.0).to(tl.int32, bitcast=True)


@triton.jit
def _unpack(bits, dtype: tl.constexpr, EPW: tl.constexpr):
    """(first, second) elements of int32 payload bits, in fp32 (second is 0 for EPW == 1)."""
    if EPW == 2:
        a = (bits & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
        b = ((bits >> 16) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
        return a, b
    else:
        return bits.to(dtype, bitcast=True).to(tl.float32), tl.zeros_like(bits).to(tl.float32)


@triton.jit
def _rank_order_sum(v, rows, world, WP2: tl.constexpr, BLOCK: tl.constexpr):
    """Sum over the rows of v [WP2, BLOCK] (fp32) that are ranks, in rank order, from +0.0."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(WP2):
        row = tl.sum(tl.where(rows[:, None] == j, v, -0.0), axis=0)  # exactly row j
        acc = tl.where(j < world, acc + row, acc)
    return acc


@triton.jit
def _poll_ll(ptrs, m, e, abort):
    """Words at ptrs (mask m), re-read until each carries epoch e (or the group aborted)."""
    w = tl.load(ptrs, mask=m, other=0, volatile=True)
    ok = ((w >> 32).to(tl.int32) == e) | ~m
    bad = tl.sum(tl.sum((~ok).to(tl.int32), axis=1), axis=0)
    spins = bad * 0
    while bad > 0:
        again = tl.load(ptrs, mask=m & ~ok, other=0, volatile=True)
        w = tl.where(ok, w, again)
        ok = ((w >> 32).to(tl.int32) == e) | ~m
        bad = tl.sum(tl.sum((~ok).to(tl.int32), axis=1), axis=0)
        spins += 1
        if spins % ABORT_EVERY == 0:
            if tl.load(abort, volatile=True) != 0:
                bad = bad * 0
    return (w & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _poll_line(line, peer, e, abort):
    """Wait until every peer's word of the flag line has reached epoch e (or the group aborted)."""
    f = tl.load(line, mask=peer, other=0, volatile=True)
    bad = tl.sum((peer & ((f - e) < 0)).to(tl.int32), axis=0)
    spins = bad * 0
    while bad > 0:
        f = tl.load(line, mask=peer, other=0, volatile=True)
        bad = tl.sum((peer & ((f - e) < 0)).to(tl.int32), axis=0)
        spins += 1
        if spins % ABORT_EVERY == 0:
            if tl.load(abort, volatile=True) != 0:
                bad = bad * 0


@triton.jit
def _announce(flags, epoch_word, status, wait_status, e, rows, peer, rank, world, ROUND: tl.constexpr):
    """Program 0 of a call's first collect kernel: the rank's epoch word (round 0), the watchdog's
    status, and this round's flag to every peer (each flag line is written by its one rank)."""
    if ROUND == 0:
        tl.store(epoch_word, e)
    tl.store(status, wait_status)
    tl.store(flags + (ROUND * world + rows).to(tl.int64) * 16 + rank, tl.zeros_like(rows) + e, mask=peer)


@triton.jit(do_not_specialize=["rank", "world"])
def _ll_kernel(
    x, out, slots, epochs, abort, status, epoch_word, tick_dev, tick_host,
    numel, units, slot_units, rank, world, wait_status, done_status,
    GATHER_OUT: tl.constexpr, PHASE: tl.constexpr, EPW: tl.constexpr, WP2: tl.constexpr,
    TICK: tl.constexpr, BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    e = tl.load(epochs + c) + 1
    per = tl.cdiv(units, tl.num_programs(0))
    lo = c * per
    hi = tl.minimum(lo + per, units)
    q = e & 1
    rows = tl.arange(0, WP2)
    if PHASE & 1:
        if c == 0:
            tl.store(epoch_word, e)
            tl.store(status, wait_status)
        mine = slots + (q * world + rank).to(tl.int64) * slot_units
        for start in range(lo, hi, BLOCK):
            u = start + tl.arange(0, BLOCK)
            word = (_pack(x, u, numel, EPW).to(tl.int64) & 0xFFFFFFFF) | (e.to(tl.int64) << 32)
            tl.store(mine + u, word, mask=u < hi)
    if PHASE & 2:
        peer = (rows < world) & (rows != rank)
        base = slots + (q * world + rows).to(tl.int64) * slot_units
        for start in range(lo, hi, BLOCK):
            u = start + tl.arange(0, BLOCK)
            m = u < hi
            bits = _poll_ll(base[:, None] + u[None, :], peer[:, None] & m[None, :], e, abort)
            bits = tl.where((rows == rank)[:, None], _pack(x, u, numel, EPW)[None, :], bits)
            a, b = _unpack(bits, x.dtype.element_ty, EPW)
            if GATHER_OUT:
                dst = out + rows.to(tl.int64)[:, None] * numel  # [WP2, 1]: each rank's output
                keep = (rows < world)[:, None] & m[None, :]
                if EPW == 2:
                    tl.store(dst + 2 * u[None, :], a.to(out.dtype.element_ty),
                             mask=keep & (2 * u < numel)[None, :])
                    tl.store(dst + 2 * u[None, :] + 1, b.to(out.dtype.element_ty),
                             mask=keep & (2 * u + 1 < numel)[None, :])
                else:
                    tl.store(dst + u[None, :], a.to(out.dtype.element_ty), mask=keep)
            else:
                acc_a = _rank_order_sum(a, rows, world, WP2, BLOCK)
                if EPW == 2:
                    acc_b = _rank_order_sum(b, rows, world, WP2, BLOCK)
                    tl.store(out + 2 * u, acc_a.to(out.dtype.element_ty), mask=m & (2 * u < numel))
                    tl.store(out + 2 * u + 1, acc_b.to(out.dtype.element_ty),
                             mask=m & (2 * u + 1 < numel))
                else:
                    tl.store(out + u, acc_a.to(out.dtype.element_ty), mask=m)
        tl.store(epochs + c, e)
        if c == 0:
            tl.store(status, done_status)
        _tick(tick_dev, tick_host, TICK)


@triton.jit(do_not_specialize=["skip_lo", "skip_hi", "rank", "world"])
def _publish_kernel(x, slots, epochs, numel, skip_lo, skip_hi, slot_elems, rank, world,
                    BLOCK: tl.constexpr):
    c = tl.program_id(0)
    e = tl.load(epochs + c) + 1
    mine = slots + ((e & 1) * world + rank).to(tl.int64) * slot_elems
    per = tl.cdiv(numel, tl.num_programs(0))
    lo = c * per
    hi = tl.minimum(lo + per, numel)
    for start in range(lo, hi, BLOCK):
        u = start + tl.arange(0, BLOCK)
        m = (u < hi) & ((u < skip_lo) | (u >= skip_hi))
        tl.store(mine + u, tl.load(x + u, mask=m), mask=m)


@triton.jit(do_not_specialize=["lo", "hi", "rank", "world"])
def _collect_kernel(
    x, out, slots, flags, epochs, abort, status, epoch_word, tick_dev, tick_host,
    numel, lo, hi, chunk, slot_elems, res_off, rank, world, wait_status, done_status,
    MODE: tl.constexpr, ROUND: tl.constexpr, BUMP: tl.constexpr, PHASE: tl.constexpr,
    WP2: tl.constexpr, TICK: tl.constexpr, BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    e = tl.load(epochs + c) + 1
    q = e & 1
    rows = tl.arange(0, WP2)
    peer = (rows < world) & (rows != rank)
    if PHASE & 1:
        if c == 0:
            _announce(flags, epoch_word, status, wait_status, e, rows, peer, rank, world, ROUND)
    if PHASE & 2:
        _poll_line(flags + (ROUND * world + rank) * 16 + rows, peer, e, abort)
        base = slots + (q * world + rows).to(tl.int64) * slot_elems  # [WP2]: every rank's slot
        per = tl.cdiv(hi - lo, tl.num_programs(0))
        p_lo = lo + c * per
        p_hi = tl.minimum(p_lo + per, hi)
        for start in range(p_lo, p_hi, BLOCK):
            u = start + tl.arange(0, BLOCK)
            m = u < p_hi
            if MODE == _GATHER_SUMS:  # row j: rank j's reduced chunk -> out[j * chunk + u]
                keep = peer[:, None] & m[None, :] & (rows[:, None] * chunk + u[None, :] < numel)
                v = tl.load(base[:, None] + res_off + u[None, :], mask=keep, other=0.0,
                            cache_modifier=".cv")
                tl.store(out + rows.to(tl.int64)[:, None] * chunk + u[None, :], v, mask=keep)
            else:
                v = tl.load(base[:, None] + u[None, :], mask=peer[:, None] & m[None, :], other=0.0,
                            cache_modifier=".cv")
                own = tl.load(x + u, mask=m, other=0.0)
                v = tl.where((rows == rank)[:, None], own[None, :], v)
                if MODE == _GATHER:
                    tl.store(out + rows.to(tl.int64)[:, None] * numel + u[None, :], v,
                             mask=(rows < world)[:, None] & m[None, :])
                else:
                    y = _rank_order_sum(v.to(tl.float32), rows, world, WP2, BLOCK).to(out.dtype.element_ty)
                    tl.store(out + u, y, mask=m)
                    if MODE == _REDUCE_SCATTER:  # the sum of this rank's chunk, for the peers
                        res = slots + (q * world + rank).to(tl.int64) * slot_elems + res_off
                        tl.store(res + (u - lo), y, mask=m)
        if BUMP:
            tl.store(epochs + c, e)
            if c == 0:
                tl.store(status, done_status)
        _tick(tick_dev, tick_host, TICK)


# ---- launchers -------------------------------------------------------------------------------


def tile_block(world: int) -> tuple[int, int]:
    """(WP2, BLOCK): ranks padded to a power of two, and the columns of a TILE-element tile."""
    wp2 = triton.next_power_of_2(world)
    return wp2, max(16, TILE // wp2)


def ll_units(numel: int, elem_bytes: int) -> int:
    """LL words of a message: each carries 4 payload bytes."""
    return -(-numel * elem_bytes // 4)


def _common(area: DirectArea, progress, tick: bool):
    i32 = torch.int32
    td, th, t = _tick_args(progress, tick)
    status = MappedPtr(area.status, i32)
    return ((area.epochs, MappedPtr(area.abort, i32), status, MappedPtr(area.epoch_word, i32),
             td if t else area.epochs, th if t else status), t)


def ll_args(x, out, area: DirectArea, *, numel: int, rank: int, world: int, gather: bool,
            progress=None, tick: bool = True, phase: int = 3):
    """(positional arguments, meta-parameters) of one `_ll_kernel` launch."""
    eb = x.element_size()
    (epochs, abort, status, epoch_word, td, th), t = _common(area, progress, tick)
    wp2, block = tile_block(world)
    args = (x, out, MappedPtr(area.ll_slots, torch.int64), epochs, abort, status, epoch_word,
            td, th, numel, ll_units(numel, eb), area.capacity // 8, rank, world, WAIT_STATUS,
            DONE_STATUS)
    meta = dict(GATHER_OUT=gather, PHASE=phase, EPW=4 // eb, WP2=wp2, TICK=t, BLOCK=block,
                num_warps=4)
    return args, meta


def publish_args(x, area: DirectArea, *, numel: int, rank: int, world: int,
                 skip: tuple[int, int] = (0, 0)):
    args = (x, MappedPtr(area.slots, x.dtype), area.epochs, numel, skip[0], skip[1],
            area.capacity // x.element_size(), rank, world)
    return args, dict(BLOCK=PUBLISH_BLOCK, num_warps=4)


def collect_args(x, out, area: DirectArea, *, mode: int, round_: int, span: tuple[int, int],
                 numel: int, rank: int, world: int, bump: bool, chunk: int = 0, res_off: int = 0,
                 progress=None, tick: bool = False, phase: int = 3):
    """(positional arguments, meta-parameters) of one `_collect_kernel` launch; `res_off` in
    elements from the start of a slot."""
    (epochs, abort, status, epoch_word, td, th), t = _common(area, progress, tick)
    wp2, block = tile_block(world)
    args = (x, out, MappedPtr(area.slots, x.dtype), MappedPtr(area.flags, torch.int32), epochs,
            abort, status, epoch_word, td, th, numel, span[0], span[1], chunk,
            area.capacity // x.element_size(), res_off, rank, world, WAIT_STATUS, DONE_STATUS)
    meta = dict(MODE=mode, ROUND=round_, BUMP=bump, PHASE=phase, WP2=wp2, TICK=t, BLOCK=block,
                num_warps=4)
    return args, meta


def ll(x, out, area: DirectArea, **kw) -> None:
    """One LL call: out = the rank-order sum of every rank's x, or (gather) out[j * numel:] =
    rank j's x. Keywords: `ll_args`'."""
    args, meta = ll_args(x, out, area, **kw)
    _ll_kernel[(DIRECT_PROGRAMS,)](*args, **meta)


def publish(x, area: DirectArea, **kw) -> None:
    args, meta = publish_args(x, area, **kw)
    _publish_kernel[(DIRECT_PROGRAMS,)](*args, **meta)


def collect(x, out, area: DirectArea, **kw) -> None:
    args, meta = collect_args(x, out, area, **kw)
    _collect_kernel[(DIRECT_PROGRAMS,)](*args, **meta)
