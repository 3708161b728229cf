"""`HostStagedCommunicator`: all-reduce and all-gather between the TP processes of one node through
pinned host memory, CUDA-graph safe, with optional INT8 payloads.

Synchronization: stream memory operations on pairwise flags (chosen; why below). Each call is a
fixed sequence of barriers (2, or 3 for two-shot). At barrier b rank r's stream writes 1 into
flag[b][r->j] for every peer j (after its earlier copies, with the driver's system-scope fence),
waits until flag[b][j->r] == 1 for every peer, then writes 0 back into those incoming flags. Every
value is a constant, so a captured graph replays the same operations forever, with no epoch to keep
on the device and no second graph to alternate with. The reset is safe although two parties write a
flag (the sender 1, the receiver 0), because the protocol orders them: the sender writes 1 again
only after passing a later barrier that the receiver reached after its reset, and each stream's
writes to host memory land in order (fenced posted writes). A call needs at least two barriers for
that argument, and has them: B0 "everyone finished reading the previous call's slots" and B1 "every
slot holds this call's data" (+ B2 "every reduced chunk is published" for two-shot).

Why not the other options (`shared/reference/kernels-collectives.md` 2.3-2.4):
- Device epochs in a spinning kernel hold SMs while they wait. Several processes on one GPU (the
  test rig) time-slice the GPU, so a spinning kernel burns whole time slices waiting for a peer that
  cannot run; on a real node the spinner competes with compute. A memory-op wait sits in the stream
  front end and uses no SM.
- Alternating parity graphs double every captured graph and need the caller to alternate them.
Deadlines: a memory-op wait has none, so `watchdog.Watchdog` watches from the host and, when a peer
dies or stalls, records the error and releases the waits (see there).

Measured (1x H200, 2 and 4 processes sharing the GPU, bench/results/collectives-h200.md): batched
memory operations capture into graphs and 1,000 replays of a graph of five collectives gave correct,
bitwise-identical results on every rank; a SIGKILLed rank was named by the others at once and a
sleeping one after the timeout. Without MPS the GPU time-slices between the ranks' processes and a
call costs at least ~0.3 ms (2 ranks) / ~0.9 ms (4 ranks) whatever its size: the context switches
its barriers force, not the protocol (a spinning kernel would be worse there: it holds its time
slice while the peer it waits for cannot run). Large messages run at 0.9-1.0 of back-to-back
pinned-copy speed with the two copy directions of a call one after the other; `pipeline.py` now
overlaps them (per-piece flags, a second stream), not yet measured at the time of writing.

Data path (`plan.py` has the layouts): one-shot: copy own message into its host slot, B1, reduce all
slots in rank order in fp32 (reading peers from host memory, or from a device mirror after
copy-engine copies). Two-shot (3+ ranks, larger messages): B1, rank r reduces chunk r, publishes it
to the result area, B2, copies the other chunks. The copy engine or SM path is chosen per direction
and size band by `calibration.py`. Messages on the copy engine both ways are pipelined
(`pipeline.py`): pieces go out on a second stream while earlier pieces come back, each piece
announced by its own flag (the same single-writer constant writes, reset by the reader; a call
keeps B0, which orders a flag's reset before its next raise exactly as above).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import zlib
from collections.abc import Callable, Iterator

from glmctl.collectives import datapath, kernels, pipeline
from glmctl.collectives.calibration import CollectivesCalibration, calibrate, load_calibration
from glmctl.collectives.cuda_driver import MemOp, driver, memop_array
from glmctl.collectives.errors import CaptureMismatchError, CollectiveError, SegmentError
from glmctl.collectives.plan import (
    DEFAULT_GROUP,
    DEFAULT_ONE_SHOT_MAX_BYTES,
    MAX_PIECES,
    CollectivePlan,
    CopyEngines,
    fits,
    plan_all_gather,
    plan_all_reduce,
    slot_capacity,
    use_int8,
)
from glmctl.collectives.protocol import arrive_memops, await_memops, barrier_memops
from glmctl.collectives.segment import (
    BARRIERS,
    PIECE_FLAGS,
    R_CAPTURE_COUNT,
    R_CAPTURE_DIGEST,
    R_STATE,
    STATE_CLOSED,
    SharedSegment,
)
from glmctl.collectives.watchdog import Watchdog

DEFAULT_TIMEOUT_S = 5.0


def default_timeout_s() -> float:
    return float(os.environ.get("GLMCTL_COLLECTIVES_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def default_piece_bytes() -> int:
    """Pipelining piece size from GLMCTL_COLLECTIVES_PIECE_KIB (2048 = plan.DEFAULT_PIECE_BYTES);
    unset or 0: no pipelining, the default.

    Off by default because it has only been measured with ranks time-slicing one H200, where each
    piece's hand-off between processes pays a context switch: at 8 MiB it was 1.7x (2 ranks) and
    11x (4 ranks) slower than unpipelined, and 1,000 graph replays at 4 ranks took 81 s instead of
    9 s (bench/results/collectives-h200-pipelined.md vs collectives-h200.md). With one process per
    GPU (the product) that cost does not exist; turn it on there once bench/multigpu.sh has
    measured it on separate GPUs (issue 12).
    """
    raw = os.environ.get("GLMCTL_COLLECTIVES_PIECE_KIB", "").strip()
    return int(float(raw) * 1024) if raw else 0


class HostStagedCommunicator:
    """One rank's end of a host-staged collective group (one process per GPU, one node).

    rank, world_size: this process's place in the TP group. group_id: a name the ranks agree on and
    no other running group uses (with `cpu_group`, a torch.distributed CPU/gloo group, rank 0 adds a
    random suffix and broadcasts it). max_bytes: the largest message (all-reduce input, all-gather
    per-rank input) in bytes; sizes the shared segment (about (world+1) x max_bytes of /dev/shm) and
    the device mirror (the same again in GPU memory). int8_min_bytes: all-reduces and all-gathers of
    at least this many bytes use INT8 payloads unless the call says otherwise (None: only when asked).
    timeout_s: how long a wait may make no progress before the peer is declared stalled.
    on_error: called (from the watchdog thread) when the group breaks, e.g. to stop the process.
    piece_bytes: pipelined calls cut copy-engine messages into pieces of about this size (0: off).
    """

    def __init__(self, rank: int, world_size: int, group_id: str, max_bytes: int, *,
                 device=None, cpu_group=None, int8_min_bytes: int | None = None,
                 int8_group: int = DEFAULT_GROUP, one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES,
                 copy_engines: CopyEngines | None = None, timeout_s: float | None = None,
                 init_timeout_s: float = 120.0, piece_bytes: int | None = None,
                 on_error: Callable[[CollectiveError], None] | None = None) -> None:
        import torch

        self.disabled = True  # until start-up completes, and after close()
        self.rank, self.world_size, self.max_bytes = rank, world_size, max_bytes
        self.int8_min_bytes, self.int8_group = int8_min_bytes, int8_group
        self.one_shot_max_bytes = one_shot_max_bytes
        self.piece_bytes = default_piece_bytes() if piece_bytes is None else piece_bytes
        self._events: list[int] = []
        self.timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        self.calibration: CollectivesCalibration | None = None
        self._int8_override: list[bool | None] = []
        self._captured: list[tuple] = []
        self._closed = False
        self._watchdog: Watchdog | None = None
        self._registered = False
        index = device if isinstance(device, int) or device is None else torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        torch.cuda.set_device(self.device)
        torch.zeros(1, device=self.device)  # the primary context is now current on this thread
        self._drv = driver()
        self._capacity = slot_capacity(max_bytes, world_size, int8_group)
        session = self._agree_session(group_id, cpu_group)
        if rank == 0:
            self._seg = SharedSegment.create(session, world_size, self._capacity)
        else:
            self._seg = SharedSegment.attach(session, rank, world_size, self._capacity, init_timeout_s)
        try:
            self._drv.host_register(self._seg.address, self._seg.size)
            self._registered = True
            self._hbase = self._drv.device_pointer(self._seg.address)
            self._hdata = self._hbase + self._seg.data_offset
            self._seg.host_barrier(init_timeout_s, "segment attach")
            if rank == 0:
                self._seg.unlink()  # everyone holds a mapping: no name can outlive the group now
            self._stage = torch.empty(self._seg.size - self._seg.data_offset, dtype=torch.uint8,
                                      device=self.device)
            self._sdata = self._stage.data_ptr()
            tick_host = kernels.MappedPtr(self._hbase + self._seg.progress_offset(rank), torch.int32)
            self._progress = kernels.Progress(torch.zeros(1, dtype=torch.int32, device=self.device),
                                              tick_host)
            self._barriers = [self._barrier_ops(b) for b in range(BARRIERS)]
            self._arrivals, self._awaits = self._piece_ops()
            self._d2h = torch.cuda.Stream(self.device)  # the pipelined paths' device-to-host stream
            self.d2h_stream = self._d2h.cuda_stream
            self._events = [self._drv.event_create() for _ in range(pipeline.EV_PIECE0 + MAX_PIECES)]
            self._selftest_memops()
            self.copy_engines = copy_engines or self._calibrated_engines(init_timeout_s)
            self._seg.host_barrier(init_timeout_s, "start-up")
        except BaseException:
            self._teardown()
            raise
        self._watchdog = Watchdog(self._seg, self.timeout_s, on_error=on_error)
        self._watchdog.start()
        self.disabled = False

    # ---- public API ---------------------------------------------------------------------------
    def all_reduce(self, tensor, *, out=None, int8: bool | None = None):
        """Sum `tensor` over the ranks; the result goes into `out`, or in place into `tensor` when
        it is contiguous (else into a new tensor). Returns the result."""
        x = self._check(tensor)
        if out is None:
            out = x
        elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise CollectiveError("all_reduce: `out` must be a contiguous tensor like the input")
        plan = self.plan("all_reduce", x, int8)
        self._note(plan)
        stream = self._stream()
        if plan.pieces:
            if plan.int8:
                pipeline.all_reduce_int8(self, x, out, plan, stream)
            elif plan.algorithm == "two_shot":
                pipeline.all_reduce_two_shot(self, x, out, plan, stream)
            else:
                pipeline.all_reduce_one_shot(self, x, out, plan, stream)
        elif plan.int8:
            datapath.all_reduce_int8(self, x, out, plan, stream)
        elif plan.algorithm == "two_shot":
            datapath.all_reduce_two_shot(self, x, out, plan, stream)
        else:
            datapath.all_reduce_one_shot(self, x, out, plan, stream)
        return out

    def all_gather(self, tensor, dim: int = 0, *, int8: bool | None = None):
        """Concatenate every rank's `tensor` along `dim` (rank order), like torch.cat of all ranks."""
        import torch

        x = self._check(tensor)
        dim = dim + x.dim() if dim < 0 else dim
        plan = self.plan("all_gather", x, int8)
        self._note(plan)
        flat = torch.empty(self.world_size * x.numel(), dtype=x.dtype, device=x.device)
        path = pipeline if plan.pieces else datapath
        path.all_gather(self, x, flat, plan, self._stream())
        stacked = flat.view(self.world_size, *x.shape)
        if dim == 0:
            return stacked.view(self.world_size * x.shape[0], *x.shape[1:]) if x.dim() else stacked
        shape = list(x.shape)
        shape[dim] *= self.world_size
        return stacked.movedim(0, dim).reshape(shape)

    def plan(self, op: str, tensor, int8: bool | None = None) -> CollectivePlan:
        nbytes = tensor.numel() * tensor.element_size()
        default = self._int8_override[-1] if self._int8_override else None
        want = use_int8(nbytes, int8 if int8 is not None else default, self.int8_min_bytes)
        for piece_bytes in dict.fromkeys((self.piece_bytes, 0)):  # unpipelined if pieces overflow
            if op == "all_reduce":
                plan = plan_all_reduce(tensor.numel(), tensor.element_size(), self.world_size,
                                       int8=want, group=self.int8_group,
                                       one_shot_max_bytes=self.one_shot_max_bytes,
                                       engines=self.copy_engines, piece_bytes=piece_bytes)
            else:
                plan = plan_all_gather(tensor.numel(), tensor.element_size(), self.world_size,
                                       int8=want, group=self.int8_group, engines=self.copy_engines,
                                       piece_bytes=piece_bytes)
            if fits(plan, self._capacity):
                return plan
        raise CollectiveError(f"a {nbytes}-byte {op} exceeds this communicator's max_bytes "
                              f"({self.max_bytes})", hint="create it with a larger max_bytes")

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

    def barrier(self, b: int, stream: int) -> None:
        ops, arr = self._barriers[b]
        self._drv.run_memops(stream, ops, arr)

    def arrive(self, p: int, stream: int) -> None:
        """Raise piece flag p for every peer (after the copies enqueued on `stream` before it)."""
        ops, arr = self._arrivals[p]
        self._drv.run_memops(stream, ops, arr)

    def await_flag(self, p: int, stream: int) -> None:
        """Wait for piece flag p from every peer, and reset it."""
        ops, arr = self._awaits[p]
        self._drv.run_memops(stream, ops, arr)

    def event(self, i: int) -> int:
        return self._events[i]

    def _piece_ops(self):
        seg, h = self._seg, self._hbase

        def flag(f, src, dst):
            return h + seg.flag_offset(f, src, dst)

        status = h + seg.status_offset(self.rank)
        arrivals, awaits = [], []
        for p in range(PIECE_FLAGS):
            ops = arrive_memops(self.rank, self.world_size, BARRIERS + p, flag)
            arrivals.append((ops, memop_array(ops)))
            ops = await_memops(self.rank, self.world_size, BARRIERS + p, flag, status)
            awaits.append((ops, memop_array(ops)))
        return arrivals, awaits

    def _barrier_ops(self, b: int):
        seg, h = self._seg, self._hbase
        ops = barrier_memops(self.rank, self.world_size, b,
                             lambda bb, src, dst: h + seg.flag_offset(bb, src, dst),
                             h + seg.status_offset(self.rank))
        return ops, memop_array(ops)

    def _selftest_memops(self) -> None:
        """Write, wait and write again on a spare word; fall back from batched to single memory
        operations if the batch misbehaves, and fail loudly if neither works."""
        import time

        import torch

        off = self._seg.status_offset(self.rank) + 32
        addr = self._hbase + off
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
        for ev in self._events:
            try:
                self._drv.event_destroy(ev)
            except CollectiveError:
                pass
        self._events = []
        if self._registered:
            try:
                self._drv.host_unregister(seg.address)
            except CollectiveError:
                pass
            self._registered = False
        if self.rank == 0:
            seg.unlink()
        seg.close()
        self._stage = None
