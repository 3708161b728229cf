"""The machine a plan is for (`NodeSpec`): how many devices, how much memory each, which platform.

GPU memory is the CUDA-visible total per device (what `torch.cuda.mem_get_info()` reports as total
and what vLLM multiplies by `--gpu-memory-utilization`), which is 1-2 % below `nvidia-smi`'s figure.
Where the table has no CUDA-visible measurement it uses `nvidia-smi`'s total and says so; pass
`--gpu-memory-gib` with your own device's value to plan exactly.

`NodeConstants` are the runtime costs the planner cannot derive from vLLM's source: memory that
NCCL, cuBLAS and the CUDA-graph pool take on each device. They are estimates, named and stated in
every plan, the same for every setup on a node.
"""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, ConfigDict

from glmctl.errors import UsageError

GIB = 1 << 30


class GpuModel(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    memory_gib: float  # per device
    compute_capability: str
    memory_source: str


def _gpu(name: str, gib: float, cc: str, source: str) -> GpuModel:
    return GpuModel(name=name, memory_gib=gib, compute_capability=cc, memory_source=source)


_CUDA_OOM = "CUDA-visible total from a PyTorch out-of-memory message"
_SMI = "nvidia-smi total (MiB -> GiB); the CUDA-visible total is ~1-2 % lower"
GPU_MODELS: dict[str, GpuModel] = {
    g.name.lower(): g
    for g in (
        _gpu("L40", 44.40, "8.9", f"{_CUDA_OOM} (QwenLM/Qwen3-VL#2097)"),
        _gpu("L40S", 44.42, "8.9", f"{_CUDA_OOM} (stepfun-ai/Step-Video-T2V#8)"),
        _gpu("RTX4090", 23.64, "8.9", f"{_CUDA_OOM} (3DTopia/Phidias-Diffusion#8)"),
        _gpu("L4", 22.49, "8.9", f"{_SMI}: 23034 MiB (modal-labs/modal-client#2797)"),
        _gpu("A10", 22.49, "8.6", f"{_SMI}: 23028 MiB (modal-labs/modal-client#2797)"),
        _gpu("A6000", 47.99, "8.6", f"{_SMI}: 49140 MiB"),
        _gpu("A100-40GB", 40.0, "8.0", f"{_SMI}: 40960 MiB (modal-labs/modal-client#2797)"),
        _gpu("A100-80GB", 80.0, "8.0", f"{_SMI}: 81920 MiB (modal-labs/modal-client#2797)"),
        _gpu("H100", 79.65, "9.0", f"{_SMI}: 81559 MiB (modal-labs/modal-client#2797)"),
    )
}


class NodeConstants(BaseModel):
    """Per-device runtime memory that is not in vLLM's formulas (estimates, stated in every plan)."""

    model_config = ConfigDict(frozen=True)

    non_torch_runtime_gib: float = 0.5
    """NCCL communicators, cuBLAS/cuBLASLt workspaces and device-side collective staging buffers:
    what vLLM's profiler counts as the non-torch increase (`vllm/utils/mem_utils.py`)."""
    cudagraph_first_mib: float = 48.0
    """CUDA-graph pool memory of the first (largest) captured graph of each mode."""
    cudagraph_per_graph_mib: float = 4.0
    """Each further captured graph (vLLM's estimate uses at least 1 MiB each)."""
    source: str = "estimates for TP decode on Ada (not measured on the reference node)"


class NodeSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    platform: str  # "cuda" or "cpu"
    num_devices: int
    device_memory_bytes: int
    memory_source: str
    gpu_model: str | None = None
    kv_cache_bytes: int | None = None  # fixed KV space (CPU, or --kv-cache-gib); skips profiling
    cpu_amx: bool = False  # vLLM CPU: AMX tiles let its MLA path keep --block-size (platforms/cpu.py)
    constants: NodeConstants = NodeConstants()


_GPUS_RE = re.compile(r"^\s*(\d+)\s*[xX*]\s*([A-Za-z0-9-]+)\s*$")


def parse_gpus(text: str) -> tuple[int, GpuModel]:
    """'8xL40' -> (8, L40)."""
    match = _GPUS_RE.match(text)
    if not match:
        raise UsageError(f"--gpus '{text}' is not COUNTxMODEL", hint="for example --gpus 8xL40")
    count, model = int(match.group(1)), match.group(2).lower()
    if model not in GPU_MODELS:
        raise UsageError(
            f"unknown GPU model '{match.group(2)}'",
            hint=f"known: {', '.join(g.name for g in GPU_MODELS.values())}; "
            "or give --num-gpus and --gpu-memory-gib",
        )
    if count < 1:
        raise UsageError("--gpus needs at least one GPU")
    return count, GPU_MODELS[model]


def gpu_node(
    gpus: str | None = None,
    num_gpus: int | None = None,
    gpu_memory_gib: float | None = None,
    kv_cache_gib: float | None = None,
    constants: NodeConstants | None = None,
) -> NodeSpec:
    """A CUDA node from '8xL40' or an explicit count and per-GPU memory (explicit values win)."""
    model = None
    if gpus:
        count, model = parse_gpus(gpus)
        num_gpus = num_gpus or count
        memory_gib, source = model.memory_gib, model.memory_source
    if gpu_memory_gib is not None:
        memory_gib, source = gpu_memory_gib, "--gpu-memory-gib"
    if num_gpus is None or (model is None and gpu_memory_gib is None):
        raise UsageError(
            "no node given", hint="pass --gpus COUNTxMODEL (e.g. 8xL40), or --num-gpus and --gpu-memory-gib"
        )
    if memory_gib <= 0 or num_gpus < 1:
        raise UsageError("GPU count and memory must be positive")
    name = f"{num_gpus}x {model.name if model else f'{memory_gib:g} GiB GPU'}"
    return NodeSpec(
        name=name,
        platform="cuda",
        num_devices=num_gpus,
        device_memory_bytes=int(memory_gib * GIB),
        memory_source=source,
        gpu_model=model.name if model else None,
        kv_cache_bytes=None if kv_cache_gib is None else int(kv_cache_gib * GIB),
        constants=constants or NodeConstants(),
    )


CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_DEFAULT_GIB = 1.0


def cpu_node(kv_cache_gib: float | None = None) -> NodeSpec:
    """This machine's CPU as vLLM-CPU sees it: one device, a fixed KV space.

    vLLM-CPU sizes the KV cache from `VLLM_CPU_KVCACHE_SPACE` (GiB), not from a utilization
    fraction, so the plan does too: `--kv-cache-gib`, else that variable, else 1 GiB (what
    glmctl's CPU demo serves the tiny checkpoint with).
    """
    if kv_cache_gib is None:
        env = os.environ.get(CPU_KV_ENV, "").strip()
        kv_cache_gib = float(env) if env else CPU_KV_DEFAULT_GIB
        source = f"${CPU_KV_ENV}" if env else f"default ({CPU_KV_DEFAULT_GIB:g} GiB)"
    else:
        source = "--kv-cache-gib"
    total = _host_memory_bytes()
    return NodeSpec(
        name="this CPU (vLLM-CPU)",
        platform="cpu",
        num_devices=1,
        device_memory_bytes=total,
        memory_source=f"host RAM (/proc/meminfo); KV space {source}",
        kv_cache_bytes=int(kv_cache_gib * GIB),
        cpu_amx=_cpu_has_amx_tiles(),
    )


def _cpu_has_amx_tiles() -> bool:
    """What `torch.cpu._is_amx_tile_supported()` answers on Linux, read from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as fh:
            return any(line.startswith("flags") and " amx_tile" in line for line in fh)
    except OSError:
        return False


def _host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
