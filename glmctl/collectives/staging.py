"""What a data path needs from its rank, as two explicit objects (no torch here).

`Staging` is where the bytes of a call go: the device addresses of the rank's view of the shared
host segment and of its device mirror, the copy-engine copy, and the direct path's area. `Sync` is
how ranks tell each other that bytes are there: barriers and per-piece flags, each one enqueued
on a stream (`protocol.MemopSync` does it with stream memory operations; the CPU simulation of the
data paths supplies its own). `SideStream` is the second stream of the pipelined paths. A data
path (`datapath`, `pipeline`, `direct`) reads nothing else of the communicator.

Layout of the addresses (`plan.py` has the per-call layouts): the data area holds `world` slots at
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

    def arrive(self, p: int, stream: int) -> None:
        """Raise piece flag p for every peer, after the copies enqueued on `stream` before it."""

    def await_flag(self, p: int, stream: int) -> None:
        """Wait on `stream` for piece flag p from every peer, and reset it."""


class SideStream(Protocol):
    """The pipelined paths' device-to-host stream and the events that order it with the caller's."""

    stream: int

    def fork(self, main: int) -> None:
        """Work enqueued on the side stream after this runs after the main stream's earlier work."""

    def join(self, main: int) -> None:
        """Work enqueued on the main stream after this runs after the side stream's earlier work."""

    def signal(self, p: int, src: int) -> None:
        """Record event p on stream `src` (its most recent record is what `after` waits for)."""

    def after(self, p: int, dst: int) -> None:
        """Later work on stream `dst` waits for event p's most recent record."""


@dataclass(frozen=True)
class DirectArea:
    """Device addresses of the direct path (`direct.py`): payload slots (parity q, rank j at
    `slots + (q * world + j) * capacity`), flag lines, and the words it reports through."""

    slots: int
    capacity: int  # bytes per slot
    flags: int  # line (program c, destination d) at flags + (c * world + d) * 64, word = source
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
