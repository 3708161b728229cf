"""The doctor report: one pydantic document, stable enough to record and replay.

Everything a probe measures lands here; the verdict (glmctl.probe.verdict) is a pure function of
this document, so verdict rules are tested from recorded reports (tests/unit/fixtures/doctor/).
Bandwidths are GB/s (1e9 bytes/s), times are seconds unless a field says otherwise.
`schema_version` changes whenever a field changes meaning.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

SCHEMA_VERSION = 1
GIB = 1 << 30


class Software(BaseModel):
    glmctl: str
    python: str
    torch: str | None = None
    torch_cuda: str | None = None      # CUDA runtime torch was built with
    triton: str | None = None
    vllm: str | None = None
    exllamav3: str | None = None
    nvidia_driver: str | None = None
    env: dict[str, str] = Field(default_factory=dict)   # variables that change behaviour
    shm_bytes: int | None = None       # size of /dev/shm (host-staged collectives live there)


class Host(BaseModel):
    cpu_model: str
    cpu_cores: int
    memory_bytes: int
    numa_nodes: int = 1


class Gpu(BaseModel):
    """One GPU, as doctor records it and as `glmctl serve`'s preflight sees it (`glmctl.probe.gpus`).
    `index`: the driver's (NVML) index."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    pci_bus_id: str | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    numa_node: int | None = None
    # Free memory at the moment it was read (preflight's question); not recorded: doctor judges
    # the node, and None reads as all of it free.
    free_bytes: int | None = Field(None, exclude=True)

    @property
    def total_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def free_gib(self) -> float:
        return (self.memory_bytes if self.free_bytes is None else self.free_bytes) / GIB


P2PState = Literal["ok", "not-supported", "reported-but-broken", "not-reported-but-works", "untested", "error"]


class P2PPair(BaseModel):
    src: int
    dst: int
    nvml: str | None = None            # NVML's P2P write status string, e.g. "OK", "NS", "CHIPSET_NOT_SUPPORTED"
    cuda_can_access: bool | None = None
    write_test: Literal["pass", "fail", "timeout", "error", "skipped"] = "skipped"
    state: P2PState = "untested"
    detail: str = ""


class Measurement(BaseModel):
    """One bandwidth figure, with how it was taken."""

    name: str                          # e.g. "pinned H2D", "host memcpy x8 threads"
    gpu: int | None = None             # None for host-only or all-GPU figures
    bytes: int                         # size of one transfer
    gbps: float                        # achieved GB/s (1e9 B/s)
    method: str                        # how it was measured (median of N, events/wall clock)


class CollectivePoint(BaseModel):
    op: Literal["all_reduce", "all_gather"]
    backend: Literal["nccl", "host-staged"]
    dtype: str                         # "bf16", "int8" (host-staged payload), ...
    ranks: int
    bytes: int                         # message size per rank
    latency_us: float
    algbw_gbps: float
    busbw_gbps: float                  # nccl-tests formula: all-reduce algbw * 2(n-1)/n
    env: dict[str, str] = Field(default_factory=dict)  # e.g. NCCL_P2P_DISABLE=1


class DoctorReport(BaseModel):
    schema_version: int = SCHEMA_VERSION
    recorded_at: str
    where: str                         # free text: machine / VM description, hostname
    quick: bool
    software: Software
    host: Host
    gpus: list[Gpu] = Field(default_factory=list)
    cuda_error: str | None = None      # why there are no GPUs, when there are none
    p2p: list[P2PPair] = Field(default_factory=list)
    bandwidth: list[Measurement] = Field(default_factory=list)
    collectives: list[CollectivePoint] = Field(default_factory=list)
    collectives_calibration: dict | None = None   # glmctl.collectives' cached copy-engine/SM choice
    notes: list[str] = Field(default_factory=list)

    def measured(self, name: str, gpu: int | None = None) -> list[Measurement]:
        return [m for m in self.bandwidth if m.name == name and (gpu is None or m.gpu == gpu)]
