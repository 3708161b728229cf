"""`HostStagedCommunicator`: all-reduce and all-gather between the TP processes of one node through
pinned host memory, CUDA-graph safe, with optional INT8 payloads.

Two kinds of synchronization, both replayable by a captured graph forever:
- Barrier paths (`datapath.py`): stream memory operations on pairwise flags. Each
  call is a fixed sequence of barriers (2, or 3 for two-shot). At barrier b rank r's stream writes
  1 into flag[b][r->j] for every peer j (after its earlier copies, with the driver's system-scope
  fence), waits until flag[b][j->r] == 1 for every peer, then writes 0 back into those incoming
  flags. Every value is a constant. The reset is safe although two parties write a flag, because
  the sender writes 1 again only after passing a later barrier that the receiver reached after its
  reset, and each stream's writes to host memory land in order; a call needs two barriers for that
  argument, and has them: B0 "everyone finished reading the previous call's slots", B1 "every slot
  holds this call's data" (+ B2 "every reduced chunk is published" for two-shot). A memory-op wait
  sits in the stream front end and uses no SM while it waits.
- The direct path (`direct.py`, small messages): kernels that write the payload, announce it with
  call epochs (never reset) and poll the peers' from device code; no barrier, at most one fence
  (a memory write of the rank's own fence word) per flag round.
Deadlines: neither kind of wait has one, so `watchdog.Watchdog` watches from the host and, when a
peer dies or stalls, records the error and releases the waits (see there).

The communicator owns the segment and its registration, the rank's `Staging` (addresses) and
`MemopSync` (prepared barriers), and picks each call's plan (`plan.plan_call` with its
`PathOptions`); the data paths see only those objects (`datapath.enqueue`). Messages larger than
`max_bytes` go in several calls (`call_plan.message_pieces`).
"""

from __future__ import annotations

import contextlib
import secrets
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace

from glmctl import switches
from glmctl.collectives import datapath, kernels
from glmctl.collectives.calibration import CollectivesCalibration, calibrate, load_calibration
from glmctl.collectives.call_plan import (
    DEFAULT_DIRECT_CAPACITY,
    DEFAULT_GROUP,
    DEFAULT_ONE_SHOT_MAX_BYTES,
    CollectivePlan,
    CopyEngines,
    DirectLimits,
    PathOptions,
    align_up,
    default_direct,
    message_pieces,
    plan_call,
    slot_capacity,
    use_int8,
)
from glmctl.collectives.collective_errors import CaptureMismatchError, CollectiveError, SegmentError
from glmctl.collectives.cuda_driver import MemOp, driver, memop_array
from glmctl.collectives.protocol import MemopSync
from glmctl.collectives.segment import (
    DIRECT_PROGRAMS,
    R_CAPTURE_COUNT,
    R_CAPTURE_DIGEST,
    R_STATE,
    STATE_CLOSED,
    W_ABORT,
    SharedSegment,
)
from glmctl.collectives.staging import DirectArea, Staging
from glmctl.collectives.watchdog import Watchdog

DEFAULT_TIMEOUT_S = 5.0


def default_timeout_s() -> float:
    timeout = switches.read("GLMCTL_COLLECTIVES_TIMEOUT_S")
    return DEFAULT_TIMEOUT_S if timeout is None else timeout


class PinnedSegment:
    """A segment mapped and registered once for ranks that are threads of one process (the thread
    rig): each rank's communicator takes `seg.view(rank)` instead of mapping and registering its
    own. The creator closes it after every communicator on it is closed."""

    def __init__(self, seg: SharedSegment, device_base: int) -> None:
        self.seg, self.device_base = seg, device_base


class HostStagedCommunicator:
    """One rank's end of a host-staged collective group (one process per GPU, one node).

    rank, world_size: this process's place in the TP group. group_id: a name the ranks agree on and
    no other running group uses (with `cpu_group`, a torch.distributed CPU/gloo group, rank 0 adds a
    random suffix and broadcasts it). max_bytes: the largest message of one call (all-reduce input,
    all-gather per-rank input) in bytes; larger ones go in several calls. It sizes the shared
    segment (about (world+1) x max_bytes of /dev/shm) and the device mirror (the same again in GPU
    memory). int8_min_bytes: all-reduces and all-gathers of at least this many bytes use INT8
    payloads unless the call says otherwise (None: only when asked). timeout_s: how long a wait may
    make no progress before the peer is declared stalled. on_error: called (from the watchdog
    thread) when the group breaks, e.g. to stop the process. direct: which small messages take
    the direct path (within `direct_capacity`; None: `plan.default_direct`, measured per rank
    count). pinned: ranks as threads of one process only.
    """

    def __init__(self, rank: int, world_size: int, group_id: str, max_bytes: int, *,
                 device=None, cpu_group=None, int8_min_bytes: int | None = None,
                 int8_group: int = DEFAULT_GROUP, one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES,
                 copy_engines: CopyEngines | None = None, timeout_s: float | None = None,
                 init_timeout_s: float = 120.0, direct: DirectLimits | None = None, direct_capacity: int = DEFAULT_DIRECT_CAPACITY,
                 pinned: PinnedSegment | None = None,
                 on_error: Callable[[CollectiveError], None] | None = None) -> None:
        import torch

        self.disabled = True  # until start-up completes, and after close()
        self.rank, self.world_size, self.max_bytes = rank, world_size, max_bytes
        self.int8_min_bytes = int8_min_bytes
        self.timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        self.calibration: CollectivesCalibration | None = None
        self._int8_override: list[bool | None] = []
        self._captured: list[tuple] = []
        self._closed = False
        self._watchdog: Watchdog | None = None
        self._registered = False
        self._owns_segment = pinned is None
        index = device if isinstance(device, int) or device is None else torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        torch.cuda.set_device(self.device)
        torch.zeros(1, device=self.device)  # the primary context is now current on this thread
        self._drv = driver()
        self._capacity = slot_capacity(max_bytes, world_size, int8_group)
        direct_capacity = align_up(direct_capacity, 4096)
        if pinned is not None:
            self._seg, hbase = pinned.seg.view(rank), pinned.device_base
        else:
            session = self._agree_session(group_id, cpu_group)
            if rank == 0:
                self._seg = SharedSegment.create(session, world_size, self._capacity, direct_capacity)
            else:
                self._seg = SharedSegment.attach(session, rank, world_size, self._capacity,
                                                 init_timeout_s, direct_capacity=direct_capacity)
        try:
            if pinned is None:
                self._drv.host_register(self._seg.address, self._seg.size)
                self._registered = True
                hbase = self._drv.device_pointer(self._seg.address)
            self._seg.host_barrier(init_timeout_s, "segment attach")
            if rank == 0 and pinned is None:
                self._seg.unlink()  # everyone holds a mapping: no name can outlive the group now
            self.staging = self._make_staging(hbase, direct_capacity)
            self.sync = self._make_sync(hbase)
            self._selftest_memops(hbase)
            engines = copy_engines or self._calibrated_engines(init_timeout_s)
            self.options = PathOptions(
                engines=engines, one_shot_max_bytes=one_shot_max_bytes,
                direct=replace(direct or default_direct(world_size), capacity=direct_capacity),
                int8_group=int8_group)
            self._seg.host_barrier(init_timeout_s, "start-up")
        except BaseException:
            self._teardown()
            raise
        self._watchdog = Watchdog(self._seg, self.timeout_s, on_error=on_error)
        self._watchdog.start()
        self.disabled = False

    @property
    def copy_engines(self) -> CopyEngines:
        return self.options.engines

    # ---- public API ---------------------------------------------------------------------------
    def all_reduce(self, tensor, *, out=None, int8: bool | None = None):
        """Sum `tensor` over the ranks; the result goes into `out`, or in place into `tensor` when
        it is contiguous (else into a new tensor). Returns the result."""
        x = self._check(tensor)
        if out is None:
            out = x
        elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise CollectiveError("all_reduce: `out` must be a contiguous tensor like the input")
        stream = self._stream()
        flat_x, flat_out = x.view(-1), out.view(-1)
        for lo, count in message_pieces(x.numel(), x.element_size(), self.max_bytes):
            xs, outs = flat_x[lo:lo + count], flat_out[lo:lo + count]
            plan = self.plan("all_reduce", xs, int8)
            self._note(plan)
            datapath.enqueue(plan, self.staging, self.sync, xs, outs, stream)
        return out

    def all_gather(self, tensor, dim: int = 0, *, int8: bool | None = None):
        """Concatenate every rank's `tensor` along `dim` (rank order), like torch.cat of all ranks."""
        import torch

        x = self._check(tensor)
        dim = dim + x.dim() if dim < 0 else dim
        n, stream = x.numel(), self._stream()
        stacked = torch.empty((self.world_size, n), dtype=x.dtype, device=x.device)
        pieces = message_pieces(n, x.element_size(), self.max_bytes)
        flat_x = x.view(-1)
        for lo, count in pieces:
            xs = flat_x[lo:lo + count]
            plan = self.plan("all_gather", xs, int8)
            self._note(plan)
            flat = stacked if len(pieces) == 1 else torch.empty(
                (self.world_size, count), dtype=x.dtype, device=x.device)
            datapath.enqueue(plan, self.staging, self.sync, xs, flat.view(-1), stream)
            if len(pieces) > 1:
                stacked[:, lo:lo + count].copy_(flat)
        stacked = stacked.view(self.world_size, *x.shape)
        if dim == 0:
            return stacked.view(self.world_size * x.shape[0], *x.shape[1:]) if x.dim() else stacked
        shape = list(x.shape)
        shape[dim] *= self.world_size
        return stacked.movedim(0, dim).reshape(shape)

    def plan(self, op: str, tensor, int8: bool | None = None) -> CollectivePlan:
        """The plan of one call of at most `max_bytes`."""
        nbytes = tensor.numel() * tensor.element_size()
        default = self._int8_override[-1] if self._int8_override else None
        want = use_int8(nbytes, int8 if int8 is not None else default, self.int8_min_bytes)
        plan = plan_call(op, tensor.numel(), tensor.element_size(), self.world_size, want,
                         self.options, self._capacity)
        if plan is None:
            raise CollectiveError(f"a {nbytes}-byte {op} exceeds this communicator's max_bytes "
                                  f"({self.max_bytes})", hint="create it with a larger max_bytes")
        return plan

    @contextlib.contextmanager
    def int8_payloads(self, enabled: bool | None) -> Iterator[None]:
        """Within the block, calls that do not pass `int8=` use this (None: the size threshold)."""
        self._int8_override.append(enabled)
        try:
            yield
        finally:
            self._int8_override.pop()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Wrap CUDA-graph capture. Nothing needs registering (every address is fixed at init); on
        exit the ranks check that they captured the same sequence of collectives."""
        start = len(self._captured)
        try:
            yield
        finally:
            self._verify_capture(self._captured[start:])

    def check(self) -> None:
        """Raise the group's error, if a peer was lost (also useful between graph replays)."""
        err = self._watchdog.error if self._watchdog is not None else None
        if err is not None:
            raise type(err)(err.message, err.hint, rank=err.rank)
        if self._closed:
            raise CollectiveError("this communicator is closed")

    def host_barrier(self, what: str, timeout_s: float = 60.0) -> None:
        """Wait on the host until every rank got here (tests and benchmarks between phases)."""
        self._seg.host_barrier(timeout_s, what)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.disabled = True
        import torch

        try:
            torch.cuda.synchronize(self.device)  # the watchdog still releases waits if aborted
        finally:
            self._teardown()

    # ---- internals ----------------------------------------------------------------------------
    def _check(self, tensor):
        import torch

        self.check()
        if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CollectiveError(f"host-staged collectives take bf16, fp16 or fp32, not {tensor.dtype}")
        if tensor.device != self.device:
            raise CollectiveError(f"tensor on {tensor.device}, communicator on {self.device}")
        if tensor.numel() == 0:
            raise CollectiveError("host-staged collectives need a non-empty tensor")
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def _stream(self) -> int:
        import torch

        return torch.cuda.current_stream(self.device).cuda_stream

    def _note(self, plan: CollectivePlan) -> None:
        import torch

        if torch.cuda.is_current_stream_capturing():
            self._captured.append(plan.key())

    def _make_staging(self, hbase: int, direct_capacity: int) -> Staging:
        import torch

        seg, r = self._seg, self.rank
        self._stage = torch.empty(seg.size - seg.data_offset, dtype=torch.uint8, device=self.device)
        tick_host = kernels.MappedPtr(hbase + seg.progress_offset(r), torch.int32)
        progress = kernels.Progress(torch.zeros(1, dtype=torch.int32, device=self.device), tick_host)
        area = DirectArea(
            ll_slots=hbase + seg.direct_offset, slots=hbase + seg.direct_native_offset,
            capacity=direct_capacity,
            flags=hbase + seg.direct_flag_offset(0, 0), abort=hbase + 4 * W_ABORT,
            status=hbase + seg.status_offset(r), epoch_word=hbase + seg.direct_epoch_offset(r),
            epochs=torch.zeros(DIRECT_PROGRAMS, dtype=torch.int32, device=self.device))
        return Staging(rank=r, world=self.world_size, capacity=self._capacity,
                       host=hbase + seg.data_offset, stage=self._stage.data_ptr(), progress=progress,
                       copy=self._drv.memcpy_async, direct=area)

    def _make_sync(self, hbase: int) -> MemopSync:
        seg = self._seg
        return MemopSync(self.rank, self.world_size,
                         lambda f, src, dst: hbase + seg.flag_offset(f, src, dst),
                         hbase + seg.status_offset(self.rank),
                         run=lambda stream, ops, arr: self._drv.run_memops(stream, ops, arr),
                         prepare=memop_array, fence_word=hbase + seg.fence_offset(self.rank))

    def _selftest_memops(self, hbase: int) -> None:
        """Write, wait and write again on a spare word; fall back from batched to single memory
        operations if the batch misbehaves, and fail loudly if neither works."""
        import time

        import torch

        off = self._seg.status_offset(self.rank) + 32
        addr = hbase + off
        ops = [MemOp("write", addr, 7), MemOp("wait", addr, 7), MemOp("write", addr, 9)]
        stream = torch.cuda.current_stream(self.device)
        for mode in dict.fromkeys((self._drv.memop_mode, "single")):
            self._seg.set_word_at(off, 0)
            self._drv.memop_mode = mode
            self._drv.run_memops(stream.cuda_stream, ops)
            done = torch.cuda.Event()
            done.record(stream)
            deadline = time.monotonic() + 5.0
            while not done.query():
                if time.monotonic() > deadline:
                    raise SegmentError(f"stream memory operations ({mode}) do not complete on "
                                       f"{torch.cuda.get_device_name(self.device)}",
                                       hint="this driver/VM does not support cuStreamWaitValue32")
                time.sleep(0.0005)
            if self._seg.word_at(off) == 9:
                return
        raise SegmentError("stream memory operations wrote wrong values to host memory")

    def _calibrated_engines(self, timeout_s: float) -> CopyEngines:
        import torch

        name = torch.cuda.get_device_name(self.device)
        cal = load_calibration(name)
        if cal is None and self.rank == 0:
            cal = calibrate(save=True)
        self._seg.host_barrier(timeout_s, "copy-engine calibration")
        cal = cal or load_calibration(name)
        self.calibration = cal
        return cal.engines() if cal is not None else CopyEngines()

    def _agree_session(self, group_id: str, cpu_group) -> str:
        if cpu_group is None:
            return group_id
        import torch.distributed as dist

        box = [f"{group_id}-{secrets.token_hex(4)}" if self.rank == 0 else None]
        src = dist.get_process_group_ranks(cpu_group)[0]
        dist.broadcast_object_list(box, src=src, group=cpu_group)
        return box[0]

    def _verify_capture(self, captured: list[tuple]) -> None:
        seg = self._seg
        digest = zlib.crc32(repr(captured).encode())
        seg.set_rank_word(self.rank, R_CAPTURE_COUNT, len(captured))
        seg.set_rank_word(self.rank, R_CAPTURE_DIGEST, digest)
        seg.host_barrier(max(self.timeout_s, 60.0), "the end of CUDA-graph capture")
        got = [(seg.rank_word(j, R_CAPTURE_COUNT), seg.rank_word(j, R_CAPTURE_DIGEST))
               for j in range(self.world_size)]
        bad = [j for j, g in enumerate(got) if g != got[self.rank]]
        if bad:
            raise CaptureMismatchError(
                f"rank {self.rank} captured {len(captured)} collectives, rank {bad[0]} captured "
                f"{got[bad[0]][0]} (or a different sequence); replaying would deadlock",
                hint="capture the same shapes in the same order on every rank", rank=bad[0])

    def _teardown(self) -> None:
        seg = getattr(self, "_seg", None)
        if seg is None:
            return
        if seg.words is not None:
            seg.set_rank_word(self.rank, R_STATE, STATE_CLOSED)
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._registered:
            try:
                self._drv.host_unregister(seg.address)
            except CollectiveError:
                pass
            self._registered = False
        if self.rank == 0 and self._owns_segment:
            seg.unlink()
        seg.close()
        self._stage = None
