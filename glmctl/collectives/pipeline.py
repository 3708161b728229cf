"""Pipelined data paths: large messages on the copy engine both ways (`plan.pieces` > 0), with the
device-to-host copies of later pieces running while earlier pieces come back host-to-device.

Two streams per rank. The caller's stream (`stream`, "B") passes B0, forks the communicator's
device-to-host stream ("A") with an event, waits for each piece's arrival flags, copies pieces in,
runs the kernels, and joins A back at the end, so a call is one fork-join region (capturable as
it is). A only copies out and raises arrival flags (`protocol.arrive_memops`), in piece order.
Per piece p, rank j's A copies piece p of its message into its host slot, then raises piece flag
p for every peer; a reader's B waits for that flag from every peer, resets it, and reads piece p
(`protocol.await_memops`). Piece flags are the same constant writes as the barriers (graph replay
safe), and the reader's reset is safe for the same reason: the writer raises a flag again only in
a later call, after B0, which the reader reaches after its resets.

Host enqueue order is causal (an event is recorded before any stream waits on it), which CUDA
needs (a wait binds to the event's most recent record) and the CPU simulation relies on.

Algorithms (layouts in `plan.py`), for rank r of n, piece p, slice s:
- one-shot: A: x[p] -> slot r; B: peers' [p] -> stage; reduce [p] (fp32, rank order) -> out[p].
  The reduce of piece p also waits for A's copy of x[p] (an event): out may be x.
- two-shot: A: slice s of x except region r -> slot r; B: region r of s from the peers -> stage,
  reduce -> out; A (after that reduce, an event): out's region r -> result area, raise the second
  flag of s; B (one slice later, so the copy engine keeps busy): the other regions of s from the
  result area -> out. Every rank's input for slice s is out before anyone's result of s exists,
  so writing results into out in place never races A's reads of x.
- INT8: B quantizes the whole message into its stage slot before the fork (a short kernel; the
  copies are the long part); records replace pieces; two-shot re-quantizes each reduced region.
- all-gather: A: x[p] -> slot r; B: peers' [p] -> their place in the output (INT8: -> stage, then
  decode every rank's record p, the own one included, so all ranks hold the same bits).
"""

from __future__ import annotations

from glmctl.collectives import kernels
from glmctl.collectives.kernels import MappedPtr, at, f32, i8
from glmctl.collectives.plan import CollectivePlan
from glmctl.collectives.staging import SideStream, Staging, Sync


def _pull(st, plan: CollectivePlan, offset: int, nbytes: int, stream: int) -> None:
    """Peers' bytes [offset, offset+nbytes) of their slots, host -> the same place in the stage."""
    a = plan.slot_stride
    for j in st.peers:
        st.copy(st.stage + j * a + offset, st.host + j * a + offset, nbytes,
                               stream)


def all_reduce_one_shot(st: Staging, sync: Sync, side: SideStream, x, out, plan: CollectivePlan,
                        stream: int) -> None:
    r, n, a, eb, A = st.rank, st.world, plan.slot_stride, plan.elem_bytes, side.stream
    sync.barrier(0, stream)
    side.fork(stream)
    for p in range(plan.pieces):
        lo, count = plan.chunk_span(p)
        st.copy(st.host + r * a + lo * eb, x.data_ptr() + lo * eb, count * eb, A)
        sync.arrive(p, A)
        side.signal(p, A)
    for p in range(plan.pieces):
        lo, count = plan.chunk_span(p)
        sync.await_flag(p, stream)
        _pull(st, plan, lo * eb, count * eb, stream)
        side.after(p, stream)
        kernels.reduce_slots(MappedPtr(st.stage + lo * eb, x.dtype), at(x, lo), at(out, lo),
                             numel=count, slot_stride=a // eb, rank=r, world=n,
                             progress=st.progress, tick=p == plan.pieces - 1)
    side.join(stream)


def all_reduce_two_shot(st: Staging, sync: Sync, side: SideStream, x, out, plan: CollectivePlan,
                        stream: int) -> None:
    r, n, a, eb, A = st.rank, st.world, plan.slot_stride, plan.elem_bytes, side.stream
    k = plan.pieces
    res_host = st.host + n * st.capacity

    def send_slice(s):  # A: the slice minus the own region, into the own host slot
        lo, count = plan.slice_span(s)
        rlo, rcount = plan.chunk_span(s * n + r)
        rlo, rhi = min(max(rlo, lo), lo + count), min(rlo + rcount, lo + count)
        base = st.host + r * a
        st.copy(base + lo * eb, x.data_ptr() + lo * eb, (rlo - lo) * eb, A)
        st.copy(base + rhi * eb, x.data_ptr() + rhi * eb, (lo + count - rhi) * eb, A)
        sync.arrive(s, A)

    def reduce_slice(s):  # B
        rlo, rcount = plan.chunk_span(s * n + r)
        sync.await_flag(s, stream)
        _pull(st, plan, rlo * eb, rcount * eb, stream)
        kernels.reduce_slots(MappedPtr(st.stage + rlo * eb, x.dtype), at(x, rlo), at(out, rlo),
                             numel=rcount, slot_stride=a // eb, rank=r, world=n)
        side.signal(s, stream)

    def send_result(s):  # A, once B reduced region r of slice s
        rlo, rcount = plan.chunk_span(s * n + r)
        side.after(s, A)
        st.copy(res_host + rlo * eb, out.data_ptr() + rlo * eb, rcount * eb, A)
        sync.arrive(k + s, A)

    def gather_slice(s):  # B: the other owners' results of slice s, into out
        lo, count = plan.slice_span(s)
        rlo, rcount = plan.chunk_span(s * n + r)
        rlo, rhi = min(max(rlo, lo), lo + count), min(rlo + rcount, lo + count)
        sync.await_flag(k + s, stream)
        st.copy(out.data_ptr() + lo * eb, res_host + lo * eb, (rlo - lo) * eb, stream)
        st.copy(out.data_ptr() + rhi * eb, res_host + rhi * eb, (lo + count - rhi) * eb,
                         stream)

    sync.barrier(0, stream)
    side.fork(stream)
    _skewed(k, send_slice, reduce_slice, send_result, gather_slice)
    kernels.bump_progress(st.progress)
    side.join(stream)


def _skewed(k: int, send_slice, reduce_slice, send_result, gather_slice, last_gather=None) -> None:
    """The two-shot schedule over k slices, skewed by one: slice s is sent and reduced while
    slice s - 1's results go out and come back."""
    for s in range(k):
        send_slice(s)
        if s:
            send_result(s - 1)
        reduce_slice(s)
        if s:
            gather_slice(s - 1)
    send_result(k - 1)
    (last_gather or gather_slice)(k - 1)


def _quantize_all(st, x, plan: CollectivePlan) -> int:
    """Every record of x into the own stage slot (on the caller's stream); returns its address."""
    own = st.stage + st.rank * plan.slot_stride
    kernels.quantize(x, plan.numel, i8(own), f32(own), plan.layout)
    return own


def all_reduce_int8(st: Staging, sync: Sync, side: SideStream, x, out, plan: CollectivePlan,
                        stream: int) -> None:
    r, n, a, A = st.rank, st.world, plan.slot_stride, side.stream
    layout, k = plan.layout, plan.pieces
    rec, ce = layout.record_bytes, layout.chunk_elems
    sync.barrier(0, stream)
    own = _quantize_all(st, x, plan)
    side.fork(stream)
    host = st.host + r * a
    if plan.algorithm == "one_shot":
        for p in range(k):
            st.copy(host + p * rec, own + p * rec, rec, A)
            sync.arrive(p, A)
        for p in range(k):
            sync.await_flag(p, stream)
            _pull(st, plan, p * rec, rec, stream)
            kernels.dequant_reduce(i8(st.stage), f32(st.stage), i8(own), f32(own),
                                   at(out, p * ce), layout, n_valid=plan.chunk_span(p)[1],
                                   slot_stride=a, chunk_off=p * rec, rank=r, world=n,
                                   progress=st.progress, tick=p == k - 1)
        side.join(stream)
        return
    res_stage = st.stage + n * st.capacity
    res_host = st.host + n * st.capacity

    def send_slice(s):
        first = s * n
        st.copy(host + first * rec, own + first * rec, r * rec, A)
        st.copy(host + (first + r + 1) * rec, own + (first + r + 1) * rec,
                         (n - 1 - r) * rec, A)
        sync.arrive(s, A)

    def reduce_slice(s):
        c = s * n + r
        sync.await_flag(s, stream)
        _pull(st, plan, c * rec, rec, stream)
        kernels.dequant_reduce(i8(st.stage), f32(st.stage), i8(own), f32(own),
                               at(out, c * ce), layout, n_valid=plan.chunk_span(c)[1],
                               slot_stride=a, chunk_off=c * rec, rank=r, world=n,
                               res8=i8(res_stage + c * rec), res32=f32(res_stage + c * rec))
        side.signal(s, stream)

    def send_result(s):
        c = s * n + r
        side.after(s, A)
        st.copy(res_host + c * rec, res_stage + c * rec, rec, A)
        sync.arrive(k + s, A)

    def gather_slice(s, tick=False):
        first = s * n
        sync.await_flag(k + s, stream)
        st.copy(res_stage + first * rec, res_host + first * rec, r * rec, stream)
        st.copy(res_stage + (first + r + 1) * rec, res_host + (first + r + 1) * rec,
                         (n - 1 - r) * rec, stream)
        src = res_stage + first * rec
        kernels.dequant_records(i8(src), f32(src), at(out, first * ce), layout, n_valid=ce,
                                total=plan.numel - first * ce, records=n, rec_stride=rec,
                                out_stride=ce, skip=r, progress=st.progress, tick=tick)

    _skewed(k, send_slice, reduce_slice, send_result, gather_slice,
            last_gather=lambda s: gather_slice(s, tick=True))
    side.join(stream)


def all_gather(st: Staging, sync: Sync, side: SideStream, x, flat, plan: CollectivePlan,
               stream: int) -> None:
    """flat[j * numel:(j + 1) * numel] = rank j's message."""
    r, n, m, a, A = st.rank, st.world, plan.numel, plan.slot_stride, side.stream
    k, eb = plan.pieces, plan.elem_bytes
    host = st.host + r * a
    sync.barrier(0, stream)
    if plan.int8:
        layout = plan.layout
        rec, ce = layout.record_bytes, layout.chunk_elems
        own = _quantize_all(st, x, plan)
        side.fork(stream)
        for p in range(k):
            st.copy(host + p * rec, own + p * rec, rec, A)
            sync.arrive(p, A)
        for p in range(k):
            sync.await_flag(p, stream)
            _pull(st, plan, p * rec, rec, stream)
            src = st.stage + p * rec
            kernels.dequant_records(i8(src), f32(src), at(flat, p * ce), layout,
                                    n_valid=plan.chunk_span(p)[1], total=n * m - p * ce,
                                    records=n, rec_stride=a, out_stride=m,
                                    progress=st.progress, tick=p == k - 1)
        side.join(stream)
        return
    st.copy(flat.data_ptr() + r * m * eb, x.data_ptr(), m * eb, stream)
    side.fork(stream)
    for p in range(k):
        lo, count = plan.chunk_span(p)
        st.copy(host + lo * eb, x.data_ptr() + lo * eb, count * eb, A)
        sync.arrive(p, A)
    for p in range(k):
        lo, count = plan.chunk_span(p)
        sync.await_flag(p, stream)
        for j in st.peers:
            st.copy(flat.data_ptr() + (j * m + lo) * eb, st.host + j * a + lo * eb,
                             count * eb, stream)
    kernels.bump_progress(st.progress)
    side.join(stream)
