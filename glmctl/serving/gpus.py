"""What GPUs this process would give vLLM, for the preflight (NVML first, torch as a fallback).

Imported lazily and only for CUDA profiles: the CPU profile never touches NVML or torch.cuda.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: tuple[int, int]
    total_gib: float
    free_gib: float


def _visible(indices: list[int]) -> list[int]:
    """Apply CUDA_VISIBLE_DEVICES (numeric form) the way the CUDA runtime would."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return indices
    picked = []
    for item in env.split(","):
        item = item.strip()
        if not item.isdigit():
            break  # UUIDs / MIG names: not resolved here; the runtime stops at the first bad entry
        if int(item) in indices:
            picked.append(int(item))
    return picked


def _from_nvml() -> list[Gpu]:
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in _visible(list(range(pynvml.nvmlDeviceGetCount()))):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            cc = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            gpus.append(Gpu(i, name.decode() if isinstance(name, bytes) else name, tuple(cc),
                            mem.total / GIB, mem.free / GIB))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _from_torch() -> list[Gpu]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(Gpu(i, props.name, (props.major, props.minor), total / GIB, free / GIB))
    return gpus


def inventory() -> list[Gpu]:
    """The visible GPUs; empty when there are none (or no driver). Raises nothing."""
    try:
        return _from_nvml()
    except Exception:  # noqa: BLE001 - no pynvml, no driver: try torch
        pass
    try:
        return _from_torch()
    except Exception:  # noqa: BLE001
        return []
