"""Triton kernels of the direct path's INT8 two-shot all-reduce (`direct.py` holds the protocol,
`direct_kernels.py` the native kernels, whose epochs, flag lines and words these share).

Layout (bytes, `call_plan.Int8Layout` with `world` chunks): the slot of rank j, parity q, starts at
`slots + (q * world + j) * capacity` of the direct area's native region. It holds record c (chunk c
of j's message, c != j) at `c * record_bytes`: `[chunk_elems x int8 | chunk_elems / G x fp32 scale
| pad]`, and j's reduced chunk as one more record at `res_off` (`call_plan.direct_result_offset`).
Element i of chunk c is element `c * chunk_elems + i` of the message; past the message it is 0, and
so is the scale of a group that holds none. Symmetric per group: `scale = amax / 127`,
`q = round(x / scale)` (half away from zero), decoded as `q * scale` in fp32.

- `_publish_int8_kernel`: every chunk but the rank's own, encoded into its slot (nobody reads the
  own chunk's record: the rank reduces that chunk from its own elements).
- `_collect_int8_kernel`, one flag round (the fence before it makes the records visible): announce
  e, poll the own line until every peer's word reaches e, then
  round 0: decode every peer's record of this rank's chunk, add them and the own native elements
  in rank order in fp32, encode the sum into the result record, and write the *decoded* record to
  the output (what every peer will decode from it: so every rank holds the same bits);
  round 1: decode every peer's result record into the output.

A program works on tiles of `[WP2 ranks, GPP groups, G]` elements (at most `TILE`, every peer's
part of the same groups in one set of loads: one round trip per tile, not one per peer) and sums
over ranks with the native kernels' `_rank_order_sum` (each row picked out exactly, in rank order).
Registers: TILE int8 and fp32 values over 128 threads; no shared memory beyond Triton's reduction
scratch. `PHASE` as in `direct_kernels` (1: announce, 2: poll and collect, 3 on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glmctl.collectives.call_plan import Int8Layout
from glmctl.collectives.direct_kernels import (
    DONE_STATUS,
    TILE,
    WAIT_STATUS,
    _announce,
    _common,
    _poll_line,
    _rank_order_sum,
)
from glmctl.collectives.kernels import MappedPtr, _quantize_groups, _tick
from glmctl.collectives.segment import DIRECT_PROGRAMS
from glmctl.collectives.staging import DirectArea


@triton.jit(do_not_specialize=["rank", "world"])
def _publish_int8_kernel(x, slot8, slot32, epochs, numel, n_groups, chunk_elems, rec_bytes, capacity,
                         rank, world, G: tl.constexpr, GPP: tl.constexpr):
    c = tl.program_id(0)
    e = tl.load(epochs + c) + 1
    base = ((e & 1) * world + rank).to(tl.int64) * capacity  # bytes: this rank's slot of parity e
    gpc = chunk_elems // G
    per = tl.cdiv(n_groups, tl.num_programs(0))
    lo = c * per
    hi = tl.minimum(lo + per, n_groups)
    cols = tl.arange(0, G)
    for start in range(lo, hi, GPP):
        g = start + tl.arange(0, GPP)  # group of the message; chunk g // gpc
        ch = g // gpc
        k = g - ch * gpc
        gm = (g < hi) & (ch != rank)
        idx = g.to(tl.int64)[:, None] * G + cols[None, :]  # = ch * chunk_elems + k * G + col
        v = tl.load(x + idx, mask=gm[:, None] & (idx < numel), other=0.0).to(tl.float32)
        q, s = _quantize_groups(v, G)
        rec = base + ch.to(tl.int64) * rec_bytes
        tl.store(slot8 + rec[:, None] + k.to(tl.int64)[:, None] * G + cols[None, :], q,
                 mask=gm[:, None])
        tl.store(slot32 + (rec + chunk_elems) // 4 + k, s, mask=gm)


@triton.jit(do_not_specialize=["rank", "world"])
def _collect_int8_kernel(
    x, out, slot8, slot32, flags, epochs, abort, status, epoch_word, tick_dev, tick_host,
    numel, chunk_elems, rec_bytes, res_off, capacity, rank, world, wait_status, done_status,
    ROUND: tl.constexpr, BUMP: tl.constexpr, PHASE: tl.constexpr, WP2: tl.constexpr,
    TICK: tl.constexpr, G: tl.constexpr, GPP: tl.constexpr,
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
        slot = (q * world + rows).to(tl.int64) * capacity  # [WP2] bytes: every rank's slot
        if ROUND == 0:
            rec = slot + rank.to(tl.int64) * rec_bytes  # the peers' records of this rank's chunk
        else:
            rec = slot + res_off  # the peers' reduced chunks
        rows3 = rows[:, None, None]
        peer3 = peer[:, None, None]
        gpc = chunk_elems // G
        per = tl.cdiv(gpc, tl.num_programs(0))
        g_lo = c * per
        g_hi = tl.minimum(g_lo + per, gpc)
        cols = tl.arange(0, G)
        for start in range(g_lo, g_hi, GPP):
            k = start + tl.arange(0, GPP)  # groups of a chunk
            km = k < g_hi
            i = k.to(tl.int64)[:, None] * G + cols[None, :]  # [GPP, G]: elements of a chunk
            m3 = peer3 & km[None, :, None]
            qv = tl.load(slot8 + rec[:, None, None] + i[None, :, :], mask=m3, other=0,
                         cache_modifier=".cv")
            s = tl.load(slot32 + ((rec + chunk_elems) // 4)[:, None] + k[None, :],
                        mask=peer[:, None] & km[None, :], other=0.0, cache_modifier=".cv")
            v = qv.to(tl.float32) * s[:, :, None]  # [WP2, GPP, G]
            if ROUND == 0:
                own = rank.to(tl.int64) * chunk_elems + i
                mine = tl.load(x + own, mask=km[:, None] & (own < numel), other=0.0)
                v = tl.where(rows3 == rank, mine.to(tl.float32)[None, :, :], v)
                acc = tl.reshape(_rank_order_sum(tl.reshape(v, [WP2, GPP * G]), rows, world, WP2, GPP * G),
                                 [GPP, G])
                q2, s2 = _quantize_groups(acc, G)
                res = (q * world + rank).to(tl.int64) * capacity + res_off
                tl.store(slot8 + res + i, q2, mask=km[:, None])
                tl.store(slot32 + (res + chunk_elems) // 4 + k, s2, mask=km)
                y = q2.to(tl.float32) * s2[:, None]
                tl.store(out + own, y.to(out.dtype.element_ty), mask=km[:, None] & (own < numel))
            else:
                o = rows.to(tl.int64)[:, None, None] * chunk_elems + i[None, :, :]
                tl.store(out + o, v.to(out.dtype.element_ty), mask=m3 & (o < numel))
        if BUMP:
            tl.store(epochs + c, e)
            if c == 0:
                tl.store(status, done_status)
        _tick(tick_dev, tick_host, TICK)


# ---- launchers -------------------------------------------------------------------------------


def tile_groups(world: int, group: int) -> tuple[int, int]:
    """(WP2, GPP): ranks padded to a power of two, and the groups of a TILE-element tile."""
    wp2 = triton.next_power_of_2(world)
    return wp2, max(1, TILE // (wp2 * group))


def _slots(area: DirectArea):
    return MappedPtr(area.slots, torch.int8), MappedPtr(area.slots, torch.float32)


def publish_args(x, area: DirectArea, *, layout: Int8Layout, numel: int, rank: int, world: int):
    """(positional arguments, meta-parameters) of one `_publish_int8_kernel` launch."""
    s8, s32 = _slots(area)
    args = (x, s8, s32, area.epochs, numel, layout.chunks * layout.groups_per_chunk,
            layout.chunk_elems, layout.record_bytes, area.capacity, rank, world)
    return args, dict(G=layout.group, GPP=max(1, TILE // layout.group), num_warps=4)


def collect_args(x, out, area: DirectArea, *, layout: Int8Layout, round_: int, res_off: int,
                 numel: int, rank: int, world: int, bump: bool, progress=None, tick: bool = False,
                 phase: int = 3):
    """(positional arguments, meta-parameters) of one `_collect_int8_kernel` launch; `res_off` in
    bytes from the start of a slot."""
    (epochs, abort, status, epoch_word, td, th), t = _common(area, progress, tick)
    s8, s32 = _slots(area)
    wp2, gpp = tile_groups(world, layout.group)
    args = (x, out, s8, s32, MappedPtr(area.flags, torch.int32), epochs, abort, status,
            epoch_word, td, th, numel, layout.chunk_elems, layout.record_bytes, res_off,
            area.capacity, rank, world, WAIT_STATUS, DONE_STATUS)
    meta = dict(ROUND=round_, BUMP=bump, PHASE=phase, WP2=wp2, TICK=t, G=layout.group, GPP=gpp,
                num_warps=4)
    return args, meta


def publish(x, area: DirectArea, **kw) -> None:
    """Keywords: `publish_args`'."""
    args, meta = publish_args(x, area, **kw)
    _publish_int8_kernel[(DIRECT_PROGRAMS,)](*args, **meta)


def collect(x, out, area: DirectArea, **kw) -> None:
    """Keywords: `collect_args`'."""
    args, meta = collect_args(x, out, area, **kw)
    _collect_int8_kernel[(DIRECT_PROGRAMS,)](*args, **meta)


def sm89_configs():
    """(name, jit function, {arg: type}, {constexpr: value}, options) for `kernels.sm89_check`:
    every rank count's tile (2, 4, 8 ranks) at the default group, and the largest group."""
    from glmctl.collectives.call_plan import DEFAULT_GROUP, GROUPS_ALLOWED

    i32, i64 = "i32", "i64"
    pub = dict(x="*bf16", slot8="*i8", slot32="*fp32", epochs="*i32", numel=i32, n_groups=i32,
               chunk_elems=i32, rec_bytes=i32, capacity=i32, rank=i32, world=i32)
    col = dict(x="*bf16", out="*bf16", slot8="*i8", slot32="*fp32", flags="*i32", epochs="*i32",
               abort="*i32", status="*i32", epoch_word="*i32", tick_dev="*i32", tick_host="*i32",
               numel=i32, chunk_elems=i32, rec_bytes=i32, res_off=i64, capacity=i32, rank=i32,
               world=i32, wait_status=i32, done_status=i32)
    for group in (DEFAULT_GROUP, max(GROUPS_ALLOWED)):
        yield (f"direct_int8_publish[G{group}]", _publish_int8_kernel, pub,
               dict(G=group, GPP=max(1, TILE // group)), dict(num_warps=4))
        for world in (2, 4, 8):
            wp2, gpp = tile_groups(world, group)
            for round_ in (0, 1):
                yield (f"direct_int8_collect[G{group} {world} ranks round {round_}]",
                       _collect_int8_kernel, col,
                       dict(ROUND=round_, BUMP=round_ == 1, PHASE=3, WP2=wp2, TICK=round_ == 1,
                            G=group, GPP=gpp), dict(num_warps=4))
