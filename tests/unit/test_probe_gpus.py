"""One GPU inventory for doctor and serve's preflight: NVML read once per GPU, CUDA_VISIBLE_DEVICES
applied for the preflight's view only, free memory never recorded in doctor's report."""

from __future__ import annotations

import sys
import types

import pytest

from glmctl.probe import gpus
from glmctl.probe.doctor_report import GIB, Gpu


class _Memory:
    def __init__(self, total: int, free: int) -> None:
        self.total, self.free = total, free


def _fake_nvml(count: int) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: count
    nvml.nvmlSystemGetDriverVersion = lambda: b"575.1"
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA L40"
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: (8, 9)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: _Memory(48 * GIB, (40 - h) * GIB)
    for query in ("nvmlDeviceGetPciInfo", "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration",
                  "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth"):
        setattr(nvml, query, _hidden)  # as on a VM: read as unknown
    return nvml


def _hidden(handle):
    raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


@pytest.fixture
def four_l40(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(4))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(("env", "expected"), [
    (None, [0, 1, 2, 3]),
    ("2,0", [2, 0]),
    ("1,7,3", [1, 3]),
    ("1,GPU-abc,3", [1]),  # the runtime stops at the first entry it cannot use
    ("", []),
])
def test_cuda_visible_devices_is_applied_as_the_runtime_does(env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert gpus.visible([0, 1, 2, 3]) == expected


def test_the_preflight_sees_the_visible_gpus_with_free_memory(four_l40, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    seen = gpus.inventory()
    assert [g.index for g in seen] == [3, 1]
    assert all(isinstance(g, Gpu) for g in seen)
    assert seen[0].total_gib == 48 and seen[0].free_gib == 37


def test_doctor_lists_every_gpu_and_records_no_free_memory(four_l40, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    listed, driver = gpus.probe_gpus()
    assert [g.index for g in listed] == [0, 1, 2, 3] and driver == "575.1"
    assert "free_bytes" not in listed[0].model_dump(mode="json")
    # a recorded report read back judges the node as all free
    again = Gpu.model_validate(listed[0].model_dump(mode="json"))
    assert again.free_gib == again.total_gib == 48
