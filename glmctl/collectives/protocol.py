"""The flag operations every collective call is built from, as stream memory operations (pure data).

A flag is one word per (flag id, source rank, destination rank); only the source writes 1, only the
destination writes 0. Two halves:
  arrive(f):  rank r's stream writes 1 into flag[f][r->j] for every peer j (fenced after earlier
              copies on that stream, so whatever it copied to host memory is there first)
  await(f):   rank r's stream writes 2f+1 into its status word ("waiting at f", for the watchdog),
              waits until flag[f][j->r] == 1 for every peer j, writes 0 into each of those
              (the reader resets what it consumed), then writes 2f+2 ("passed f")
A barrier is arrive + await on one stream. A call is B0 (previous call's reads done), payload
out, B1 (payloads in), reads, and for two-shot B2 (reduced chunks in) and reads.

Why the reset by the reader is safe, and why a call needs B0 besides B1, is in `host_staged_communicator.py`;
`tests/unit/test_collectives_protocol.py` checks it on every interleaving a random scheduler
finds, with each stream's writes delivered late but in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from glmctl.collectives.cuda_driver import MemOp
from glmctl.collectives.segment import BARRIERS

Flag = Callable[[int, int, int], int]  # flag(f, src, dst) -> address
# run(stream, ops, prepared): enqueue ops in order on the stream; `prepared` is what `prepare(ops)`
# returned for them once (the driver's ctypes batch), or None
RunMemops = Callable[[int, list[MemOp], Any], None]


def arrive_memops(rank: int, world: int, f: int, flag: Flag) -> list[MemOp]:
    return [MemOp("write", flag(f, rank, j), 1) for j in range(world) if j != rank]


def await_memops(rank: int, world: int, f: int, flag: Flag, status: int) -> list[MemOp]:
    peers = [j for j in range(world) if j != rank]
    ops = [MemOp("write", status, 2 * f + 1)]
    ops += [MemOp("wait", flag(f, j, rank), 1) for j in peers]
    ops += [MemOp("write", flag(f, j, rank), 0) for j in peers]
    ops.append(MemOp("write", status, 2 * f + 2))
    return ops


def barrier_memops(rank: int, world: int, b: int, flag: Flag, status: int) -> list[MemOp]:
    """`flag(b, src, dst)` is the device address of that flag; `status` of this rank's status word."""
    return arrive_memops(rank, world, b, flag) + await_memops(rank, world, b, flag, status)


class MemopSync:
    """`staging.Sync` as stream memory operations: every barrier of this rank prepared once at
    start-up (the addresses never change), enqueued by `run`. The fence is one write of a constant
    into the rank's own fence word: the driver fences a stream memory write after the stream's
    earlier work at system scope (cuStreamWriteValue32 without NO_MEMORY_BARRIER), which is all
    the direct path needs between its kernels."""

    def __init__(self, rank: int, world: int, flag: Flag, status: int, run: RunMemops,
                 prepare: Callable[[list[MemOp]], Any] = lambda ops: None,
                 fence_word: int | None = None) -> None:
        self._run = run

        def prep(ops):
            return ops, prepare(ops)

        self._barriers = [prep(barrier_memops(rank, world, b, flag, status)) for b in range(BARRIERS)]
        self._fence = prep([MemOp("write", fence_word, 1)]) if fence_word is not None else None

    def barrier(self, b: int, stream: int) -> None:
        self._run(stream, *self._barriers[b])

    def fence(self, stream: int) -> None:
        if self._fence is None:
            raise RuntimeError("this MemopSync was built without a fence word")
        self._run(stream, *self._fence)


def waiting_flag(status: int) -> int | None:
    """The flag id a status word says the stream waits at, or None between waits."""
    return (status - 1) // 2 if status % 2 == 1 else None


waiting_barrier = waiting_flag  # barriers are the first flag ids
