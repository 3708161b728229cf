"""GPU inventory through NVML (nvidia-ml-py), with a torch fallback where NVML is absent."""

from __future__ import annotations

from pathlib import Path

from glmctl.probe.report import Gpu


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


def probe_gpus() -> tuple[list[Gpu], str | None]:
    """(GPUs, driver version). Raises NoGpu when there is no usable device."""
    nvml = _nvml()
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            raise NoGpu("NVML sees no GPU")
        driver = _try(nvml.nvmlSystemGetDriverVersion)
        gpus = []
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            pci = _try(nvml.nvmlDeviceGetPciInfo, h)
            bus = pci.busId if pci is not None else None
            bus = bus.decode() if isinstance(bus, bytes) else bus
            gpus.append(Gpu(
                index=i,
                name=name.decode() if isinstance(name, bytes) else name,
                compute_capability=(major, minor),
                memory_bytes=nvml.nvmlDeviceGetMemoryInfo(h).total,
                pci_bus_id=bus,
                pcie_gen_current=_try(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                pcie_gen_max=_try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width_current=_try(nvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                pcie_width_max=_try(nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                numa_node=_numa_node(bus),
            ))
        return gpus, (driver.decode() if isinstance(driver, bytes) else driver)
    finally:
        _try(nvml.nvmlShutdown)


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
