"""Host-staged collectives: all-reduce and all-gather between the tensor-parallel processes of one
node through pinned shared host memory, CUDA-graph safe, with optional INT8 payloads. Independent of
vLLM; the plugin adapts it to vLLM's communicator.

    from glmctl.collectives import HostStagedCommunicator
    comm = HostStagedCommunicator(rank, world_size, group_id="tp-29500", max_bytes=64 << 20)
    y = comm.all_reduce(x)              # in place for a contiguous x
    z = comm.all_gather(x, dim=-1)
    with comm.capture():                # around CUDA-graph capture
        ...
    comm.close()

Importing this package does not import torch (`calibration_status()` is what `glmctl doctor` shows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmctl.collectives.calibration import (
    CollectivesCalibration,
    CollectivesCalibrationStatus,
    calibration_status,
)
from glmctl.collectives.call_plan import (
    CollectivePlan,
    CopyEngines,
    plan_all_gather,
    plan_all_reduce,
)
from glmctl.collectives.collective_errors import (
    CaptureMismatchError,
    CollectiveError,
    PeerLostError,
    SegmentError,
)

if TYPE_CHECKING:
    from glmctl.collectives.host_staged_communicator import HostStagedCommunicator

__all__ = [
    "CaptureMismatchError",
    "CollectiveError",
    "CollectivePlan",
    "CollectivesCalibration",
    "CollectivesCalibrationStatus",
    "CopyEngines",
    "HostStagedCommunicator",
    "PeerLostError",
    "SegmentError",
    "calibration_status",
    "plan_all_gather",
    "plan_all_reduce",
]


def __getattr__(name: str):
    if name == "HostStagedCommunicator":
        from glmctl.collectives.host_staged_communicator import HostStagedCommunicator

        return HostStagedCommunicator
    raise AttributeError(name)
