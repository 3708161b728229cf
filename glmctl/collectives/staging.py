"""What a data path needs from its rank, as two explicit objects (no torch here).

`Staging` is where the bytes of a call go: the device addresses of the rank's view of the shared
host segment and of its device mirror, the copy-engine copy, and the direct path's area. `Sync` is
how ranks tell each other that bytes are there: barriers, each one enqueued on a stream
(`protocol.MemopSync` does it with stream memory operations; the CPU simulation of the data paths
supplies its own). A data path (`datapath`, `direct`) reads nothing else of the communicator.

Layout of the addresses (`call_plan.py` has the per-call layouts): the data area holds `world` slots at
`host + j * plan.slot_stride`; the result area starts at `host + world * capacity`; the stage
mirrors both at the same offsets from `stage`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

Copy = Callable[[int, int, int, int], None]  # (dst, src, nbytes, stream): copy-engine copy


class Sync(Protocol):
    def barrier(self, b: int, stream: int) -> None:
        """Every rank's earlier work on its stream is visible to all, before later work here."""

    def fence(self, stream: int) -> None:
        """This rank's earlier work on its stream is visible to every process and device before
        its later work: a system-scope fence between two kernels, waiting for nobody."""


@dataclass(frozen=True)
class DirectArea:
    """Device addresses of the direct path (`direct.py`): payload slots (parity q, rank j at
    `ll_slots + (q * world + j) * capacity` for LL words, `slots + ...` for native payloads),
    flag lines, and the words it reports through."""

    ll_slots: int
    slots: int
    capacity: int  # bytes per slot
    flags: int  # line (round c, destination d) at flags + (c * world + d) * 64, word = source
    abort: int  # the segment's abort word: a waiting program gives up once it is non-zero
    status: int  # this rank's status word (the watchdog reads it)
    epoch_word: int  # this rank's direct-path epoch, as the watchdog reads it
    epochs: Any  # device int32[programs]: each program's call counter (device memory)


@dataclass(frozen=True)
class Staging:
    rank: int
    world: int
    capacity: int  # bytes of one data-area slot, and of the result area
    host: int  # device address of the host data area
    stage: int  # device address of the device mirror
    progress: Any  # kernels.Progress: the counter the last kernel of each call bumps
    copy: Copy
    direct: DirectArea | None = None

    @property
    def result_offset(self) -> int:
        return self.world * self.capacity

    @property
    def peers(self) -> list[int]:
        return [j for j in range(self.world) if j != self.rank]
