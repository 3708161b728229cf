"""Which algorithm, payload and copy engines one collective uses, and the byte layout it writes.

Pure arithmetic (no torch): every rank computes the same plan from the same message size, which is
what keeps the ranks' barrier sequences identical.

Layouts, per call (all offsets in bytes, every region starts on a 256-byte boundary):

- **data area** of the shared segment: `world` slots, slot j at `j * slot_stride`. A slot holds
  rank j's whole message: the native elements, or INT8 records (below).
- **result area** (two-shot only): chunk c of the reduced message at `c * result_stride`; laid out
  exactly like the output, so the all-gather hop can copy contiguous runs straight into it.
- **INT8 record** (one per chunk; one-shot and all-gather use one chunk, two-shot uses `world`):
  `[chunk_elems x int8 | chunk_elems/group x fp32 scale | pad to 256]`. Element i of chunk c is
  element `c * chunk_elems + i` of the flat message; elements past the message are zero, and so is
  the scale of a group that holds none. Symmetric: `scale = amax / 127`, `q = round(x / scale)`
  (half away from zero), `x' = q * scale`.

The device keeps a mirror of the data and result areas (the "stage") with the same offsets, so a
kernel reads peers' slots from host memory (SM path) or from the stage after a copy-engine copy
(CE path) with the same arguments.

Direct plans (`direct_ll`, `direct_1s`, `direct_2s`; `direct.py`): slot j of parity q at
`(q * world + j) * slot_stride` of the direct area's LL or native region, `slot_stride` being that
area's fixed slot capacity. LL words (4 payload bytes + 4 epoch bytes each) start at offset 0 of an
LL slot; a native message at offset 0 of a native slot, and for `direct_2s` the reduced chunk
`chunk_span(j)` of rank j at `direct_result_offset(plan)` of its slot. An INT8 `direct_2s` slot
holds the message as `world` INT8 records (the layout above, `plan.layout`) at offset 0, and the
rank's reduced chunk as one more record at `direct_result_offset(plan)`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

ALIGN = 256
DEFAULT_GROUP = 128
GROUPS_ALLOWED = (32, 64, 128, 256)
DEFAULT_ONE_SHOT_MAX_BYTES = 256 * 1024
DEFAULT_BAND_BYTES = 1024 * 1024
SCALE_BYTES = 4
KiB = 1024

Engine = Literal["ce", "sm"]
Op = Literal["all_reduce", "all_gather"]
Algorithm = Literal["one_shot", "two_shot", "gather", "direct_ll", "direct_1s", "direct_2s"]
DIRECT_ALGORITHMS = ("direct_ll", "direct_1s", "direct_2s")


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CopyEngines:
    """Copy engine (`ce`, cuMemcpyAsync) or SM copies (`sm`, kernels that load/store mapped host
    memory) for each direction, for messages up to `band_bytes` ("small") and above ("large")."""

    d2h_small: Engine = "ce"
    d2h_large: Engine = "ce"
    h2d_small: Engine = "sm"
    h2d_large: Engine = "ce"
    band_bytes: int = DEFAULT_BAND_BYTES

    @classmethod
    def uniform(cls, engine: Engine) -> CopyEngines:
        return cls(engine, engine, engine, engine)

    def d2h(self, nbytes: int) -> Engine:
        return self.d2h_small if nbytes <= self.band_bytes else self.d2h_large

    def h2d(self, nbytes: int) -> Engine:
        return self.h2d_small if nbytes <= self.band_bytes else self.h2d_large


@dataclass(frozen=True)
class DirectLimits:
    """Which small messages take the direct path (`direct.py`: kernels that poll their peers'
    flags themselves, no barrier memory operations), the first that applies: LL words (one shot,
    the epoch in every word: no fence, twice the bytes) up to `ll_max_bytes`; the native payload
    read in one shot behind one fence up to `one_shot_max_bytes`; the native payload reduce-
    scattered and all-gathered (two shots, two fences; all-reduce only, a gather takes one shot)
    up to `two_shot_max_bytes`. Each within `capacity`, the direct area's slot (LL needs twice the
    message; two shots the message and the reduced chunk). 0: never."""

    ll_max_bytes: int = 0
    one_shot_max_bytes: int = 0
    two_shot_max_bytes: int = 0
    capacity: int = 0

    @property
    def max_bytes(self) -> int:
        """The largest message any direct path takes."""
        return max(self.ll_max_bytes, self.one_shot_max_bytes, self.two_shot_max_bytes)

    def int8_algorithm(self, op: Op, numel: int, elem_bytes: int, world: int,
                       group: int = DEFAULT_GROUP) -> Algorithm | None:
        """A small all-reduce sent as INT8 always takes two shots: each element crosses once each
        way as a record (~0.52 of bf16's bytes); LL words carry a 4-byte epoch each (little left
        to save) and one shot reads n - 1 whole messages. Within the direct path's reach
        (`max_bytes`), when the records and the reduced chunk's record fit one slot."""
        layout = int8_layout(numel, world, group)
        fit = align_up(layout.total_bytes) + layout.record_bytes <= self.capacity
        ok = op == "all_reduce" and numel * elem_bytes <= self.max_bytes and fit
        return "direct_2s" if ok else None

    def algorithm(self, op: Op, numel: int, elem_bytes: int, world: int) -> Algorithm | None:
        nbytes = numel * elem_bytes
        if nbytes <= self.ll_max_bytes and 2 * align_up(nbytes, 4) <= self.capacity:
            return "direct_ll"
        if nbytes <= self.one_shot_max_bytes and nbytes <= self.capacity:
            return "direct_1s"
        if nbytes <= self.two_shot_max_bytes:
            if op == "all_gather":
                return "direct_1s" if nbytes <= self.capacity else None
            chunk = direct_chunk_elems(numel, world) * elem_bytes
            if align_up(nbytes) + chunk <= self.capacity:
                return "direct_2s"
        return None


def direct_chunk_elems(numel: int, world: int) -> int:
    """Elements per rank chunk of a `direct_2s` call: a multiple of 8, so that every chunk starts
    16-byte aligned; the last chunks may be shorter or empty."""
    return align_up(cdiv(numel, world), 8)


DEFAULT_DIRECT_CAPACITY = 512 * KiB  # bytes per direct-path slot (LL and native regions each)
# The direct path by rank count: LL words only, as measured. On the thread rig (one H200, ranks as
# threads of one process, captured graphs, 2026-12-01; bench/results/collectives-h200.md) LL words
# were the fastest of today's paths at every size measured up to 128 KiB at 2 and 4 ranks, and at 8
# ranks up to 128 KiB as well once that run's flag-line path (which the planner no longer has) is
# set aside; bound by their bytes from 32 KiB (at 4 ranks 2 MiB cross the rig's one link per 64 KiB).
# The native one- and two-shot paths (a fence and one or two flag rounds for a half or a third of
# LL's bytes) are predicted faster above a few KiB by `cost_model`, but on their first GPU run
# (the rig on an H100, 2026-12-06, bench/results/quick-round-h100-2026-12-06.json) they took
# 257 us (2 ranks, 32 KiB) to 5.9 ms (8 ranks, 64 KiB) per call where LL took 5-40 us: they stay
# off by default (0) until that is understood; `DirectLimits` still names them for the rig's
# variants. `tests/unit/test_collectives_defaults.py` holds these limits to the rig's record.
DIRECT_BY_WORLD = {
    2: DirectLimits(ll_max_bytes=128 * KiB),
    4: DirectLimits(ll_max_bytes=128 * KiB),
    8: DirectLimits(ll_max_bytes=128 * KiB),
}
# The native shots where the fitted cost model *predicts* them fastest at 8 ranks on the node's
# links (LL words to 4 KiB, one shot to 8 KiB, two shots to 384 KiB: the 2026-12-05 defaults), for
# pricing what they would give (`plan.prediction.decode_collectives`' levers); no plan takes them.
PREDICTED_SHOTS_8 = DirectLimits(ll_max_bytes=4 * KiB, one_shot_max_bytes=8 * KiB,
                                 two_shot_max_bytes=384 * KiB, capacity=DEFAULT_DIRECT_CAPACITY)


def default_direct(world: int, capacity: int = DEFAULT_DIRECT_CAPACITY) -> DirectLimits:
    """The measured direct-path limits for `world` ranks (those of the smallest measured rank
    count at or above it; of the largest beyond them), within a direct area of `capacity`."""
    measured = min((n for n in DIRECT_BY_WORLD if n >= world), default=max(DIRECT_BY_WORLD))
    return replace(DIRECT_BY_WORLD[measured], capacity=capacity)


@dataclass(frozen=True)
class Int8Layout:
    group: int
    chunks: int
    chunk_elems: int  # elements per chunk record, a multiple of `group`
    record_bytes: int  # stride between chunk records

    @property
    def groups_per_chunk(self) -> int:
        return self.chunk_elems // self.group

    @property
    def scales_offset(self) -> int:
        """Byte offset of the fp32 scales inside a record."""
        return self.chunk_elems

    @property
    def total_bytes(self) -> int:
        return self.chunks * self.record_bytes


def int8_layout(numel: int, chunks: int, group: int = DEFAULT_GROUP) -> Int8Layout:
    if group not in GROUPS_ALLOWED:
        raise ValueError(f"INT8 group size must be one of {GROUPS_ALLOWED}, not {group}")
    per_chunk = cdiv(max(numel, 1), chunks)
    chunk_elems = max(group, align_up(per_chunk, group))
    record = align_up(chunk_elems + SCALE_BYTES * (chunk_elems // group))
    return Int8Layout(group=group, chunks=chunks, chunk_elems=chunk_elems, record_bytes=record)


@dataclass(frozen=True)
class CollectivePlan:
    op: Op
    algorithm: Algorithm
    int8: bool
    world: int
    numel: int  # elements of one rank's input
    elem_bytes: int
    slot_stride: int  # bytes between rank slots in the data area
    chunk_elems: int  # two-shot: elements per chunk; otherwise numel
    result_stride: int  # two-shot: bytes between chunks in the result area; otherwise 0
    layout: Int8Layout | None
    d2h: Engine
    h2d: Engine

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem_bytes

    @property
    def barriers(self) -> int:
        return 0 if self.algorithm in DIRECT_ALGORITHMS else 3 if self.algorithm == "two_shot" else 2

    @property
    def result_bytes(self) -> int:
        if self.algorithm != "two_shot":
            return 0
        if self.layout is not None:
            return self.layout.total_bytes
        return self.world * self.result_stride

    def chunk_span(self, c: int) -> tuple[int, int]:
        """First element and element count of chunk c of the output (the count may be 0)."""
        lo = c * self.chunk_elems
        return lo, max(0, min(self.chunk_elems, self.numel - lo))

    def bytes_moved(self) -> tuple[int, int]:
        """(device-to-host, host-to-device) bytes rank 0 moves over its link in this call."""
        n = self.world
        if self.algorithm in ("direct_ll", "direct_1s"):
            wire = 2 * align_up(self.nbytes, 4) if self.algorithm == "direct_ll" else self.nbytes
            return wire, (n - 1) * wire
        if self.algorithm == "direct_2s" and self.layout is not None:
            rec = self.layout.record_bytes  # out: the others' chunk records, the own sum's
            return n * rec, 2 * (n - 1) * rec
        if self.algorithm == "direct_2s":  # out: the others' chunks, then the own reduced one
            own = self.chunk_span(0)[1] * self.elem_bytes
            return self.nbytes, (n - 1) * own + (self.nbytes - own)
        if self.layout is not None:
            rec = self.layout.record_bytes
            if self.algorithm == "two_shot":
                return n * rec + rec, 2 * (n - 1) * rec
            return self.layout.total_bytes, (n - 1) * self.layout.total_bytes
        if self.algorithm == "two_shot":
            own = self.chunk_span(0)[1] * self.elem_bytes
            return self.nbytes + own, (n - 1) * own + (self.nbytes - own)
        return self.nbytes, (n - 1) * self.nbytes

    def key(self) -> tuple:
        """What must match across ranks for their flag sequences to line up."""
        return (self.op, self.algorithm, self.int8, self.numel, self.elem_bytes)


def plan_all_reduce(
    numel: int,
    elem_bytes: int,
    world: int,
    *,
    int8: bool = False,
    group: int = DEFAULT_GROUP,
    one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES,
    engines: CopyEngines = CopyEngines(),
    direct: DirectLimits = DirectLimits(),
) -> CollectivePlan:
    """The direct path for messages within `direct`'s limits (INT8: always its two shots,
    `DirectLimits.int8_algorithm`); else one-shot (every rank reads every slot and reduces all of
    it) while the message is small or there are only two ranks (two-shot moves the same bytes
    then, with one more barrier); above that, reduce-scatter + all-gather, which reads 2(n-1)/n
    of the message instead of n-1."""
    nbytes = numel * elem_bytes
    small = (direct.int8_algorithm("all_reduce", numel, elem_bytes, world, group) if int8 else
             direct.algorithm("all_reduce", numel, elem_bytes, world))
    if small is not None:
        return _direct_plan("all_reduce", small, numel, elem_bytes, world, direct.capacity,
                            int8_layout(numel, world, group) if int8 else None)
    two_shot = world > 2 and nbytes > one_shot_max_bytes
    chunks = world if two_shot else 1
    if int8:
        layout = int8_layout(numel, chunks, group)
        slot = align_up(layout.total_bytes)
        chunk = layout.chunk_elems if two_shot else numel
        result = layout.record_bytes if two_shot else 0
    else:
        layout = None
        slot = align_up(nbytes)
        # chunks of a multiple of 128 elements keep every chunk 256-byte aligned
        chunk = align_up(cdiv(numel, world), 128) if two_shot else numel
        result = chunk * elem_bytes if two_shot else 0
    payload = layout.total_bytes if layout else nbytes
    return CollectivePlan(
        op="all_reduce",
        algorithm="two_shot" if two_shot else "one_shot",
        int8=int8,
        world=world,
        numel=numel,
        elem_bytes=elem_bytes,
        slot_stride=slot,
        chunk_elems=chunk,
        result_stride=result,
        layout=layout,
        d2h=engines.d2h(payload),
        h2d=engines.h2d(payload * (world - 1)),
    )


def plan_all_gather(
    numel: int,
    elem_bytes: int,
    world: int,
    *,
    int8: bool = False,
    group: int = DEFAULT_GROUP,
    engines: CopyEngines = CopyEngines(),
    direct: DirectLimits = DirectLimits(),
) -> CollectivePlan:
    small = None if int8 else direct.algorithm("all_gather", numel, elem_bytes, world)
    if small is not None:
        return _direct_plan("all_gather", small, numel, elem_bytes, world, direct.capacity)
    layout = int8_layout(numel, 1, group) if int8 else None
    payload = layout.total_bytes if layout else numel * elem_bytes
    return CollectivePlan(
        op="all_gather",
        algorithm="gather",
        int8=int8,
        world=world,
        numel=numel,
        elem_bytes=elem_bytes,
        slot_stride=align_up(payload),
        chunk_elems=numel,
        result_stride=0,
        layout=layout,
        d2h=engines.d2h(payload),
        h2d=engines.h2d(payload * (world - 1)),
    )


def _direct_plan(op: Op, algorithm: Algorithm, numel: int, elem_bytes: int, world: int,
                 capacity: int, layout: Int8Layout | None = None) -> CollectivePlan:
    """`layout`: INT8 records (`direct_2s` only), whose chunks the call's are."""
    chunk = direct_chunk_elems(numel, world) if algorithm == "direct_2s" else numel
    return CollectivePlan(op=op, algorithm=algorithm, int8=layout is not None, world=world,
                          numel=numel, elem_bytes=elem_bytes, slot_stride=capacity,
                          chunk_elems=layout.chunk_elems if layout else chunk, result_stride=0,
                          layout=layout, d2h="sm", h2d="sm")


def direct_result_offset(plan: CollectivePlan) -> int:
    """Byte offset of the reduced chunk in a `direct_2s` slot: after the message (native, or its
    INT8 records), aligned."""
    if plan.layout is not None:
        return align_up(plan.layout.total_bytes)
    return align_up(plan.nbytes)


def slot_capacity(max_bytes: int, world: int, group: int = DEFAULT_GROUP) -> int:
    """Bytes per rank slot (and for the result area) that fit every plan of a message of up to
    `max_bytes`: native payloads are the message itself; INT8 records of 2-byte elements are about
    half of it plus padding of at most one group and 256 bytes per chunk."""
    pad = world * (2 * ALIGN + 4 * group + 2 * SCALE_BYTES)
    return align_up(max_bytes + pad, 4096)


def fits(plan: CollectivePlan, capacity: int) -> bool:
    if plan.algorithm in DIRECT_ALGORITHMS:
        return True  # planned within the direct area's own capacity
    return plan.slot_stride <= capacity and plan.result_bytes <= capacity


@dataclass(frozen=True)
class PathOptions:
    """A communicator's choices of data path, the same on every rank (they decide the flag
    sequences): copy engines, the one-shot/two-shot switch, the direct path (None: the measured
    `default_direct` for the call's rank count)."""

    engines: CopyEngines = CopyEngines()
    one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES
    direct: DirectLimits | None = None
    int8_group: int = DEFAULT_GROUP


def plan_call(op: Op, numel: int, elem_bytes: int, world: int, int8: bool, options: PathOptions,
              capacity: int) -> CollectivePlan | None:
    """The plan of one call that fits slots of `capacity` bytes, or None when the message is too
    large for them."""
    kw = dict(int8=int8, group=options.int8_group, engines=options.engines,
              direct=options.direct or default_direct(world))
    if op == "all_reduce":
        plan = plan_all_reduce(numel, elem_bytes, world,
                               one_shot_max_bytes=options.one_shot_max_bytes, **kw)
    else:
        plan = plan_all_gather(numel, elem_bytes, world, **kw)
    return plan if fits(plan, capacity) else None


def message_pieces(numel: int, elem_bytes: int, max_bytes: int) -> list[tuple[int, int]]:
    """(first element, count) of the calls a message of `numel` elements goes in when it exceeds
    a communicator's `max_bytes`: pieces of the largest multiple of 128 elements (so each starts
    on a 256-byte boundary) that fits, the last one shorter. The same on every rank."""
    step = max(128, (max_bytes // elem_bytes) // 128 * 128)
    return [(lo, min(step, numel - lo)) for lo in range(0, numel, step)]


def use_int8(nbytes: int, requested: bool | None, min_bytes: int | None) -> bool:
    """The payload rule: an explicit request wins; otherwise INT8 only at or above the threshold
    (prefill-size messages), and never when no threshold is configured."""
    if requested is not None:
        return requested
    return min_bytes is not None and nbytes >= min_bytes
