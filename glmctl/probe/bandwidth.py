"""Copy bandwidths, nvbandwidth-style: host<->GPU per GPU and all at once, and host memory.

Every figure is `bytes of one transfer / time`, GB/s = 1e9 B/s, the median of several timed
repetitions after a warm-up; GPU copies are timed with CUDA events on the copy's own stream, the
all-GPU and host figures with a wall clock around synchronized work. The `method` field of each
Measurement says exactly that, so a number never travels without how it was taken.
"""

from __future__ import annotations

import statistics
import threading
import time

from glmctl.probe.doctor_report import Measurement

MIB = 1 << 20


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _timed_copy(dst, src, stream, reps: int) -> list[float]:
    import torch

    times = []
    for i in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        if i:  # the first repetition is the warm-up
            times.append(start.elapsed_time(end) / 1e3)
    return times


def host_device_copies(gpu: int, nbytes: int, reps: int = 5) -> list[Measurement]:
    """Pinned and pageable H2D / D2H on one GPU, and pinned bidirectional (both at once)."""
    import torch

    dev = torch.device("cuda", gpu)
    out = []
    with torch.cuda.device(dev):
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        d.random_(0, 255)
        for pinned in (True, False):
            h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            h.random_(0, 255)
            kind = "pinned" if pinned else "pageable"
            s = torch.cuda.Stream(dev)
            for direction, (dst, src) in (("H2D", (d, h)), ("D2H", (h, d))):
                t = _timed_copy(dst, src, s, reps)
                out.append(Measurement(name=f"{kind} {direction}", gpu=gpu, bytes=nbytes, gbps=_median_gbps(nbytes, t),
                                       method=f"CUDA events around one copy, median of {reps} after 1 warm-up"))
        # Bidirectional: an H2D and a D2H of the same size on two streams at once; report the sum.
        h_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        h_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2 = torch.empty_like(d)
        s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        times = []
        for i in range(reps + 1):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            with torch.cuda.stream(s1):
                d2.copy_(h_in, non_blocking=True)
            with torch.cuda.stream(s2):
                h_out.copy_(d, non_blocking=True)
            torch.cuda.synchronize(dev)
            if i:
                times.append(time.perf_counter() - t0)
        out.append(Measurement(name="pinned bidirectional", gpu=gpu, bytes=2 * nbytes, gbps=_median_gbps(2 * nbytes, times),
                               method=f"wall clock around concurrent H2D+D2H on two streams, median of {reps}"))
    return out


def all_gpus_at_once(gpus: list[int], nbytes: int, direction: str, reps: int = 3) -> Measurement:
    """Every GPU copying pinned host memory at the same time: the host-memory / root-complex ceiling."""
    import torch

    bufs = []
    for g in gpus:
        dev = torch.device("cuda", g)
        bufs.append((torch.empty(nbytes, dtype=torch.uint8, device=dev),
                     torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch.cuda.Stream(dev)))
    times = []
    for i in range(reps + 1):
        for g in gpus:
            torch.cuda.synchronize(g)
        t0 = time.perf_counter()
        for d, h, s in bufs:
            with torch.cuda.stream(s):
                (d.copy_(h, non_blocking=True) if direction == "H2D" else h.copy_(d, non_blocking=True))
        for g in gpus:
            torch.cuda.synchronize(g)
        if i:
            times.append(time.perf_counter() - t0)
    total = nbytes * len(gpus)
    return Measurement(name=f"all-GPU pinned {direction}", gpu=None, bytes=total, gbps=_median_gbps(total, times),
                       method=f"wall clock, {len(gpus)} GPUs copying {nbytes // MIB} MiB each at once, median of {reps}")


def host_memcpy(nbytes: int, threads: int, reps: int = 3) -> Measurement:
    """Host memory copy bandwidth with several threads (numpy releases the GIL for large copies)."""
    import numpy as np

    per = max(1, nbytes // threads)
    src = [np.random.default_rng(i).integers(0, 255, per, dtype=np.uint8) for i in range(threads)]
    dst = [np.empty_like(s) for s in src]
    times = []
    for i in range(reps + 1):
        workers = [threading.Thread(target=np.copyto, args=(d, s)) for d, s in zip(dst, src, strict=True)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if i:
            times.append(time.perf_counter() - t0)
    total = per * threads
    return Measurement(name=f"host memcpy x{threads} threads", gpu=None, bytes=total, gbps=_median_gbps(total, times),
                       method=f"wall clock, bytes copied (each read once, written once), median of {reps}")
