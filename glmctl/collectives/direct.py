"""The direct path for small messages: one kernel per all-reduce or all-gather, no stream memory
operations. Each of its `DIRECT_PROGRAMS` programs writes its share of the rank's message into
the rank's host slot, tells the peers, polls from device code until every peer's share is there,
and reduces (or gathers) it.

Two payload formats (`plan.algorithm`):
- `direct_ll` ("low latency", as NCCL's LL protocol): every 8-byte word is 4 bytes of payload and
  the 4-byte call epoch, written by one store. A reader polls the payload words themselves until
  each carries this call's epoch: no fence, no separate flag, twice the bytes.
- `direct`: native payload; after its stores (and a barrier of the program's threads) each program
  writes the epoch into word `rank` of its flag line at every peer with a system-scope release;
  a reader polls its own flag line (one 64-byte line holds every source's word) and then reads.

Epochs, not resets: program c keeps a call counter in device memory (`DirectArea.epochs`), the
same on every rank since every rank makes the same calls; flags and LL words only ever receive
epochs from their one writer, so a captured graph replays forever and nothing is reset. Payloads
alternate between two parities (epoch & 1): a rank writes parity q again two calls later, and by
then every peer has finished reading it: the rank's previous kernel saw every peer's data of the
call in between (its program 0 always reads from every peer), which each peer wrote only after
its own kernel of the call before had completed (stream order). The direct area is separate from
the barrier paths' slots, so mixing both kinds of call needs nothing more.

Determinism: rank order, fp32 sums, the own contribution read from the input: every rank's result
is bitwise equal. Waiting: program 0 writes the status word (the watchdog's "waiting at DIRECT")
and the rank's epoch word, which the watchdog compares with the peers'; a waiting program gives up
once the segment's abort word is set (the watchdog sets it when the group breaks), so a lost peer
never hangs the GPU. `PHASE` splits publish and collect for the CPU simulation (the Triton
interpreter runs one kernel at a time); the GPU always runs both in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glmctl.collectives.call_plan import CollectivePlan
from glmctl.collectives.kernels import MappedPtr, _tick, _tick_args
from glmctl.collectives.segment import DIRECT, DIRECT_PROGRAMS
from glmctl.collectives.staging import DirectArea, Staging, Sync

BLOCK = 1024
WAIT_STATUS, DONE_STATUS = 2 * DIRECT + 1, 2 * DIRECT + 2  # protocol.waiting_flag's encoding
ABORT_EVERY = tl.constexpr(256)  # polls between two reads of the abort word


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
def _poll_ll(src, u, m, e, abort):
    """Words src[u] (mask m), re-read until each carries epoch e (or the group aborted)."""
    w = tl.load(src + u, mask=m, other=0, volatile=True)
    ok = ((w >> 32).to(tl.int32) == e) | ~m
    bad = tl.sum((~ok).to(tl.int32), axis=0)
    spins = bad * 0
    while bad > 0:
        again = tl.load(src + u, mask=m & ~ok, other=0, volatile=True)
        w = tl.where(ok, w, again)
        ok = ((w >> 32).to(tl.int32) == e) | ~m
        bad = tl.sum((~ok).to(tl.int32), axis=0)
        spins += 1
        if spins % ABORT_EVERY == 0:
            if tl.load(abort, volatile=True) != 0:
                bad = bad * 0
    return (w & 0xFFFFFFFF).to(tl.int32)


@triton.jit(do_not_specialize=["rank", "world"])
def _direct_kernel(
    x, out, slots, flags, epochs, abort, status, epoch_word, tick_dev, tick_host,
    numel, units, slot_units, rank, world, wait_status, done_status,
    LL: tl.constexpr, GATHER: tl.constexpr, PHASE: tl.constexpr, EPW: tl.constexpr,
    WP2: tl.constexpr, TICK: tl.constexpr, BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    progs = tl.num_programs(0)
    e = tl.load(epochs + c) + 1
    per = tl.cdiv(units, progs)
    lo = c * per
    hi = tl.minimum(lo + per, units)
    q = e & 1
    mine = slots + (q * world + rank).to(tl.int64) * slot_units
    jj = tl.arange(0, WP2)
    peer = (jj < world) & (jj != rank)
    if PHASE & 1:
        if c == 0:
            tl.store(epoch_word, e)
            tl.store(status, wait_status)
        for start in range(lo, hi, BLOCK):
            u = start + tl.arange(0, BLOCK)
            m = u < hi
            if LL:
                word = (_pack(x, u, numel, EPW).to(tl.int64) & 0xFFFFFFFF) | (e.to(tl.int64) << 32)
                tl.store(mine + u, word, mask=m)
            else:
                tl.store(mine + u, tl.load(x + u, mask=m), mask=m)
        if not LL:
            tl.debug_barrier()  # every thread's stores issued before the release below
            line = flags + (c * world + jj).to(tl.int64) * 16 + rank
            tl.atomic_xchg(line, tl.zeros([WP2], tl.int32) + e, mask=peer, sem="release", scope="sys")
    if PHASE & 2:
        if not LL:
            own_line = flags + (c * world + rank).to(tl.int64) * 16 + jj
            f = tl.load(own_line, mask=peer, other=0, volatile=True)
            bad = tl.sum((peer & ((f - e) < 0)).to(tl.int32), axis=0)
            spins = bad * 0
            while bad > 0:
                f = tl.load(own_line, mask=peer, other=0, volatile=True)
                bad = tl.sum((peer & ((f - e) < 0)).to(tl.int32), axis=0)
                spins += 1
                if spins % ABORT_EVERY == 0:
                    if tl.load(abort, volatile=True) != 0:
                        bad = bad * 0
        for start in range(lo, hi, BLOCK):
            u = start + tl.arange(0, BLOCK)
            m = u < hi
            acc_a = tl.zeros([BLOCK], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK], dtype=tl.float32)
            for j in range(0, world):
                src = slots + (q * world + j).to(tl.int64) * slot_units
                if LL:
                    if j == rank:
                        bits = _pack(x, u, numel, EPW)
                    else:
                        bits = _poll_ll(src, u, m, e, abort)
                    a, b = _unpack(bits, x.dtype.element_ty, EPW)
                else:
                    if j == rank:
                        a = tl.load(x + u, mask=m, other=0.0).to(tl.float32)
                    else:
                        a = tl.load(src + u, mask=m, other=0.0, cache_modifier=".cv").to(tl.float32)
                    b = tl.zeros([BLOCK], dtype=tl.float32)
                if GATHER:
                    base = out + j * numel  # direct messages are small: no 32-bit overflow
                    if LL and EPW == 2:
                        tl.store(base + 2 * u, a.to(out.dtype.element_ty), mask=m & (2 * u < numel))
                        tl.store(base + 2 * u + 1, b.to(out.dtype.element_ty),
                                 mask=m & (2 * u + 1 < numel))
                    else:
                        tl.store(base + u, a.to(out.dtype.element_ty), mask=m & (u < numel))
                else:
                    acc_a += a
                    acc_b += b
            if not GATHER:
                if LL and EPW == 2:
                    tl.store(out + 2 * u, acc_a.to(out.dtype.element_ty), mask=m & (2 * u < numel))
                    tl.store(out + 2 * u + 1, acc_b.to(out.dtype.element_ty),
                             mask=m & (2 * u + 1 < numel))
                else:
                    tl.store(out + u, acc_a.to(out.dtype.element_ty), mask=m & (u < numel))
        tl.store(epochs + c, e)
        if c == 0:
            tl.store(status, done_status)
        _tick(tick_dev, tick_host, TICK)


def units_for(numel: int, elem_bytes: int, ll: bool) -> tuple[int, int]:
    """(units of the message, bytes per unit): LL words carry 4 payload bytes in 8."""
    if ll:
        return -(-numel * elem_bytes // 4), 8
    return numel, elem_bytes


def kernel_args(x, out, area: DirectArea, *, numel: int, rank: int, world: int, ll: bool,
                gather: bool, progress=None, tick: bool = False, phase: int = 3):
    """(positional arguments, meta-parameters) of one `_direct_kernel` launch."""
    eb = x.element_size()
    units, unit_bytes = units_for(numel, eb, ll)
    td, th, t = _tick_args(progress, tick)
    i32 = torch.int32
    status = MappedPtr(area.status, i32)
    args = (x, out, MappedPtr(area.slots, torch.int64 if ll else x.dtype),
            MappedPtr(area.flags, i32), area.epochs, MappedPtr(area.abort, i32), status,
            MappedPtr(area.epoch_word, i32), td if t else area.epochs, th if t else status,
            numel, units, area.capacity // unit_bytes, rank, world, WAIT_STATUS, DONE_STATUS)
    meta = dict(LL=ll, GATHER=gather, PHASE=phase, EPW=4 // eb if ll else 1,
                WP2=triton.next_power_of_2(world), TICK=t, BLOCK=BLOCK, num_warps=4)
    return args, meta


def launch(x, out, area: DirectArea, **kw) -> None:
    """One direct-path call: out = the sum over ranks of x (all-reduce; out may be x), or
    out[j * numel:(j + 1) * numel] = rank j's x (all-gather). Keywords: `kernel_args`'."""
    args, meta = kernel_args(x, out, area, **kw)
    _direct_kernel[(DIRECT_PROGRAMS,)](*args, **meta)


def all_reduce(st: Staging, sync: Sync, x, out, plan: CollectivePlan, stream: int) -> None:
    launch(x, out, st.direct, numel=plan.numel, rank=st.rank, world=st.world,
           ll=plan.algorithm == "direct_ll", gather=False, progress=st.progress, tick=True)


def all_gather(st: Staging, sync: Sync, x, flat, plan: CollectivePlan, stream: int) -> None:
    launch(x, flat, st.direct, numel=plan.numel, rank=st.rank, world=st.world,
           ll=plan.algorithm == "direct_ll", gather=True, progress=st.progress, tick=True)
