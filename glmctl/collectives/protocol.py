"""The barrier every collective call is built from, as stream memory operations (pure data).

At barrier b, rank r's stream:
  1. writes 1 into flag[b][r->j] for every peer j          (arrival; fenced after earlier copies)
  2. writes 2b+1 into its status word                       ("waiting at b", for the watchdog)
  3. waits until flag[b][j->r] == 1 for every peer j
  4. writes 0 into each flag[b][j->r]                       (the reader resets what it consumed)
  5. writes 2b+2 into its status word                       ("passed b")
A call is B0 (previous call's reads done), payload out, B1 (payloads in), reads, and for two-shot
B2 (reduced chunks in) and reads. Why the reset by the reader is safe, and why a call needs at least
two barriers, is in `communicator.py`; `tests/unit/test_collectives_protocol.py` checks it on every
interleaving a random scheduler finds, with each rank's writes delivered late but in order.
"""

from __future__ import annotations

from collections.abc import Callable

from glmctl.collectives.cuda_driver import MemOp


def barrier_memops(rank: int, world: int, b: int, flag: Callable[[int, int, int], int],
                   status: int) -> list[MemOp]:
    """`flag(b, src, dst)` is the device address of that flag; `status` of this rank's status word."""
    peers = [j for j in range(world) if j != rank]
    ops = [MemOp("write", flag(b, rank, j), 1) for j in peers]
    ops.append(MemOp("write", status, 2 * b + 1))
    ops += [MemOp("wait", flag(b, j, rank), 1) for j in peers]
    ops += [MemOp("write", flag(b, j, rank), 0) for j in peers]
    ops.append(MemOp("write", status, 2 * b + 2))
    return ops


def waiting_barrier(status: int) -> int | None:
    """The barrier a status word says the stream waits at, or None between barriers."""
    return (status - 1) // 2 if status % 2 == 1 else None
