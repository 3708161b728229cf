"""GPU inventory through NVML (nvidia-ml-py), with a torch fallback where NVML is absent.

Two views, one `Gpu` type: `probe_gpus` (doctor) lists every GPU of the node; `inventory`
(`glmctl serve`'s preflight) lists the GPUs this process would give vLLM, CUDA_VISIBLE_DEVICES
applied, with their free memory. Neither imports torch unless NVML is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

from glmctl.probe.doctor_report import Gpu


class NoGpu(Exception):
    """No usable CUDA device; the message says why (shown verbatim in the report)."""


def _nvml():
    try:
        import pynvml  # provided by the nvidia-ml-py distribution
    except ImportError as exc:
        raise NoGpu("nvidia-ml-py is not installed (pip install 'glmctl[gpu]')") from exc
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NoGpu(f"NVML could not start: {exc}") from exc
    return pynvml


def _numa_node(bus_id: str | None) -> int | None:
    if not bus_id:
        return None
    # NVML reports 8-digit PCI domains ("00000000:17:00.0"); sysfs uses 4 ("0000:17:00.0").
    domain, rest = bus_id.lower().split(":", 1)
    path = Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/numa_node")
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return None if node < 0 else node


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a field NVML cannot read (VMs hide some) stays unknown
        return None


def _nvml_gpu(nvml, i: int) -> Gpu:
    h = nvml.nvmlDeviceGetHandleByIndex(i)
    name = nvml.nvmlDeviceGetName(h)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
    memory = nvml.nvmlDeviceGetMemoryInfo(h)
    pci = _try(nvml.nvmlDeviceGetPciInfo, h)
    bus = pci.busId if pci is not None else None
    bus = bus.decode() if isinstance(bus, bytes) else bus
    return Gpu(
        index=i,
        name=name.decode() if isinstance(name, bytes) else name,
        compute_capability=(major, minor),
        memory_bytes=memory.total,
        pci_bus_id=bus,
        pcie_gen_current=_try(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
        pcie_gen_max=_try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
        pcie_width_current=_try(nvml.nvmlDeviceGetCurrPcieLinkWidth, h),
        pcie_width_max=_try(nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
        numa_node=_numa_node(bus),
        free_bytes=memory.free,
    )


def probe_gpus() -> tuple[list[Gpu], str | None]:
    """(every GPU of the node, driver version). Raises NoGpu when there is no usable device."""
    nvml = _nvml()
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            raise NoGpu("NVML sees no GPU")
        driver = _try(nvml.nvmlSystemGetDriverVersion)
        gpus = [_nvml_gpu(nvml, i) for i in range(count)]
        return gpus, (driver.decode() if isinstance(driver, bytes) else driver)
    finally:
        _try(nvml.nvmlShutdown)


def visible(indices: list[int], env: str | None = None) -> list[int]:
    """The driver indices the CUDA runtime hands out under CUDA_VISIBLE_DEVICES (`env`, default
    this process's), in its order; numeric entries only: the runtime stops at the first entry it
    cannot use, and UUIDs / MIG names are not resolved here."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if env is None:
        return indices
    picked = []
    for item in env.split(","):
        item = item.strip()
        if not item.isdigit():
            break
        if int(item) in indices:
            picked.append(int(item))
    return picked


def _visible_from_nvml() -> list[Gpu]:
    nvml = _nvml()
    try:
        return [_nvml_gpu(nvml, i) for i in visible(list(range(nvml.nvmlDeviceGetCount())))]
    finally:
        _try(nvml.nvmlShutdown)


def _visible_from_torch() -> list[Gpu]:
    import torch  # the CUDA runtime applies CUDA_VISIBLE_DEVICES itself

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(Gpu(index=i, name=props.name, compute_capability=(props.major, props.minor),
                        memory_bytes=total, free_bytes=free))
    return gpus


def inventory() -> list[Gpu]:
    """The GPUs this process would give vLLM; empty when there are none (or no driver). Raises
    nothing."""
    try:
        return _visible_from_nvml()
    except Exception:  # noqa: BLE001 - no pynvml, no driver: try torch
        pass
    try:
        return _visible_from_torch()
    except Exception:  # noqa: BLE001
        return []


def nvml_p2p_matrix(n: int) -> dict[tuple[int, int], str]:
    """NVML's P2P *write* capability for each ordered pair, as NVML names it ("OK", "NS", ...)."""
    nvml = _nvml()
    names = {
        getattr(nvml, k): k.replace("NVML_P2P_STATUS_", "")
        for k in dir(nvml) if k.startswith("NVML_P2P_STATUS_")
    }
    out = {}
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        for i in range(n):
            for j in range(n):
                if i != j:
                    status = _try(nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j], nvml.NVML_P2P_CAPS_INDEX_WRITE)
                    out[(i, j)] = names.get(status, "UNKNOWN" if status is None else str(status))
    finally:
        _try(nvml.nvmlShutdown)
    return out
