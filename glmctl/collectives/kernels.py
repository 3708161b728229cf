"""Triton kernels of the host-staged collectives, and their launchers.

Pointers are anything with `data_ptr()` and `dtype`: torch tensors, or `MappedPtr` for host memory
registered with CUDA (Triton turns a registered host address into its device alias). Sources that
may be host memory written by another process are loaded with `.cv` ("fetch again"), so a line
cached by an earlier call is never reused. Offsets are element counts of the pointer's dtype; the
INT8 records (`plan.Int8Layout`) are passed twice, as int8 and as fp32 views of the same bytes.

Determinism: every sum runs over ranks 0..world-1 in order, in fp32, in one kernel whose code does
not depend on the rank (the rank is a runtime argument), so every rank's result is bitwise equal.

Rank-dependent integers are not specialized on (`do_not_specialize`): every rank runs the same
compiled kernel, compiled once per process rather than once per value class of the rank.

Progress: with TICK, program (0, 0) bumps a device counter and stores it to the rank's host-mapped
progress word; the watchdog reads that word to tell a slow collective from a stalled one.
No kernel here uses shared memory beyond Triton's reduction scratch (a few KB), far under Ada's 99 KB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

COPY_BLOCK = 4096
REDUCE_BLOCK = 2048
GROUPS_PER_PROGRAM = 16


@dataclass(frozen=True)
class MappedPtr:
    """A typed device-visible address (host memory registered with CUDA, or an offset into a tensor)."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address

    def offset(self, nbytes: int, dtype: torch.dtype | None = None) -> MappedPtr:
        return MappedPtr(self.address + nbytes, dtype or self.dtype)


def at(t: torch.Tensor, elem_offset: int = 0) -> MappedPtr:
    """Element `elem_offset` of tensor t, as a typed address."""
    return MappedPtr(t.data_ptr() + elem_offset * t.element_size(), t.dtype)


def i8(addr: int) -> MappedPtr:
    return MappedPtr(addr, torch.int8)


def f32(addr: int) -> MappedPtr:
    return MappedPtr(addr, torch.float32)


@triton.jit
def _tick(tick_dev, tick_host, TICK: tl.constexpr):
    if TICK:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            v = tl.load(tick_dev) + 1
            tl.store(tick_dev, v)
            tl.store(tick_host, v)


@triton.jit
def _progress_kernel(tick_dev, tick_host):
    _tick(tick_dev, tick_host, True)


@triton.jit(do_not_specialize=["skip", "rec0"])
def _copy_records_kernel(
    src, dst, n_valid, total, src_stride, dst_stride, skip, rec0, tick_dev, tick_host,
    TICK: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    rec = (tl.program_id(1) + rec0).to(tl.int64)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    dst_idx = rec * dst_stride + offs
    limit = tl.where(rec == skip, 0, n_valid)  # a skipped record copies nothing
    mask = (offs < limit) & (dst_idx < total)
    x = tl.load(src + rec * src_stride + offs, mask=mask, cache_modifier=".cv")
    tl.store(dst + dst_idx, x, mask=mask)
    _tick(tick_dev, tick_host, TICK)


@triton.jit(do_not_specialize=["rank", "world"])
def _reduce_kernel(
    peer, own, out, out2, numel, slot_stride, rank, world, tick_dev, tick_host,
    WRITE2: tl.constexpr, TICK: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    slot = peer  # walks the slots; pointer arithmetic is 64-bit whatever the stride's type
    for j in range(0, world):
        if j == rank:
            x = tl.load(own + offs, mask=mask, other=0.0)
        else:
            x = tl.load(slot + offs, mask=mask, other=0.0, cache_modifier=".cv")
        acc += x.to(tl.float32)
        slot += slot_stride
    y = acc.to(out.dtype.element_ty)
    tl.store(out + offs, y, mask=mask)
    if WRITE2:
        tl.store(out2 + offs, y, mask=mask)
    _tick(tick_dev, tick_host, TICK)


@triton.jit
def _quantize_groups(v, G: tl.constexpr):
    """Symmetric INT8 of each row of v [GPP, G] (fp32): (q int8, scale fp32 [GPP])."""
    amax = tl.max(tl.abs(v), axis=1)
    scale = amax / 127.0
    inv = tl.where(amax > 0.0, 127.0 / amax, 0.0)
    y = v * inv[:, None]
    q = (y + tl.where(y >= 0.0, 0.5, -0.5)).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -127), 127).to(tl.int8)
    return q, scale


@triton.jit
def _quantize_kernel(
    x, numel, rec8, rec32, dup8, dup32, chunk_elems, rec_stride, n_groups, tick_dev, tick_host,
    DUAL: tl.constexpr, TICK: tl.constexpr, G: tl.constexpr, GPP: tl.constexpr,
):
    g = tl.program_id(0) * GPP + tl.arange(0, GPP)
    gmask = g < n_groups
    cols = tl.arange(0, G)
    e = g.to(tl.int64)[:, None] * G + cols[None, :]
    v = tl.load(x + e, mask=gmask[:, None] & (e < numel), other=0.0).to(tl.float32)
    q, scale = _quantize_groups(v, G)
    gpc = chunk_elems // G
    c = g // gpc
    k = g - c * gpc
    base = c.to(tl.int64) * rec_stride
    qoff = base[:, None] + k.to(tl.int64)[:, None] * G + cols[None, :]
    soff = (base + chunk_elems) // 4 + k
    tl.store(rec8 + qoff, q, mask=gmask[:, None])
    tl.store(rec32 + soff, scale, mask=gmask)
    if DUAL:
        tl.store(dup8 + qoff, q, mask=gmask[:, None])
        tl.store(dup32 + soff, scale, mask=gmask)
    _tick(tick_dev, tick_host, TICK)


@triton.jit(do_not_specialize=["chunk_off", "rank", "world"])
def _dequant_reduce_kernel(
    peer8, peer32, own8, own32, out, res8, res32, dup8, dup32,
    n_valid, chunk_elems, slot_stride, chunk_off, rank, world, tick_dev, tick_host,
    REQUANT: tl.constexpr, DUAL: tl.constexpr, TICK: tl.constexpr, G: tl.constexpr,
    GPP: tl.constexpr,
):
    g = tl.program_id(0) * GPP + tl.arange(0, GPP)
    gmask = g < chunk_elems // G
    cols = tl.arange(0, G)
    e = g.to(tl.int64)[:, None] * G + cols[None, :]
    acc = tl.zeros([GPP, G], dtype=tl.float32)
    p8 = peer8 + chunk_off  # walk the slots' chunk records (64-bit pointer arithmetic)
    p32 = peer32 + (chunk_off + chunk_elems) // 4
    for j in range(0, world):
        if j == rank:
            q = tl.load(own8 + chunk_off + e, mask=gmask[:, None], other=0)
            s = tl.load(own32 + (chunk_off + chunk_elems) // 4 + g, mask=gmask, other=0.0)
        else:
            q = tl.load(p8 + e, mask=gmask[:, None], other=0, cache_modifier=".cv")
            s = tl.load(p32 + g, mask=gmask, other=0.0, cache_modifier=".cv")
        acc += q.to(tl.float32) * s[:, None]
        p8 += slot_stride
        p32 += slot_stride // 4
    if REQUANT:
        q2, s2 = _quantize_groups(acc, G)
        tl.store(res8 + e, q2, mask=gmask[:, None])
        tl.store(res32 + chunk_elems // 4 + g, s2, mask=gmask)
        if DUAL:
            tl.store(dup8 + e, q2, mask=gmask[:, None])
            tl.store(dup32 + chunk_elems // 4 + g, s2, mask=gmask)
        # what every other rank will decode from the record, so all ranks hold the same bits
        acc = q2.to(tl.float32) * s2[:, None]
    tl.store(out + e, acc.to(out.dtype.element_ty), mask=gmask[:, None] & (e < n_valid))
    _tick(tick_dev, tick_host, TICK)


@triton.jit(do_not_specialize=["skip", "rec0"])
def _dequant_records_kernel(
    src8, src32, out, n_valid, total, rec_stride, out_stride, chunk_elems, skip, rec0,
    tick_dev, tick_host, TICK: tl.constexpr, G: tl.constexpr, GPP: tl.constexpr,
):
    rec = (tl.program_id(1) + rec0).to(tl.int64)
    g = tl.program_id(0) * GPP + tl.arange(0, GPP)
    gmask = g < tl.where(rec == skip, 0, chunk_elems // G)  # a skipped record decodes nothing
    cols = tl.arange(0, G)
    e = g.to(tl.int64)[:, None] * G + cols[None, :]
    b = rec * rec_stride
    q = tl.load(src8 + b + e, mask=gmask[:, None], other=0, cache_modifier=".cv")
    s = tl.load(src32 + (b + chunk_elems) // 4 + g, mask=gmask, other=0.0, cache_modifier=".cv")
    x = q.to(tl.float32) * s[:, None]
    o = rec * out_stride + e
    tl.store(out + o, x.to(out.dtype.element_ty), mask=gmask[:, None] & (e < n_valid) & (o < total))
    _tick(tick_dev, tick_host, TICK)


# ---- launchers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """Where the per-call tick goes: a device int32 counter and the rank's host-mapped word."""

    device: torch.Tensor
    host: MappedPtr


def _tick_args(progress: Progress | None, tick: bool):
    if progress is None or not tick:
        return None, None, False
    return progress.device, progress.host, True


def bump_progress(progress: Progress) -> None:
    _progress_kernel[(1,)](progress.device, progress.host)


def copy_records(src, dst, *, n_valid, total, records=1, src_stride=0, dst_stride=0, skip=-1,
                 rec0=0, progress=None, tick=False):
    """dst[r*dst_stride + i] = src[r*src_stride + i] for records r (except `skip`), i < n_valid."""
    if n_valid <= 0 or records <= 0:
        if tick and progress is not None:
            bump_progress(progress)
        return
    td, th, t = _tick_args(progress, tick)
    grid = (triton.cdiv(n_valid, COPY_BLOCK), records)
    _copy_records_kernel[grid](src, dst, n_valid, total, src_stride, dst_stride, skip, rec0, td, th,
                               TICK=t, BLOCK=COPY_BLOCK, num_warps=8)


def reduce_slots(peer, own, out, *, numel, slot_stride, rank, world, out2=None, progress=None,
                 tick=False):
    """out = sum over ranks j in order of (own if j == rank else peer[j*slot_stride:]) in fp32."""
    if numel <= 0:
        if tick and progress is not None:
            bump_progress(progress)
        return
    td, th, t = _tick_args(progress, tick)
    grid = (triton.cdiv(numel, REDUCE_BLOCK),)
    _reduce_kernel[grid](peer, own, out, out2 if out2 is not None else out, numel, slot_stride, rank,
                         world, td, th, WRITE2=out2 is not None, TICK=t, BLOCK=REDUCE_BLOCK,
                         num_warps=8)


def quantize(x, numel, rec8, rec32, layout, *, dup8=None, dup32=None, progress=None, tick=False):
    """Write the INT8 records of the flat message x (all `layout.chunks` of them)."""
    td, th, t = _tick_args(progress, tick)
    n_groups = layout.chunks * layout.groups_per_chunk
    grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
    dual = dup8 is not None
    _quantize_kernel[grid](x, numel, rec8, rec32, dup8 if dual else rec8, dup32 if dual else rec32,
                           layout.chunk_elems, layout.record_bytes, n_groups, td, th, DUAL=dual,
                           TICK=t, G=layout.group, GPP=GROUPS_PER_PROGRAM, num_warps=4)


def dequant_reduce(peer8, peer32, own8, own32, out, layout, *, n_valid, slot_stride, chunk_off,
                   rank, world, res8=None, res32=None, dup8=None, dup32=None, progress=None,
                   tick=False):
    """out[:n_valid] = sum over ranks of the decoded chunk record at `chunk_off` of each slot; with
    res8/res32 the sum is re-encoded into a record there (and into dup8/dup32) and out holds the
    decoded re-encoding."""
    td, th, t = _tick_args(progress, tick)
    requant = res8 is not None
    dual = dup8 is not None
    grid = (triton.cdiv(layout.groups_per_chunk, GROUPS_PER_PROGRAM),)
    _dequant_reduce_kernel[grid](
        peer8, peer32, own8, own32, out, res8 if requant else own8, res32 if requant else own32,
        dup8 if dual else own8, dup32 if dual else own32, n_valid, layout.chunk_elems, slot_stride,
        chunk_off, rank, world, td, th, REQUANT=requant, DUAL=dual, TICK=t, G=layout.group,
        GPP=GROUPS_PER_PROGRAM, num_warps=4)


def dequant_records(src8, src32, out, layout, *, n_valid, total, records, rec_stride, out_stride,
                    skip=-1, rec0=0, progress=None, tick=False):
    """out[r*out_stride + i] = decode(record r)[i] for records r (except `skip`), i < n_valid."""
    if records <= 0:
        if tick and progress is not None:
            bump_progress(progress)
        return
    td, th, t = _tick_args(progress, tick)
    grid = (triton.cdiv(layout.groups_per_chunk, GROUPS_PER_PROGRAM), records)
    _dequant_records_kernel[grid](src8, src32, out, n_valid, total, rec_stride, out_stride,
                                  layout.chunk_elems, skip, rec0, td, th, TICK=t, G=layout.group,
                                  GPP=GROUPS_PER_PROGRAM, num_warps=4)
