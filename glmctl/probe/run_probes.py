"""Run every probe in order and assemble the report. Each probe failure is recorded, not fatal."""

from __future__ import annotations

import platform
import socket
from datetime import UTC, datetime

from glmctl.feedback import QUIET, Feedback
from glmctl.probe import bandwidth, software
from glmctl.probe.doctor_report import DoctorReport
from glmctl.probe.gpus import NoGpu, nvml_p2p_matrix, probe_gpus

MIB = 1 << 20
FULL_SIZES = [1 << 12, 1 << 16, 1 << 20, 8 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [1 << 16, 8 << 20]


def _step(feedback: Feedback, title: str):
    feedback.note(f"[doctor] {title} ...")


def run(quick: bool = False, feedback: Feedback = QUIET, where: str | None = None) -> DoctorReport:
    notes: list[str] = []
    _step(feedback, "software and host")
    gpus, driver, cuda_error = [], None, None
    try:
        gpus, driver = probe_gpus()
    except NoGpu as exc:
        cuda_error = str(exc)
    report = DoctorReport(
        recorded_at=datetime.now(UTC).isoformat(timespec="seconds"),
        where=where or f"{socket.gethostname()} ({platform.platform()})",
        quick=quick,
        software=software.probe_software(nvidia_driver=driver, with_torch=bool(gpus)),
        host=software.probe_host(),
        gpus=gpus,
        cuda_error=cuda_error,
    )
    _step(feedback, "host memory bandwidth")
    threads = max(1, min(8, report.host.cpu_cores))
    report.bandwidth.append(bandwidth.host_memcpy((64 if quick else 256) * MIB, threads))
    if not gpus:
        return report

    size = (64 if quick else 256) * MIB
    for g in gpus:
        _step(feedback, f"GPU {g.index}: pinned/pageable copies")
        try:
            report.bandwidth += bandwidth.host_device_copies(g.index, size, reps=3 if quick else 5)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"GPU {g.index} copy probe failed: {exc}")
    if len(gpus) > 1:
        idx = [g.index for g in gpus]
        for direction in ("H2D", "D2H"):
            _step(feedback, f"all GPUs at once: pinned {direction}")
            report.bandwidth.append(bandwidth.all_gpus_at_once(idx, size, direction))
        if not quick:
            _step(feedback, "peer-to-peer: driver matrices and cross-process write test per pair")
            from glmctl.probe.p2p import probe_p2p

            try:
                nvml = nvml_p2p_matrix(len(gpus))
            except NoGpu:
                nvml = None
            report.p2p = probe_p2p(len(gpus), nvml)
        sizes = QUICK_SIZES if quick else FULL_SIZES
        _step(feedback, "NCCL all-reduce (default, then NCCL_P2P_DISABLE=1)")
        from glmctl.probe.nccl_bench import run_nccl_all_reduce

        for env in ({}, {"NCCL_P2P_DISABLE": "1"}):
            try:
                report.collectives += run_nccl_all_reduce(len(gpus), sizes, env)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"NCCL all-reduce {env or ''} failed: {exc}")
        _step(feedback, "host-staged all-reduce / all-gather (glmctl.collectives)")
        report.collectives += _host_staged(len(gpus), sizes, notes)
    else:
        notes.append("one GPU: P2P, NCCL and host-staged collectives need >= 2 GPUs and were not measured")
    report.collectives_calibration = _calibration(notes)
    report.notes = notes
    return report


def _host_staged(ranks: int, sizes: list[int], notes: list[str]):
    try:
        from glmctl.collectives import probe as hs_probe  # provided by glmctl.collectives
    except ImportError:
        notes.append("host-staged collectives probe not available in this build")
        return []
    try:
        from glmctl.probe.doctor_report import CollectivePoint

        return [CollectivePoint(**p) for p in hs_probe.measure(ranks=ranks, sizes=sizes)]
    except Exception as exc:  # noqa: BLE001
        notes.append(f"host-staged collectives probe failed: {exc}")
        return []


def _calibration(notes: list[str]) -> dict | None:
    try:
        from glmctl.collectives import probe as hs_probe
    except ImportError:
        return None
    try:
        cal = hs_probe.cached_calibration()
    except Exception as exc:  # noqa: BLE001
        notes.append(f"reading the collectives calibration failed: {exc}")
        return None
    return cal.model_dump(mode="json") if cal is not None else None


def profile_fits(report: DoctorReport):
    """Which shipped profiles this node can run (GPU requirements + the planner's KV fit)."""
    if not report.gpus:
        return []
    from glmctl.probe.fits import fits_for_node

    return fits_for_node(report)
