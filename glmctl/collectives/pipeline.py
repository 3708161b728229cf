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
from glmctl.collectives.datapath import _at, _f32, _i8
from glmctl.collectives.kernels import MappedPtr
from glmctl.collectives.plan import CollectivePlan

EV_FORK, EV_JOIN, EV_PIECE0 = 0, 1, 2  # indices into the communicator's events


def _fork(comm, stream: int) -> None:
    comm._drv.event_record(comm.event(EV_FORK), stream)
    comm._drv.stream_wait_event(comm.d2h_stream, comm.event(EV_FORK))


def _join(comm, stream: int) -> None:
    comm._drv.event_record(comm.event(EV_JOIN), comm.d2h_stream)
    comm._drv.stream_wait_event(stream, comm.event(EV_JOIN))


def _signal(comm, p: int, src: int) -> None:
    comm._drv.event_record(comm.event(EV_PIECE0 + p), src)


def _after(comm, p: int, dst: int) -> None:
    comm._drv.stream_wait_event(dst, comm.event(EV_PIECE0 + p))


def _peers(comm):
    return [j for j in range(comm.world_size) if j != comm.rank]


def _pull(comm, plan: CollectivePlan, offset: int, nbytes: int, stream: int) -> None:
    """Peers' bytes [offset, offset+nbytes) of their slots, host -> the same place in the stage."""
    a = plan.slot_stride
    for j in _peers(comm):
        comm._drv.memcpy_async(comm._sdata + j * a + offset, comm._hdata + j * a + offset, nbytes,
                               stream)


def all_reduce_one_shot(comm, x, out, plan: CollectivePlan, stream: int) -> None:
    r, n, a, eb, drv, A = comm.rank, comm.world_size, plan.slot_stride, plan.elem_bytes, comm._drv, \
        comm.d2h_stream
    comm.barrier(0, stream)
    _fork(comm, stream)
    for p in range(plan.pieces):
        lo, count = plan.chunk_span(p)
        drv.memcpy_async(comm._hdata + r * a + lo * eb, x.data_ptr() + lo * eb, count * eb, A)
        comm.arrive(p, A)
        _signal(comm, p, A)
    for p in range(plan.pieces):
        lo, count = plan.chunk_span(p)
        comm.await_flag(p, stream)
        _pull(comm, plan, lo * eb, count * eb, stream)
        _after(comm, p, stream)
        kernels.reduce_slots(MappedPtr(comm._sdata + lo * eb, x.dtype), _at(x, lo), _at(out, lo),
                             numel=count, slot_stride=a // eb, rank=r, world=n,
                             progress=comm._progress, tick=p == plan.pieces - 1)
    _join(comm, stream)


def all_reduce_two_shot(comm, x, out, plan: CollectivePlan, stream: int) -> None:
    r, n, a, eb, drv, A = comm.rank, comm.world_size, plan.slot_stride, plan.elem_bytes, comm._drv, \
        comm.d2h_stream
    k = plan.pieces
    res_host = comm._hdata + n * comm._capacity

    def send_slice(s):  # A: the slice minus the own region, into the own host slot
        lo, count = plan.slice_span(s)
        rlo, rcount = plan.chunk_span(s * n + r)
        rlo, rhi = min(max(rlo, lo), lo + count), min(rlo + rcount, lo + count)
        base = comm._hdata + r * a
        drv.memcpy_async(base + lo * eb, x.data_ptr() + lo * eb, (rlo - lo) * eb, A)
        drv.memcpy_async(base + rhi * eb, x.data_ptr() + rhi * eb, (lo + count - rhi) * eb, A)
        comm.arrive(s, A)

    def reduce_slice(s):  # B
        rlo, rcount = plan.chunk_span(s * n + r)
        comm.await_flag(s, stream)
        _pull(comm, plan, rlo * eb, rcount * eb, stream)
        kernels.reduce_slots(MappedPtr(comm._sdata + rlo * eb, x.dtype), _at(x, rlo), _at(out, rlo),
                             numel=rcount, slot_stride=a // eb, rank=r, world=n)
        _signal(comm, s, stream)

    def send_result(s):  # A, once B reduced region r of slice s
        rlo, rcount = plan.chunk_span(s * n + r)
        _after(comm, s, A)
        drv.memcpy_async(res_host + rlo * eb, out.data_ptr() + rlo * eb, rcount * eb, A)
        comm.arrive(k + s, A)

    def gather_slice(s):  # B: the other owners' results of slice s, into out
        lo, count = plan.slice_span(s)
        rlo, rcount = plan.chunk_span(s * n + r)
        rlo, rhi = min(max(rlo, lo), lo + count), min(rlo + rcount, lo + count)
        comm.await_flag(k + s, stream)
        drv.memcpy_async(out.data_ptr() + lo * eb, res_host + lo * eb, (rlo - lo) * eb, stream)
        drv.memcpy_async(out.data_ptr() + rhi * eb, res_host + rhi * eb, (lo + count - rhi) * eb,
                         stream)

    comm.barrier(0, stream)
    _fork(comm, stream)
    _skewed(k, send_slice, reduce_slice, send_result, gather_slice)
    kernels.bump_progress(comm._progress)
    _join(comm, stream)


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


def _quantize_all(comm, x, plan: CollectivePlan) -> int:
    """Every record of x into the own stage slot (on the caller's stream); returns its address."""
    own = comm._sdata + comm.rank * plan.slot_stride
    kernels.quantize(x, plan.numel, _i8(own), _f32(own), plan.layout)
    return own


def all_reduce_int8(comm, x, out, plan: CollectivePlan, stream: int) -> None:
    r, n, a, drv, A = comm.rank, comm.world_size, plan.slot_stride, comm._drv, comm.d2h_stream
    layout, k = plan.layout, plan.pieces
    rec, ce = layout.record_bytes, layout.chunk_elems
    comm.barrier(0, stream)
    own = _quantize_all(comm, x, plan)
    _fork(comm, stream)
    host = comm._hdata + r * a
    if plan.algorithm == "one_shot":
        for p in range(k):
            drv.memcpy_async(host + p * rec, own + p * rec, rec, A)
            comm.arrive(p, A)
        for p in range(k):
            comm.await_flag(p, stream)
            _pull(comm, plan, p * rec, rec, stream)
            kernels.dequant_reduce(_i8(comm._sdata), _f32(comm._sdata), _i8(own), _f32(own),
                                   _at(out, p * ce), layout, n_valid=plan.chunk_span(p)[1],
                                   slot_stride=a, chunk_off=p * rec, rank=r, world=n,
                                   progress=comm._progress, tick=p == k - 1)
        _join(comm, stream)
        return
    res_stage = comm._sdata + n * comm._capacity
    res_host = comm._hdata + n * comm._capacity

    def send_slice(s):
        first = s * n
        drv.memcpy_async(host + first * rec, own + first * rec, r * rec, A)
        drv.memcpy_async(host + (first + r + 1) * rec, own + (first + r + 1) * rec,
                         (n - 1 - r) * rec, A)
        comm.arrive(s, A)

    def reduce_slice(s):
        c = s * n + r
        comm.await_flag(s, stream)
        _pull(comm, plan, c * rec, rec, stream)
        kernels.dequant_reduce(_i8(comm._sdata), _f32(comm._sdata), _i8(own), _f32(own),
                               _at(out, c * ce), layout, n_valid=plan.chunk_span(c)[1],
                               slot_stride=a, chunk_off=c * rec, rank=r, world=n,
                               res8=_i8(res_stage + c * rec), res32=_f32(res_stage + c * rec))
        _signal(comm, s, stream)

    def send_result(s):
        c = s * n + r
        _after(comm, s, A)
        drv.memcpy_async(res_host + c * rec, res_stage + c * rec, rec, A)
        comm.arrive(k + s, A)

    def gather_slice(s, tick=False):
        first = s * n
        comm.await_flag(k + s, stream)
        drv.memcpy_async(res_stage + first * rec, res_host + first * rec, r * rec, stream)
        drv.memcpy_async(res_stage + (first + r + 1) * rec, res_host + (first + r + 1) * rec,
                         (n - 1 - r) * rec, stream)
        src = res_stage + first * rec
        kernels.dequant_records(_i8(src), _f32(src), _at(out, first * ce), layout, n_valid=ce,
                                total=plan.numel - first * ce, records=n, rec_stride=rec,
                                out_stride=ce, skip=r, progress=comm._progress, tick=tick)

    _skewed(k, send_slice, reduce_slice, send_result, gather_slice,
            last_gather=lambda s: gather_slice(s, tick=True))
    _join(comm, stream)


def all_gather(comm, x, flat, plan: CollectivePlan, stream: int) -> None:
    """flat[j * numel:(j + 1) * numel] = rank j's message."""
    r, n, m, a, drv, A = comm.rank, comm.world_size, plan.numel, plan.slot_stride, comm._drv, \
        comm.d2h_stream
    k, eb = plan.pieces, plan.elem_bytes
    host = comm._hdata + r * a
    comm.barrier(0, stream)
    if plan.int8:
        layout = plan.layout
        rec, ce = layout.record_bytes, layout.chunk_elems
        own = _quantize_all(comm, x, plan)
        _fork(comm, stream)
        for p in range(k):
            drv.memcpy_async(host + p * rec, own + p * rec, rec, A)
            comm.arrive(p, A)
        for p in range(k):
            comm.await_flag(p, stream)
            _pull(comm, plan, p * rec, rec, stream)
            src = comm._sdata + p * rec
            kernels.dequant_records(_i8(src), _f32(src), _at(flat, p * ce), layout,
                                    n_valid=plan.chunk_span(p)[1], total=n * m - p * ce,
                                    records=n, rec_stride=a, out_stride=m,
                                    progress=comm._progress, tick=p == k - 1)
        _join(comm, stream)
        return
    drv.memcpy_async(flat.data_ptr() + r * m * eb, x.data_ptr(), m * eb, stream)
    _fork(comm, stream)
    for p in range(k):
        lo, count = plan.chunk_span(p)
        drv.memcpy_async(host + lo * eb, x.data_ptr() + lo * eb, count * eb, A)
        comm.arrive(p, A)
    for p in range(k):
        lo, count = plan.chunk_span(p)
        comm.await_flag(p, stream)
        for j in _peers(comm):
            drv.memcpy_async(flat.data_ptr() + (j * m + lo) * eb, comm._hdata + j * a + lo * eb,
                             count * eb, stream)
    kernels.bump_progress(comm._progress)
    _join(comm, stream)
