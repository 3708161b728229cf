"""The flag protocol, model-checked: ranks run the real flag operations (`barrier_memops`) around
modelled payload writes and reads, under random schedules in which every stream's writes reach
memory late but in order (posted writes behind a fence). No schedule may deadlock, read a payload
of the wrong call, or overwrite a payload before every peer has read it. The same model shows why
one barrier per call is not enough."""

from __future__ import annotations

import random
from collections import deque

import pytest

from glmctl.collectives.protocol import barrier_memops


class BrokenProtocol(AssertionError):
    pass


def _programs(world: int, calls: list[int]):
    """Per rank, the op list of `calls` (each the number of barriers: 2 or 3). Flags are named
    ("f", b, src, dst); payload slots ("slot", j) and reduced chunks ("res", j) hold a call number."""
    progs = []
    for r in range(world):
        ops = []
        for k, barriers in enumerate(calls):
            def bar(b, r=r):
                return [(op.kind, op.address, op.value) for op in barrier_memops(
                    r, world, b, lambda bb, s, d: ("f", bb, s, d), ("status", r))]

            ops += bar(0)
            ops.append(("write", ("slot", r), k))
            if barriers >= 2:
                ops += bar(1)
                ops += [("check", ("slot", j), k) for j in range(world) if j != r]
            if barriers == 3:
                ops.append(("write", ("res", r), k))
                ops += bar(2)
                ops += [("check", ("res", j), k) for j in range(world) if j != r]
        progs.append(ops)
    return progs


def _run(world: int, calls: list[int], seed: int, programs=_programs) -> None:
    rng = random.Random(seed)
    mem: dict = {}
    progs = programs(world, calls)
    pc = [0] * world
    fifo = [deque() for _ in range(world)]  # each rank's writes in flight, delivered in order
    while any(pc[r] < len(progs[r]) for r in range(world)) or any(fifo):
        moves = []
        for r in range(world):
            if fifo[r]:
                moves.append(("drain", r))
            if pc[r] < len(progs[r]):
                kind, addr, value = progs[r][pc[r]]
                if kind == "waitge" and mem.get(addr, 0) >= value:
                    moves.append(("step", r))
                elif kind != "waitge" and (kind != "wait" or mem.get(addr, 0) == value):
                    moves.append(("step", r))
        if not moves:
            stuck = [progs[r][pc[r]] if pc[r] < len(progs[r]) else None for r in range(world)]
            raise BrokenProtocol(f"deadlock at {stuck}")
        what, r = rng.choice(moves)
        if what == "drain":
            addr, value = fifo[r].popleft()
            mem[addr] = value
            continue
        kind, addr, value = progs[r][pc[r]]
        pc[r] += 1
        if kind == "write":
            fifo[r].append((addr, value))
        elif kind == "check" and mem.get(addr) != value:
            raise BrokenProtocol(f"rank {r} read {addr}={mem.get(addr)}, wanted call {value}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_no_schedule_breaks_the_protocol(world):
    rng = random.Random(world)
    for seed in range(300):
        calls = [rng.choice((2, 3)) for _ in range(6)]
        _run(world, calls, seed)


def test_one_barrier_per_call_would_be_unsafe():
    """With only B0 (no 'payloads in' barrier) a reader can see the previous call's payload."""
    world = 2

    def one_barrier_programs(world, calls):
        progs = []
        for r in range(world):
            ops = []
            for k in range(len(calls)):
                ops.append(("write", ("slot", r), k))
                ops += [(op.kind, op.address, op.value) for op in barrier_memops(
                    r, world, 0, lambda bb, s, d: ("f", bb, s, d), ("status", r))]
                ops += [("check", ("slot", j), k) for j in range(world) if j != r]
            progs.append(ops)
        return progs

    failures = 0
    for seed in range(300):
        try:
            _run(world, [1] * 5, seed, programs=one_barrier_programs)
        except BrokenProtocol:
            failures += 1
    assert failures > 0


# ---- the direct path among barrier calls ----------------------------------------------------------


def _mixed_programs(world: int, calls: list[str], parity: bool = True):
    """Per rank, the ops of `calls`: "b2"/"b3" barrier calls as above, and direct-path calls
    (`direct.py`), whose payloads go into slot (epoch & 1, rank) of their region: "ll" writes LL
    words (each carries the epoch: the reader waits for the words themselves); "1s" writes the
    native payload, then (behind the fence: this rank's writes land in order) the epoch into each
    peer's round-0 flag word, waits until every peer's word reaches it and reads; "2s" does the
    same for the message, then writes its reduced chunk and repeats with round-1 flags for the
    chunks. Epochs count direct calls; nothing is ever reset."""
    progs = []
    for r in range(world):
        ops, epoch = [], 0
        peers = [j for j in range(world) if j != r]
        for k, kind in enumerate(calls):
            tag = k + 1  # what call k writes (0 is what memory holds before any write)
            if kind in ("b2", "b3"):
                ops += [(o[0], o[1], tag) if o[0] in ("write", "check") and o[1][0] in ("slot", "res")
                        else o for o in _programs(world, [2 if kind == "b2" else 3])[r]]
                continue
            epoch += 1
            q = epoch & 1 if parity else 0
            if kind == "ll":
                ops.append(("write", ("lslot", q, r), tag))
                ops += [("wait", ("lslot", q, j), tag) for j in peers]
                ops += [("check", ("lslot", q, j), tag) for j in peers]
                continue
            rounds = [("dslot", 0)] if kind == "1s" else [("dslot", 0), ("dres", 1)]
            for region, rnd in rounds:
                ops.append(("write", (region, q, r), tag))
                ops += [("write", ("df", rnd, r, j), epoch) for j in peers]
                ops += [("waitge", ("df", rnd, j, r), epoch) for j in peers]
                ops += [("check", (region, q, j), tag) for j in peers]
        progs.append(ops)
    return progs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_direct_calls_mixed_with_barrier_calls_never_break(world):
    rng = random.Random(200 + world)
    for seed in range(300):
        calls = [rng.choice(("b2", "b3", "1s", "2s", "ll", "1s", "2s", "ll")) for _ in range(8)]
        _run(world, calls, seed, programs=lambda w, c, calls=calls: _mixed_programs(w, calls))


def test_direct_calls_need_two_parities():
    """With one payload buffer, a fast rank's next call overwrites a slot a slow reader has not
    read yet (a wrong read, or an LL reader waiting forever for an epoch already overwritten)."""
    failures = 0
    for seed in range(300):
        calls = ["1s", "2s", "ll"] * 2
        try:
            _run(3, calls, seed, programs=lambda w, c, calls=calls: _mixed_programs(w, calls, False))
        except BrokenProtocol:
            failures += 1
    assert failures > 0


def test_the_fence_is_one_write_of_the_ranks_own_word():
    """The direct path's fence between kernels: a stream memory write the driver fences after the
    stream's earlier work; it waits for nobody."""
    from glmctl.collectives.protocol import MemopSync

    ran = []
    sync = MemopSync(1, 4, lambda f, s, d: ("f", f, s, d), ("status", 1),
                     run=lambda stream, ops, prepared: ran.append((stream, ops)), fence_word=0x40)
    sync.fence(7)
    assert [(s, [(o.kind, o.address, o.value) for o in ops]) for s, ops in ran] == [
        (7, [("write", 0x40, 1)])]
    with pytest.raises(RuntimeError):
        MemopSync(0, 2, lambda f, s, d: 0, 0, run=lambda *a: None).fence(0)
