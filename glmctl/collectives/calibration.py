"""Copy engine or SM copies, per direction and size band: measured once per GPU model and cached.

`calibrate()` times, on one GPU, a device-to-host and a host-to-device transfer of a small and a
large probe through the copy engine (cuMemcpyAsync) and through a Triton copy kernel that loads or
stores mapped host memory; each is timed as CUDA-graph replays (launch overhead excluded, as in a
captured decode step). The faster one per (direction, band) wins. The result is written as JSON under
`glmctl.paths.calibration()` (`collectives-<gpu>.json`) and reused by every later communicator on
that GPU model; `calibration_status()` (no torch import) is what `glmctl doctor` shows.
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from glmctl import paths
from glmctl.collectives.call_plan import DEFAULT_BAND_BYTES, CopyEngines

SMALL_PROBE = 64 * 1024
LARGE_PROBE = 16 * 1024 * 1024


class EngineChoice(BaseModel):
    direction: Literal["d2h", "h2d"]
    band: Literal["small", "large"]
    probe_bytes: int
    ce_us: float = Field(description="copy engine, microseconds per transfer (graph replay)")
    sm_us: float = Field(description="SM copy kernel, microseconds per transfer (graph replay)")
    engine: Literal["ce", "sm"]


class CollectivesCalibration(BaseModel):
    device: str
    key: str
    measured_at: str
    method: str
    band_bytes: int = DEFAULT_BAND_BYTES
    choices: list[EngineChoice]
    pinned_d2h_gbps: float = Field(description="copy engine, large probe, GB/s (1e9 B/s)")
    pinned_h2d_gbps: float

    def engines(self) -> CopyEngines:
        pick = {(c.direction, c.band): c.engine for c in self.choices}
        return CopyEngines(
            d2h_small=pick[("d2h", "small")], d2h_large=pick[("d2h", "large")],
            h2d_small=pick[("h2d", "small")], h2d_large=pick[("h2d", "large")],
            band_bytes=self.band_bytes,
        )


class CollectivesCalibrationStatus(BaseModel):
    """What `glmctl doctor` reports: where the cache lives and every GPU model measured so far."""

    cache_dir: str
    entries: list[CollectivesCalibration]


def device_key(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "gpu"


def cache_path(device_name: str) -> Path:
    return paths.calibration() / f"collectives-{device_key(device_name)}.json"


def load_calibration(device_name: str) -> CollectivesCalibration | None:
    path = cache_path(device_name)
    try:
        return CollectivesCalibration.model_validate_json(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def save_calibration(cal: CollectivesCalibration) -> Path:
    path = cache_path(cal.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cal.model_dump(mode="json"), indent=2))
    os.replace(tmp, path)
    return path


def calibration_status() -> CollectivesCalibrationStatus:
    root = paths.calibration()
    entries = []
    for path in sorted(root.glob("collectives-*.json")):
        try:
            entries.append(CollectivesCalibration.model_validate_json(path.read_text()))
        except ValueError:
            continue
    return CollectivesCalibrationStatus(cache_dir=str(root), entries=entries)


def calibrate(device: int | None = None, *, save: bool = True) -> CollectivesCalibration:
    """Measure on the current (or given) CUDA device; needs torch, Triton and a driver."""
    import mmap

    import torch

    from glmctl.collectives import kernels
    from glmctl.collectives.cuda_driver import driver

    if device is not None:
        torch.cuda.set_device(device)
    dev = torch.cuda.current_device()
    name = torch.cuda.get_device_name(dev)
    drv = driver()
    torch.zeros(1, device="cuda")  # make the primary context current on this thread
    nbytes = LARGE_PROBE
    mm = mmap.mmap(-1, nbytes, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    import ctypes

    anchor = ctypes.c_char.from_buffer(mm)
    host = ctypes.addressof(anchor)
    drv.host_register(host, nbytes)
    try:
        hptr = drv.device_pointer(host)
        dbuf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        choices = []
        rates = {}
        for band, size in (("small", SMALL_PROBE), ("large", LARGE_PROBE)):
            numel = size // 2
            hp = kernels.MappedPtr(hptr, torch.bfloat16)
            dv = dbuf[:size].view(torch.bfloat16)

            def ce_d2h(size=size):
                drv.memcpy_async(hptr, dbuf.data_ptr(), size, torch.cuda.current_stream().cuda_stream)

            def ce_h2d(size=size):
                drv.memcpy_async(dbuf.data_ptr(), hptr, size, torch.cuda.current_stream().cuda_stream)

            def sm_d2h(numel=numel, hp=hp, dv=dv):
                kernels.copy_records(dv, hp, n_valid=numel, total=numel)

            def sm_h2d(numel=numel, hp=hp, dv=dv):
                kernels.copy_records(hp, dv, n_valid=numel, total=numel)

            reps = 20 if band == "small" else 4
            for direction, ce, sm in (("d2h", ce_d2h, sm_d2h), ("h2d", ce_h2d, sm_h2d)):
                ce_us = graph_time_us(ce, reps, 5, warm_up=True)
                sm_us = graph_time_us(sm, reps, 5, warm_up=True)
                choices.append(EngineChoice(direction=direction, band=band, probe_bytes=size,
                                            ce_us=round(ce_us, 2), sm_us=round(sm_us, 2),
                                            engine="ce" if ce_us <= sm_us else "sm"))
                if band == "large":
                    rates[direction] = size / (ce_us * 1e-6) / 1e9
        cal = CollectivesCalibration(
            device=name,
            key=device_key(name),
            measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
            method=f"one process, CUDA-graph replays of {SMALL_PROBE} B and {LARGE_PROBE} B copies "
            "between device memory and registered shared host memory; median of 5 timings",
            choices=choices,
            pinned_d2h_gbps=round(rates["d2h"], 2),
            pinned_h2d_gbps=round(rates["h2d"], 2),
        )
    finally:
        torch.cuda.synchronize()
        drv.host_unregister(host)
        del anchor
        mm.close()
    if save:
        save_calibration(cal)
    return cal


def graph_time_us(op, calls: int, replays: int, *, warm_up: bool = False) -> float:
    """Microseconds per `op`: median over `replays` replays of a graph holding `calls` of them
    (`warm_up`: run `op` once on a side stream first, so a kernel compiles outside the capture)."""
    import torch

    if warm_up:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op()
        torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            op()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    del graph
    return sorted(times)[len(times) // 2]
