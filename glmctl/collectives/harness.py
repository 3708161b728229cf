"""Run one function in N fresh processes as the ranks of a group on this node (tests, bench).

Each rank runs `target(rank, world_size, session, *args)` in a spawned process and returns a
picklable value. `run_ranks` collects what every rank returned or raised, and kills whatever is
still running at the deadline, so a hang in a collective becomes a failed result, never a stuck run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from glmctl import switches


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


def _rank_main(target, rank, world, session, args, results) -> None:
    if after := switches.read("GLMCTL_HARNESS_TRACEBACK_S"):
        import faulthandler

        faulthandler.dump_traceback_later(after, exit=False)  # where a hung rank is, on stderr
    try:
        value = target(rank, world, session, *args)
        results.put((rank, True, value, None))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(target: Callable, world_size: int, *args, timeout_s: float = 300.0,
              session: str | None = None) -> list[RankResult]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    session = session or f"h{os.getpid()}x{secrets.token_hex(3)}"
    procs = [ctx.Process(target=_rank_main, args=(target, r, world_size, session, args, results),
                         name=f"rank{r}") for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value, error = results.get(timeout=0.2)
            out[rank] = RankResult(rank, ok, value, error)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                # every process ended; drain what they managed to put
                try:
                    while True:
                        rank, ok, value, error = results.get(timeout=0.5)
                        out[rank] = RankResult(rank, ok, value, error)
                except queue.Empty:
                    break
    for p in procs:
        p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    final = []
    for r, p in enumerate(procs):
        res = out.get(r) or RankResult(r, False, error="no result (killed at the deadline or crashed)")
        res.exitcode = p.exitcode
        final.append(res)
    return final
