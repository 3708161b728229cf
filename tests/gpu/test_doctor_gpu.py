"""gpu lane: every doctor probe runs on a real GPU, and its numbers agree (within 10%) with a plain
torch measurement of the same thing made here. Writes the recorded report to $GLMCTL_DOCTOR_RECORD
when set (that file becomes tests/unit/fixtures/doctor/h200-*.json)."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def _plain_copy_gbps(direction: str, nbytes: int, reps: int = 7) -> float:
    import torch

    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        (d.copy_(h, non_blocking=True) if direction == "H2D" else h.copy_(d, non_blocking=True))
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


@pytest.fixture(scope="module")
def report():
    from glmctl.probe import run_probes

    r = run_probes.run(quick=False, where=os.environ.get("GLMCTL_DOCTOR_WHERE", "gpu lane"))
    if path := os.environ.get("GLMCTL_DOCTOR_RECORD"):
        Path(path).write_text(r.model_dump_json(indent=1))
    return r


def test_inventory(report):
    import torch

    assert len(report.gpus) == torch.cuda.device_count()
    g = report.gpus[0]
    assert g.compute_capability == torch.cuda.get_device_capability(0)
    assert abs(g.memory_bytes - torch.cuda.get_device_properties(0).total_memory) < 0.02 * g.memory_bytes
    assert report.software.torch_cuda == torch.version.cuda and report.software.nvidia_driver


@pytest.mark.parametrize("direction", ["H2D", "D2H"])
def test_pinned_copy_agrees_with_plain_torch(report, direction):
    ours = report.measured(f"pinned {direction}", gpu=0)[0]
    plain = _plain_copy_gbps(direction, ours.bytes)
    assert abs(ours.gbps - plain) / plain < 0.10, (ours.gbps, plain)


def test_every_probe_produced_numbers(report):
    names = {m.name for m in report.bandwidth}
    assert {"pinned H2D", "pinned D2H", "pageable H2D", "pageable D2H", "pinned bidirectional"} <= names
    assert any(n.startswith("host memcpy") for n in names)
    assert all(m.gbps > 0 for m in report.bandwidth)
    if len(report.gpus) > 1:
        assert report.p2p and all(p.write_test != "skipped" for p in report.p2p)
        assert any(c.backend == "nccl" for c in report.collectives)


def test_verdict_for_this_gpu(report):
    from glmctl.probe.verdict import decide

    v = decide(report)
    major = report.gpus[0].compute_capability[0]
    assert v.kernels.startswith("glmctl Triton" if major == 8 else "vLLM's native")
