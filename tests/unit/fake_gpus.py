"""GPUs as the preflight and doctor see them (`glmctl.probe.doctor_report.Gpu`), written in GiB."""

from __future__ import annotations

from glmctl.probe.doctor_report import Gpu

GIB = 1 << 30


def gpu(index: int, name: str, capability: tuple[int, int], total_gib: float, free_gib: float | None = None) -> Gpu:
    return Gpu(index=index, name=name, compute_capability=capability, memory_bytes=round(total_gib * GIB),
               free_bytes=None if free_gib is None else round(free_gib * GIB))
