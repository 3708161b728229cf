"""The operation sequences of each collective, enqueued on one stream (capturable as they are).

`comm` is the `HostStagedCommunicator`; `hdata`/`sdata` are the device addresses of the host data
area and of its device mirror ("stage"); the result area follows the data area in both, at
`world * capacity`. A plan's `d2h`/`h2d` say whether bytes cross PCIe by copy engine (`ce`,
cuMemcpyAsync) or by the kernel itself loading/storing mapped host memory (`sm`). The last kernel of
every call bumps the progress word (`tick=True`) the watchdog watches.
"""

from __future__ import annotations

import torch

from glmctl.collectives import kernels
from glmctl.collectives.kernels import MappedPtr
from glmctl.collectives.plan import CollectivePlan


def _at(t: torch.Tensor, elem_offset: int = 0) -> MappedPtr:
    return MappedPtr(t.data_ptr() + elem_offset * t.element_size(), t.dtype)


def _i8(addr: int) -> MappedPtr:
    return MappedPtr(addr, torch.int8)


def _f32(addr: int) -> MappedPtr:
    return MappedPtr(addr, torch.float32)


def _publish_own(comm, x: torch.Tensor, plan: CollectivePlan, stream: int) -> None:
    """Native payload: this rank's message into its host slot."""
    dst = comm._hdata + comm.rank * plan.slot_stride
    if plan.d2h == "ce":
        comm._drv.memcpy_async(dst, x.data_ptr(), plan.nbytes, stream)
    else:
        kernels.copy_records(x, MappedPtr(dst, x.dtype), n_valid=plan.numel, total=plan.numel)


def _publish_own_int8(comm, x: torch.Tensor, plan: CollectivePlan, stream: int) -> int:
    """INT8 payload: encode into the own stage slot (and the host slot); returns the stage address."""
    layout, a = plan.layout, plan.slot_stride
    own = comm._sdata + comm.rank * a
    host = comm._hdata + comm.rank * a
    dual = plan.d2h == "sm"
    kernels.quantize(x, plan.numel, _i8(own), _f32(own), layout,
                     dup8=_i8(host) if dual else None, dup32=_f32(host) if dual else None)
    if not dual:
        comm._drv.memcpy_async(host, own, layout.total_bytes, stream)
    return own


def _fetch_peer_slots(comm, plan: CollectivePlan, stream: int, offset: int = 0,
                      nbytes: int | None = None) -> int:
    """Base address to read peers' slots from: the host area (SM path) or the stage after copying
    peers' bytes [offset, offset+nbytes) of each slot (copy-engine path; whole slots when the
    range is the whole slot, as two copies around the own slot)."""
    if plan.h2d == "sm":
        return comm._hdata
    r, n, a, drv = comm.rank, comm.world_size, plan.slot_stride, comm._drv
    if nbytes is None:
        drv.memcpy_async(comm._sdata, comm._hdata, r * a, stream)
        drv.memcpy_async(comm._sdata + (r + 1) * a, comm._hdata + (r + 1) * a, (n - 1 - r) * a, stream)
    else:
        for j in range(n):
            if j != r:
                drv.memcpy_async(comm._sdata + j * a + offset, comm._hdata + j * a + offset, nbytes,
                                 stream)
    return comm._sdata


def all_reduce_one_shot(comm, x, out, plan: CollectivePlan, stream: int) -> None:
    comm.barrier(0, stream)
    _publish_own(comm, x, plan, stream)
    comm.barrier(1, stream)
    peer = _fetch_peer_slots(comm, plan, stream)
    kernels.reduce_slots(MappedPtr(peer, x.dtype), x, out, numel=plan.numel,
                         slot_stride=plan.slot_stride // plan.elem_bytes, rank=comm.rank,
                         world=comm.world_size, progress=comm._progress, tick=True)


def all_reduce_two_shot(comm, x, out, plan: CollectivePlan, stream: int) -> None:
    r, eb = comm.rank, plan.elem_bytes
    lo, count = plan.chunk_span(r)
    res_off = comm.world_size * comm._capacity
    comm.barrier(0, stream)
    _publish_own(comm, x, plan, stream)
    comm.barrier(1, stream)
    # reduce-scatter: chunk r of every slot, summed in rank order
    peer = _fetch_peer_slots(comm, plan, stream, offset=lo * eb, nbytes=count * eb)
    res_host = comm._hdata + res_off + lo * eb
    res_stage = comm._sdata + res_off + lo * eb
    published = res_host if plan.d2h == "sm" else res_stage
    kernels.reduce_slots(MappedPtr(peer + lo * eb, x.dtype), _at(x, lo), _at(out, lo), numel=count,
                         slot_stride=plan.slot_stride // eb, rank=r, world=comm.world_size,
                         out2=MappedPtr(published, x.dtype))
    if plan.d2h == "ce":
        comm._drv.memcpy_async(res_host, res_stage, count * eb, stream)
    comm.barrier(2, stream)
    # all-gather hop: the result area is laid out like the output
    res = comm._hdata + res_off
    if plan.h2d == "ce":
        below, above = min(lo, plan.numel) * eb, min(lo + count, plan.numel) * eb
        comm._drv.memcpy_async(out.data_ptr(), res, below, stream)
        comm._drv.memcpy_async(out.data_ptr() + above, res + above, plan.nbytes - above, stream)
        kernels.bump_progress(comm._progress)
    else:
        kernels.copy_records(MappedPtr(res, x.dtype), out, n_valid=plan.chunk_elems, total=plan.numel,
                             records=comm.world_size, src_stride=plan.chunk_elems,
                             dst_stride=plan.chunk_elems, skip=r, progress=comm._progress, tick=True)


def all_reduce_int8(comm, x, out, plan: CollectivePlan, stream: int) -> None:
    r, n, layout = comm.rank, comm.world_size, plan.layout
    comm.barrier(0, stream)
    own = _publish_own_int8(comm, x, plan, stream)
    comm.barrier(1, stream)
    if plan.algorithm == "one_shot":
        peer = _fetch_peer_slots(comm, plan, stream)
        kernels.dequant_reduce(_i8(peer), _f32(peer), _i8(own), _f32(own), out, layout,
                               n_valid=plan.numel, slot_stride=plan.slot_stride, chunk_off=0, rank=r,
                               world=n, progress=comm._progress, tick=True)
        return
    rec = layout.record_bytes
    lo, count = plan.chunk_span(r)
    res_off = n * comm._capacity
    peer = _fetch_peer_slots(comm, plan, stream, offset=r * rec, nbytes=rec)
    res_stage = comm._sdata + res_off + r * rec
    res_host = comm._hdata + res_off + r * rec
    dual = plan.d2h == "sm"
    kernels.dequant_reduce(_i8(peer), _f32(peer), _i8(own), _f32(own), _at(out, lo), layout,
                           n_valid=count, slot_stride=plan.slot_stride, chunk_off=r * rec, rank=r,
                           world=n, res8=_i8(res_stage), res32=_f32(res_stage),
                           dup8=_i8(res_host) if dual else None, dup32=_f32(res_host) if dual else None)
    if not dual:
        comm._drv.memcpy_async(res_host, res_stage, rec, stream)
    comm.barrier(2, stream)
    src = comm._hdata + res_off
    if plan.h2d == "ce":
        stage = comm._sdata + res_off
        comm._drv.memcpy_async(stage, src, r * rec, stream)
        comm._drv.memcpy_async(stage + (r + 1) * rec, src + (r + 1) * rec, (n - 1 - r) * rec, stream)
        src = stage
    kernels.dequant_records(_i8(src), _f32(src), out, layout, n_valid=layout.chunk_elems,
                            total=plan.numel, records=n, rec_stride=rec,
                            out_stride=layout.chunk_elems, skip=r, progress=comm._progress, tick=True)


def all_gather(comm, x, flat, plan: CollectivePlan, stream: int) -> None:
    """flat[j * numel:(j + 1) * numel] = rank j's message."""
    r, n, m, a = comm.rank, comm.world_size, plan.numel, plan.slot_stride
    comm.barrier(0, stream)
    if plan.int8:
        layout = plan.layout
        own = _publish_own_int8(comm, x, plan, stream)
        comm.barrier(1, stream)
        src = _fetch_peer_slots(comm, plan, stream)
        common = dict(n_valid=m, total=n * m, rec_stride=a, out_stride=m)
        if plan.h2d == "ce":  # the stage now holds every record, the own one included
            kernels.dequant_records(_i8(src), _f32(src), flat, layout, records=n,
                                    progress=comm._progress, tick=True, **common)
        else:
            kernels.dequant_records(_i8(src), _f32(src), flat, layout, records=n, skip=r, **common)
            base = own - r * a
            kernels.dequant_records(_i8(base), _f32(base), flat, layout, records=1, rec0=r,
                                    progress=comm._progress, tick=True, **common)
        return
    eb = plan.elem_bytes
    _publish_own(comm, x, plan, stream)
    comm.barrier(1, stream)
    drv, out = comm._drv, flat.data_ptr()
    drv.memcpy_async(out + r * m * eb, x.data_ptr(), m * eb, stream)
    if plan.h2d == "ce":
        if a == m * eb:
            drv.memcpy_async(out, comm._hdata, r * a, stream)
            drv.memcpy_async(out + (r + 1) * a, comm._hdata + (r + 1) * a, (n - 1 - r) * a, stream)
        else:
            for j in range(n):
                if j != r:
                    drv.memcpy_async(out + j * m * eb, comm._hdata + j * a, m * eb, stream)
        kernels.bump_progress(comm._progress)
    else:
        kernels.copy_records(MappedPtr(comm._hdata, x.dtype), flat, n_valid=m, total=n * m,
                             records=n, src_stride=a // eb, dst_stride=m, skip=r,
                             progress=comm._progress, tick=True)
