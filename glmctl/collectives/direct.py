"""The direct path for small messages: kernels that announce and poll by themselves, with no
barrier memory operations. Three ways (`plan.algorithm`; `call_plan.DirectLimits` picks by size):

- `direct_ll` ("low latency", as NCCL's LL protocol), one kernel: every 8-byte word is 4 payload
  bytes and the 4-byte call epoch, written by one store; a reader polls the payload words
  themselves until each carries this call's epoch. No fence, no flag, twice the bytes.
- `direct_1s`, native payload in one shot: publish kernel (the message into the rank's native
  slot), fence, collect kernel (announce the epoch in flag round 0, poll the peers', read every
  peer's slot, reduce or gather).
- `direct_2s`, native payload in two shots (all-reduce only): publish (every chunk but the own),
  fence, collect round 0 (reduce this rank's chunk over every slot, publish the sum), fence,
  collect round 1 (gather the peers' sums). At 8 ranks it moves 2.75 bytes per payload byte per
  rank, against 8 (`direct_1s`) and 16 (`direct_ll`), for one more kernel, fence and flag round.
  With INT8 payloads (`plan.int8`; `direct_int8_kernels.py` has the record layout) three kernels
  of the same shape publish the peers' chunks as INT8 records, reduce the own chunk from the
  peers' records and the own native elements in fp32 in rank order, and publish the sum as one
  more record that every rank, its reducer included, decodes: so every rank holds the same bits.
  The sums go as INT8 too: round 1 reads as many bytes as round 0 ((n-1)/n of the message per
  rank), so native sums would leave an 8-rank call at ~0.69 of bf16's bytes instead of ~0.52, for
  a second quantization of ~0.6% relative RMS (random data: ~0.9% in all at 8 ranks; the barrier
  paths' two shots encode twice too).

The fence (`Sync.fence`: a stream memory write of the rank's own fence word, which the driver
fences after the stream's earlier work at system scope) sits between the kernel that stores a
payload and the kernel that announces it: no kernel issues a system-scope fence or an atomic on
host memory (both cost tens of microseconds per call on the thread rig's H200).

Epochs, not resets: flags and LL words only ever receive epochs from their one writer, so a
captured graph replays forever and nothing is reset (`direct_kernels.py` keeps the counters).
Payloads alternate between two parities (epoch & 1): a rank writes parity q again two calls later,
and by then every peer has finished reading it: in the call between, this rank saw every peer's
announcement (LL words or round-0 flags) of that call, which each peer made only after its own
kernels of the call before had completed (stream order). Round-1 sums follow the same argument
with round-0 flags. INT8 records live in the native slots at the same parities, under the same
counters and flag rounds, so the argument covers them and any mix of native and INT8 calls. LL
words and native payloads live in separate regions, and the direct area apart from the barrier
paths' slots, so any mix of calls needs nothing more.

Waiting: the first collect kernel's program 0 writes the status word (the watchdog's "waiting
at DIRECT") and the rank's epoch word, which the watchdog compares with the peers'; the last
kernel of a call writes "done" and bumps the progress word.
"""

from __future__ import annotations

from glmctl.collectives import direct_int8_kernels, direct_kernels
from glmctl.collectives.call_plan import CollectivePlan, direct_result_offset
from glmctl.collectives.staging import Staging, Sync


def all_reduce(st: Staging, sync: Sync, x, out, plan: CollectivePlan, stream: int) -> None:
    common = dict(numel=plan.numel, rank=st.rank, world=st.world)
    area = st.direct
    if plan.algorithm == "direct_ll":
        direct_kernels.ll(x, out, area, gather=False, progress=st.progress, **common)
        return
    if plan.algorithm == "direct_1s":
        direct_kernels.publish(x, area, **common)
        sync.fence(stream)
        direct_kernels.collect(x, out, area, mode=direct_kernels.REDUCE, round_=0,
                               span=(0, plan.numel), bump=True, progress=st.progress, tick=True,
                               **common)
        return
    if plan.int8:
        _all_reduce_int8(st, sync, x, out, plan, stream)
        return
    lo, count = plan.chunk_span(st.rank)
    res_off = direct_result_offset(plan) // plan.elem_bytes
    direct_kernels.publish(x, area, skip=(lo, lo + count), **common)
    sync.fence(stream)
    direct_kernels.collect(x, out, area, mode=direct_kernels.REDUCE_SCATTER, round_=0,
                           span=(lo, lo + count), res_off=res_off, bump=False, **common)
    sync.fence(stream)
    direct_kernels.collect(x, out, area, mode=direct_kernels.GATHER_SUMS, round_=1,
                           span=(0, plan.chunk_elems), chunk=plan.chunk_elems, res_off=res_off,
                           bump=True, progress=st.progress, tick=True, **common)


def _all_reduce_int8(st: Staging, sync: Sync, x, out, plan: CollectivePlan, stream: int) -> None:
    """`direct_2s` with INT8 records: the same kernels, fences and flag rounds as native."""
    kw = dict(numel=plan.numel, rank=st.rank, world=st.world, layout=plan.layout)
    res_off = direct_result_offset(plan)
    direct_int8_kernels.publish(x, st.direct, **kw)
    sync.fence(stream)
    direct_int8_kernels.collect(x, out, st.direct, round_=0, res_off=res_off, bump=False, **kw)
    sync.fence(stream)
    direct_int8_kernels.collect(x, out, st.direct, round_=1, res_off=res_off, bump=True,
                                progress=st.progress, tick=True, **kw)


def all_gather(st: Staging, sync: Sync, x, flat, plan: CollectivePlan, stream: int) -> None:
    """flat[j * numel:(j + 1) * numel] = rank j's x (LL words or one native shot)."""
    common = dict(numel=plan.numel, rank=st.rank, world=st.world)
    area = st.direct
    if plan.algorithm == "direct_ll":
        direct_kernels.ll(x, flat, area, gather=True, progress=st.progress, **common)
        return
    direct_kernels.publish(x, area, **common)
    sync.fence(stream)
    direct_kernels.collect(x, flat, area, mode=direct_kernels.GATHER, round_=0,
                           span=(0, plan.numel), bump=True, progress=st.progress, tick=True,
                           **common)
