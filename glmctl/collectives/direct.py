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
with round-0 flags. LL words and native payloads live in separate regions, and the direct area
apart from the barrier paths' slots, so any mix of calls needs nothing more.

Waiting: the first collect kernel's program 0 writes the status word (the watchdog's "waiting
at DIRECT") and the rank's epoch word, which the watchdog compares with the peers'; the last
kernel of a call writes "done" and bumps the progress word.
"""

from __future__ import annotations

from glmctl.collectives import direct_kernels
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
