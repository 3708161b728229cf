"""The operation sequences of each collective, enqueued on one stream (capturable as they are), and
the table that picks one for a plan (`enqueue`).

Every path takes the rank's `Staging` (where bytes go) and `Sync` (barriers, fences), nothing else of the
communicator (`staging.py`). A plan's `d2h`/`h2d` say whether bytes cross PCIe by copy engine
(`ce`, `st.copy`) or by the kernel itself loading/storing mapped host memory (`sm`). The last
kernel of every call bumps the progress word (`tick=True`) the watchdog watches.
"""

from __future__ import annotations

from glmctl.collectives import direct, kernels
from glmctl.collectives.call_plan import CollectivePlan
from glmctl.collectives.kernels import MappedPtr, at, f32, i8
from glmctl.collectives.staging import Staging, Sync


def _publish_own(st: Staging, x, plan: CollectivePlan, stream: int) -> None:
    """Native payload: this rank's message into its host slot."""
    dst = st.host + st.rank * plan.slot_stride
    if plan.d2h == "ce":
        st.copy(dst, x.data_ptr(), plan.nbytes, stream)
    else:
        kernels.copy_records(x, MappedPtr(dst, x.dtype), n_valid=plan.numel, total=plan.numel)


def _publish_own_int8(st: Staging, x, plan: CollectivePlan, stream: int) -> int:
    """INT8 payload: encode into the own stage slot (and the host slot); returns the stage address."""
    layout, a = plan.layout, plan.slot_stride
    own = st.stage + st.rank * a
    host = st.host + st.rank * a
    dual = plan.d2h == "sm"
    kernels.quantize(x, plan.numel, i8(own), f32(own), layout,
                     dup8=i8(host) if dual else None, dup32=f32(host) if dual else None)
    if not dual:
        st.copy(host, own, layout.total_bytes, stream)
    return own


def _fetch_peer_slots(st: Staging, plan: CollectivePlan, stream: int, offset: int = 0,
                      nbytes: int | None = None) -> int:
    """Base address to read peers' slots from: the host area (SM path) or the stage after copying
    peers' bytes [offset, offset+nbytes) of each slot (copy-engine path; whole slots when the
    range is the whole slot, as two copies around the own slot)."""
    if plan.h2d == "sm":
        return st.host
    r, n, a = st.rank, st.world, plan.slot_stride
    if nbytes is None:
        st.copy(st.stage, st.host, r * a, stream)
        st.copy(st.stage + (r + 1) * a, st.host + (r + 1) * a, (n - 1 - r) * a, stream)
    else:
        for j in st.peers:
            st.copy(st.stage + j * a + offset, st.host + j * a + offset, nbytes, stream)
    return st.stage


def all_reduce_one_shot(st: Staging, sync: Sync, x, out, plan: CollectivePlan, stream: int) -> None:
    sync.barrier(0, stream)
    _publish_own(st, x, plan, stream)
    sync.barrier(1, stream)
    peer = _fetch_peer_slots(st, plan, stream)
    kernels.reduce_slots(MappedPtr(peer, x.dtype), x, out, numel=plan.numel,
                         slot_stride=plan.slot_stride // plan.elem_bytes, rank=st.rank,
                         world=st.world, progress=st.progress, tick=True)


def all_reduce_two_shot(st: Staging, sync: Sync, x, out, plan: CollectivePlan, stream: int) -> None:
    r, eb = st.rank, plan.elem_bytes
    lo, count = plan.chunk_span(r)
    sync.barrier(0, stream)
    _publish_own(st, x, plan, stream)
    sync.barrier(1, stream)
    # reduce-scatter: chunk r of every slot, summed in rank order
    peer = _fetch_peer_slots(st, plan, stream, offset=lo * eb, nbytes=count * eb)
    res_host = st.host + st.result_offset + lo * eb
    res_stage = st.stage + st.result_offset + lo * eb
    published = res_host if plan.d2h == "sm" else res_stage
    kernels.reduce_slots(MappedPtr(peer + lo * eb, x.dtype), at(x, lo), at(out, lo), numel=count,
                         slot_stride=plan.slot_stride // eb, rank=r, world=st.world,
                         out2=MappedPtr(published, x.dtype))
    if plan.d2h == "ce":
        st.copy(res_host, res_stage, count * eb, stream)
    sync.barrier(2, stream)
    # all-gather hop: the result area is laid out like the output
    res = st.host + st.result_offset
    if plan.h2d == "ce":
        below, above = min(lo, plan.numel) * eb, min(lo + count, plan.numel) * eb
        st.copy(out.data_ptr(), res, below, stream)
        st.copy(out.data_ptr() + above, res + above, plan.nbytes - above, stream)
        kernels.bump_progress(st.progress)
    else:
        kernels.copy_records(MappedPtr(res, x.dtype), out, n_valid=plan.chunk_elems, total=plan.numel,
                             records=st.world, src_stride=plan.chunk_elems,
                             dst_stride=plan.chunk_elems, skip=r, progress=st.progress, tick=True)


def all_reduce_int8(st: Staging, sync: Sync, x, out, plan: CollectivePlan, stream: int) -> None:
    r, n, layout = st.rank, st.world, plan.layout
    sync.barrier(0, stream)
    own = _publish_own_int8(st, x, plan, stream)
    sync.barrier(1, stream)
    if plan.algorithm == "one_shot":
        peer = _fetch_peer_slots(st, plan, stream)
        kernels.dequant_reduce(i8(peer), f32(peer), i8(own), f32(own), out, layout,
                               n_valid=plan.numel, slot_stride=plan.slot_stride, chunk_off=0, rank=r,
                               world=n, progress=st.progress, tick=True)
        return
    rec = layout.record_bytes
    lo, count = plan.chunk_span(r)
    peer = _fetch_peer_slots(st, plan, stream, offset=r * rec, nbytes=rec)
    res_stage = st.stage + st.result_offset + r * rec
    res_host = st.host + st.result_offset + r * rec
    dual = plan.d2h == "sm"
    kernels.dequant_reduce(i8(peer), f32(peer), i8(own), f32(own), at(out, lo), layout,
                           n_valid=count, slot_stride=plan.slot_stride, chunk_off=r * rec, rank=r,
                           world=n, res8=i8(res_stage), res32=f32(res_stage),
                           dup8=i8(res_host) if dual else None, dup32=f32(res_host) if dual else None)
    if not dual:
        st.copy(res_host, res_stage, rec, stream)
    sync.barrier(2, stream)
    src = st.host + st.result_offset
    if plan.h2d == "ce":
        stage = st.stage + st.result_offset
        st.copy(stage, src, r * rec, stream)
        st.copy(stage + (r + 1) * rec, src + (r + 1) * rec, (n - 1 - r) * rec, stream)
        src = stage
    kernels.dequant_records(i8(src), f32(src), out, layout, n_valid=layout.chunk_elems,
                            total=plan.numel, records=n, rec_stride=rec,
                            out_stride=layout.chunk_elems, skip=r, progress=st.progress, tick=True)


def all_gather(st: Staging, sync: Sync, x, flat, plan: CollectivePlan, stream: int) -> None:
    """flat[j * numel:(j + 1) * numel] = rank j's message."""
    r, n, m, a = st.rank, st.world, plan.numel, plan.slot_stride
    sync.barrier(0, stream)
    if plan.int8:
        layout = plan.layout
        own = _publish_own_int8(st, x, plan, stream)
        sync.barrier(1, stream)
        src = _fetch_peer_slots(st, plan, stream)
        common = dict(n_valid=m, total=n * m, rec_stride=a, out_stride=m)
        if plan.h2d == "ce":  # the stage now holds every record, the own one included
            kernels.dequant_records(i8(src), f32(src), flat, layout, records=n,
                                    progress=st.progress, tick=True, **common)
        else:
            kernels.dequant_records(i8(src), f32(src), flat, layout, records=n, skip=r, **common)
            base = own - r * a
            kernels.dequant_records(i8(base), f32(base), flat, layout, records=1, rec0=r,
                                    progress=st.progress, tick=True, **common)
        return
    eb = plan.elem_bytes
    _publish_own(st, x, plan, stream)
    sync.barrier(1, stream)
    out = flat.data_ptr()
    st.copy(out + r * m * eb, x.data_ptr(), m * eb, stream)
    if plan.h2d == "ce":
        if a == m * eb:
            st.copy(out, st.host, r * a, stream)
            st.copy(out + (r + 1) * a, st.host + (r + 1) * a, (n - 1 - r) * a, stream)
        else:
            for j in st.peers:
                st.copy(out + j * m * eb, st.host + j * a, m * eb, stream)
        kernels.bump_progress(st.progress)
    else:
        kernels.copy_records(MappedPtr(st.host, x.dtype), flat, n_valid=m, total=n * m,
                             records=n, src_stride=a // eb, dst_stride=m, skip=r,
                             progress=st.progress, tick=True)


# (op, algorithm, int8) -> the path
PATHS = {
    ("all_reduce", "one_shot", False): all_reduce_one_shot,
    ("all_reduce", "two_shot", False): all_reduce_two_shot,
    ("all_reduce", "one_shot", True): all_reduce_int8,
    ("all_reduce", "two_shot", True): all_reduce_int8,
    ("all_gather", "gather", False): all_gather,
    ("all_gather", "gather", True): all_gather,
    ("all_reduce", "direct_ll", False): direct.all_reduce,
    ("all_reduce", "direct_1s", False): direct.all_reduce,
    ("all_reduce", "direct_2s", False): direct.all_reduce,
    ("all_reduce", "direct_2s", True): direct.all_reduce,
    ("all_gather", "direct_ll", False): direct.all_gather,
    ("all_gather", "direct_1s", False): direct.all_gather,
}


def enqueue(plan: CollectivePlan, st: Staging, sync: Sync, x, out, stream: int) -> None:
    """Enqueue the call `plan` describes: all-reduce x into out (may be x), or all-gather x into
    the flat out (`world * numel` elements, rank order)."""
    PATHS[(plan.op, plan.algorithm, plan.int8)](st, sync, x, out, plan, stream)
