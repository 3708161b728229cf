"""The real data paths (`datapath.py`, the direct `direct.py`), flag protocol and kernels, run end
to end on CPU: threads as ranks share a real segment. Each rank has a "stream", a worker thread
executing what the data path enqueued on it, in order: copies (memmove), stream memory operations
(a wait spins on the word; a write, the fence included, stores it) and kernel launches (the Triton
interpreter on CPU views of the same memory, one launch at a time: the interpreter is not
thread-safe; a direct-path kernel that waits runs as its announce half, a wait for the peers'
epochs, and its collect half). Random small delays before
operations vary the interleaving, so an ordering the code forgets shows up as wrong data. Every rank enqueues each case twice back to back (two calls in flight: a slot reused too
early shows up), then checks both against plain torch, and that the ranks agree bit for bit."""

from __future__ import annotations

import ctypes
import queue
import random
import threading
import time

import numpy as np
import pytest

from tests.unit import collectives_interp

torch = pytest.importorskip("torch")

_MODULES = collectives_interp.load()
_PRELOADED = _MODULES is None
kernels, direct_kernels, direct_int8_kernels, direct, datapath = _MODULES or (None,) * 5

from glmctl.collectives.call_plan import (  # noqa: E402
    CopyEngines,
    DirectLimits,
    plan_all_gather,
    plan_all_reduce,
    slot_capacity,
)
from glmctl.collectives.protocol import MemopSync  # noqa: E402
from glmctl.collectives.segment import DIRECT_PROGRAMS, W_ABORT, SharedSegment  # noqa: E402
from glmctl.collectives.staging import DirectArea, Staging  # noqa: E402
from tests.int8_codec_ref import (  # noqa: E402
    all_reduce_int8_ref,
    direct_two_shot_int8_ref,
    int8_round_trip_ref,
)

interpreted = pytest.mark.skipif(_PRELOADED, reason="triton was imported before: test_fresh_process")
MAX_BYTES = 64 * 1024
MAIN = 1  # the stream handle: the caller's stream
_LAUNCH = threading.Lock()


@pytest.mark.skipif(not _PRELOADED, reason="ran in this process")
def test_fresh_process():
    collectives_interp.rerun_fresh(__file__)


class SimStream:
    """A worker thread running enqueued operations in order, with random small delays (`slow`:
    more and longer ones, so one rank lags the others)."""

    def __init__(self, name: str, seed: int, slow: bool = False):
        self.q: queue.Queue = queue.Queue()
        self.rng = random.Random(seed)
        self.chance, self.longest = (0.5, 0.006) if slow else (0.3, 0.002)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, fn) -> None:
        self.q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self.q.get()
            try:
                if fn is None:
                    return
                if self.error is None:
                    if self.rng.random() < self.chance:
                        time.sleep(self.rng.random() * self.longest)
                    fn()
            except BaseException as exc:  # noqa: BLE001 - reported by synchronize()
                self.error = exc
            finally:
                self.q.task_done()


_ABORT = threading.Event()  # a rank failed: spinning waits give up, so nothing touches freed memory


def _spin(cond, what: str) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        time.sleep(0)  # let the other threads run
        if time.monotonic() > deadline or _ABORT.is_set():
            raise TimeoutError(what)


class SimDriver:
    """The driver calls the data paths make, as operations on the rank's simulated stream."""

    def __init__(self, rank: int):
        self.streams = {MAIN: SimStream(f"r{rank}-main", 7 * rank + 1, slow=rank == 0)}

    def memcpy_async(self, dst, src, nbytes, stream):
        if nbytes > 0:
            self.streams[stream].put(lambda: ctypes.memmove(dst, src, nbytes))

    def run_memops(self, stream, ops, batch=None):
        for op in ops:
            word = ctypes.c_uint32.from_address(op.address)
            if op.kind == "write":
                self.streams[stream].put(lambda w=word, v=op.value: setattr(w, "value", v))
            else:
                self.streams[stream].put(lambda w=word, v=op.value: _spin(
                    lambda: w.value == v, f"wait for {v} never satisfied"))

    def synchronize(self):
        for s in self.streams.values():
            s.q.join()
            if s.error is not None:
                raise s.error

    def stop(self):
        for s in self.streams.values():
            s.put(None)
        for s in self.streams.values():
            s.thread.join(timeout=70)


class Regions:
    """Turn MappedPtr addresses back into CPU tensors the interpreter can read and write."""

    def __init__(self):
        self.spans: list[tuple[int, int]] = []

    def add(self, start: int, nbytes: int):
        with _LAUNCH:
            self.spans.insert(0, (start, start + nbytes))  # newest first: freed memory gets reused

    def tensor(self, p):
        for lo, hi in self.spans:
            if lo <= p.address < hi:
                buf = (ctypes.c_char * (hi - p.address)).from_address(p.address)
                n = (hi - p.address) // torch.empty(0, dtype=p.dtype).element_size()
                return torch.frombuffer(buf, dtype=p.dtype, count=n) if n else torch.empty(0, dtype=p.dtype)
        return torch.empty(0, dtype=p.dtype)  # past the end of a tensor: a launcher given no work


class SimComm:
    """One rank: the objects a data path takes (`Staging`, `MemopSync`), built on the simulated
    driver exactly as the communicator builds them on the real one."""

    def __init__(self, seg: SharedSegment, rank: int, regions: Regions):
        self.rank, self.world = rank, seg.world
        self.drv = SimDriver(rank)
        self._stage_t = torch.zeros(seg.size - seg.data_offset, dtype=torch.uint8)
        regions.add(seg.address, seg.size)
        regions.add(self._stage_t.data_ptr(), self._stage_t.numel())
        self.progress_t = torch.zeros(1, dtype=torch.int32)
        a = seg.address
        progress = kernels.Progress(self.progress_t,
                                    kernels.MappedPtr(a + seg.progress_offset(rank), torch.int32))
        area = DirectArea(ll_slots=a + seg.direct_offset, slots=a + seg.direct_native_offset,
                          capacity=seg.direct_capacity,
                          flags=a + seg.direct_flag_offset(0, 0), abort=a + 4 * W_ABORT,
                          status=a + seg.status_offset(rank),
                          epoch_word=a + seg.direct_epoch_offset(rank),
                          epochs=torch.zeros(DIRECT_PROGRAMS, dtype=torch.int32))
        self.staging = Staging(rank=rank, world=seg.world, capacity=seg.capacity,
                               host=a + seg.data_offset, stage=self._stage_t.data_ptr(),
                               progress=progress, copy=self.drv.memcpy_async, direct=area)
        self.sync = MemopSync(rank, seg.world, lambda f, s, d: a + seg.flag_offset(f, s, d),
                              a + seg.status_offset(rank),
                              run=lambda stream, ops, prepared: self.drv.run_memops(stream, ops),
                              fence_word=a + seg.fence_offset(rank))


def _words(addr: int, n: int, dtype) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(addr), dtype)


def _peers_ll_published(area: DirectArea, rank: int, world: int, e: int, units: int) -> bool:
    """What an LL kernel's collect half waits for: every peer's words of the call carry epoch e."""
    q = e & 1
    return all((_words(area.ll_slots + (q * world + j) * area.capacity, 2 * units,
                       np.uint32)[1::2] == e).all() for j in range(world) if j != rank)


def _peers_announced(area: DirectArea, rank: int, world: int, e: int, round_: int) -> bool:
    """What a collect kernel's second half waits for: every peer's word of the round's line."""
    line = _words(area.flags + (round_ * world + rank) * 64, world, np.int32)
    return all(int(line[j]) >= e for j in range(world) if j != rank)


def _wrap_launchers(regions: Regions, comms: dict):
    """Kernel launches go onto the launching rank's main stream (the data paths launch every
    kernel on the caller's stream), converted to CPU tensors when they run."""
    def conv(v):
        return regions.tensor(v) if isinstance(v, kernels.MappedPtr) else v

    def conv_progress(p):
        return kernels.Progress(p.device, regions.tensor(p.host)) if p is not None else None

    saved = {}
    for name in ("copy_records", "reduce_slots", "quantize", "dequant_reduce", "dequant_records",
                 "bump_progress"):
        fn = saved[name] = getattr(kernels, name)

        def wrapped(*args, _fn=fn, **kw):
            def launch():
                with _LAUNCH:
                    a = [conv_progress(x) if isinstance(x, kernels.Progress) else conv(x) for x in args]
                    k = {n: conv_progress(v) if n == "progress" else conv(v) for n, v in kw.items()}
                    _fn(*a, **k)

            comms[threading.current_thread().name].drv.streams[MAIN].put(launch)

        setattr(kernels, name, wrapped)

    saved_direct = {name: getattr(direct_kernels, name) for name in ("ll", "publish", "collect")}
    saved_int8 = {name: getattr(direct_int8_kernels, name) for name in ("publish", "collect")}
    on_stream = lambda fn: comms[threading.current_thread().name].drv.streams[MAIN].put(fn)  # noqa: E731

    def split(kernel, make_args, ready):
        """A waiting kernel as its first half, a wait outside the interpreter, its second half."""
        def launch(x, out, area, **kw):
            def run():
                e = int(area.epochs[0]) + 1
                for phase in (1, 2):
                    with _LAUNCH:
                        args, meta = make_args(x, out, area, phase=phase, **kw)
                        kernel[(DIRECT_PROGRAMS,)](*[conv(v) for v in args], **meta)
                    if phase == 1:
                        _spin(lambda: ready(x, area, kw, e), "direct-path epochs never arrived")

            on_stream(run)
        return launch

    def publisher(kernel, make_args):
        def publish(x, area, **kw):
            def run():
                with _LAUNCH:
                    args, meta = make_args(x, area, **kw)
                    kernel[(DIRECT_PROGRAMS,)](*[conv(v) for v in args], **meta)

            on_stream(run)
        return publish

    announced = lambda x, area, kw, e: _peers_announced(area, kw["rank"], kw["world"], e,  # noqa: E731
                                                        kw["round_"])

    direct_kernels.ll = split(direct_kernels._ll_kernel, direct_kernels.ll_args, lambda x, area, kw, e: (
        _peers_ll_published(area, kw["rank"], kw["world"], e,
                            direct_kernels.ll_units(kw["numel"], x.element_size()))))
    direct_kernels.collect = split(direct_kernels._collect_kernel, direct_kernels.collect_args,
                                   announced)
    direct_kernels.publish = publisher(direct_kernels._publish_kernel, direct_kernels.publish_args)
    direct_int8_kernels.collect = split(direct_int8_kernels._collect_int8_kernel,
                                        direct_int8_kernels.collect_args, announced)
    direct_int8_kernels.publish = publisher(direct_int8_kernels._publish_int8_kernel,
                                            direct_int8_kernels.publish_args)

    def restore():
        for name, fn in saved.items():
            setattr(kernels, name, fn)
        for name, fn in saved_direct.items():
            setattr(direct_kernels, name, fn)
        for name, fn in saved_int8.items():
            setattr(direct_int8_kernels, name, fn)

    return restore


DIRECT_CAP = 16 * 1024
DIRECT = {"ll": "direct_ll", "1s": "direct_1s", "2s": "direct_2s"}


def _cases(world):
    """(op, dtype, numel, int8, engines, one_shot_max_bytes); engines "ll", "1s", "2s" mean the
    direct path that way (`DIRECT`)."""
    cases = [  # the direct path, first and between the others (its areas are its own)
        ("all_reduce", torch.bfloat16, 3001, False, "ll", 0),
        ("all_reduce", torch.float32, 777, False, "1s", 0),
        ("all_reduce", torch.bfloat16, 5003, False, "2s", 0),
        ("all_gather", torch.bfloat16, 1001, False, "ll", 0),
        ("all_gather", torch.float32, 5, False, "1s", 0),
        ("all_reduce", torch.float16, 5, False, "2s", 0),  # chunks past the message
        ("all_reduce", torch.bfloat16, 5003, True, "2s", 0),  # INT8 records, same slots
        ("all_reduce", torch.float16, 5, True, "2s", 0),  # INT8, chunks past the message
    ]
    for eng in ("ce", "sm"):
        cases += [
            ("all_reduce", torch.float32, 3001, False, eng, 1 << 30),
            ("all_reduce", torch.bfloat16, 2500, True, eng, 1 << 30),
            ("all_gather", torch.float16, 1001, False, eng, 0),
            ("all_gather", torch.bfloat16, 900, True, eng, 0),
        ]
        if world > 2:
            cases += [
                ("all_reduce", torch.float32, 5003, False, eng, 0),
                ("all_reduce", torch.bfloat16, 700, True, eng, 0),
                ("all_reduce", torch.float32, 5, False, eng, 0),  # chunks past the message
            ]
        cases += [("all_reduce", torch.float16, 2048 + 1, False, "ll", 0),
                  ("all_reduce", torch.float32, 1031, False, "2s", 0),
                  ("all_reduce", torch.bfloat16, 9, False, "1s", 0),
                  ("all_reduce", torch.float32, 1031, True, "2s", 0)]
    return cases


def _inputs(seed, world, numel, dtype):
    return [torch.randn(numel, generator=torch.Generator().manual_seed(seed + j)).to(dtype)
            for j in range(world)]


def _plan(case, world):
    op, dtype, numel, int8, eng, osm = case
    eb = torch.empty(0, dtype=dtype).element_size()
    limits = {"ll": DirectLimits(ll_max_bytes=DIRECT_CAP // 2, capacity=DIRECT_CAP),
              "1s": DirectLimits(one_shot_max_bytes=DIRECT_CAP, capacity=DIRECT_CAP),
              "2s": DirectLimits(two_shot_max_bytes=DIRECT_CAP, capacity=DIRECT_CAP)}
    kw = dict(int8=int8, engines=CopyEngines.uniform("ce" if eng in limits else eng),
              direct=limits.get(eng, DirectLimits()))
    if op == "all_reduce":
        return plan_all_reduce(numel, eb, world, one_shot_max_bytes=osm, **kw)
    return plan_all_gather(numel, eb, world, **kw)


def _enqueue(comm, plan, x, out):
    datapath.enqueue(plan, comm.staging, comm.sync, x, out, MAIN)


def _want(plan, xs, dtype):
    if plan.op == "all_gather":
        return torch.cat([int8_round_trip_ref(t) if plan.int8 else t for t in xs])
    if plan.int8 and plan.algorithm == "direct_2s":
        return direct_two_shot_int8_ref(xs)
    if plan.int8:
        return all_reduce_int8_ref(xs, two_shot=plan.algorithm == "two_shot")
    return sum(t.float() for t in xs).to(dtype)


def _run_cases(seg: SharedSegment, comm: SimComm, regions: Regions):
    """One rank's calls, two in flight per case; returns (rows, device ticks, host-mapped ticks)."""
    rows = []
    for i, case in enumerate(_cases(seg.world)):
        op, dtype, numel, int8 = case[:4]
        plan = _plan(case, seg.world)
        calls = []
        for call in range(2):
            xs = _inputs(1000 * i + 100 * call, seg.world, numel, dtype)
            x = xs[comm.rank].clone()
            regions.add(x.data_ptr(), x.numel() * x.element_size())
            out = x if op == "all_reduce" else torch.empty(seg.world * numel, dtype=dtype)
            regions.add(out.data_ptr(), out.numel() * out.element_size())
            _enqueue(comm, plan, x, out)
            calls.append((xs, x, out))
        comm.drv.synchronize()
        for xs, _, got in calls:
            want = _want(plan, xs, dtype)
            err = (got.double() - want.double()).abs().max().item()
            scale = want.double().abs().max().item() + 1e-9
            rows.append((i, plan.algorithm, err / scale, bytes(got.view(torch.uint8).numpy())))
    return rows, int(comm.progress_t.item()), int(seg.word_at(seg.progress_offset(comm.rank)))


@interpreted
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_path_end_to_end_on_cpu(world, tmp_path, monkeypatch):
    monkeypatch.setenv("GLMCTL_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _ABORT.clear()
    seg = SharedSegment.create(f"sim{world}", world, slot_capacity(MAX_BYTES, world), DIRECT_CAP)
    regions = Regions()
    comms = {f"rank{r}": SimComm(seg, r, regions) for r in range(world)}
    restore = _wrap_launchers(regions, comms)
    results: dict = {}

    def rank_thread(rank):
        try:
            results[rank] = _run_cases(seg, comms[f"rank{rank}"], regions)
        except BaseException as exc:  # noqa: BLE001
            results[rank] = (f"{exc!r}", 0, 0)
            _ABORT.set()

    threads = [threading.Thread(target=rank_thread, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        _ABORT.set()  # (after the joins) no stream thread may outlive the segment
        restore()
        for c in comms.values():
            c.drv.stop()
        seg.unlink()
        seg.close()
    assert len(results) == world, "a rank thread hung"
    for rank, (rows, _, _) in results.items():
        assert not isinstance(rows, str), f"rank {rank}: {rows}"
    cases = _cases(world)
    rows0, ticks0, host0 = results[0]
    assert ticks0 == 2 * len(cases) == host0  # one progress tick per call, mirrored to host memory
    for k, (i, algorithm, rel, raw) in enumerate(rows0):
        case = cases[i]
        op, dtype, numel, int8, eng, osm = case
        # fp32 sums are exact up to summation order rounding; the interpreter truncates casts to
        # 16-bit floats (the GPU rounds to nearest even), hence one 16-bit ulp elsewhere; INT8 may
        # also land one quantization step (1/127 of a group's amax) from the torch codec
        limit = 1e-6 if dtype == torch.float32 else 2**-7
        limit += 1 / 127 if int8 else 0
        assert rel <= limit, (case, algorithm, rel)
        if eng in DIRECT:
            assert algorithm == DIRECT[eng], (case, algorithm)
        elif world > 2 and osm == 0 and op == "all_reduce":
            assert algorithm == "two_shot"
        for r in range(1, world):
            assert results[r][0][k][3] == raw, f"ranks 0 and {r} differ on {case}"
