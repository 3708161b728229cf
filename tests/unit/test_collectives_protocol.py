"""The flag protocol, model-checked: ranks run the real flag operations (`barrier_memops`,
`arrive_memops`, `await_memops`) around modelled payload writes and reads, under random schedules
in which every stream's writes reach memory late but in order (posted writes behind a fence). No
schedule may deadlock, read a payload of the wrong call, or overwrite a payload before every peer
has read it. Unpipelined calls run on one stream; pipelined calls (`pipeline.py`) on two per rank,
forked and joined by events, with per-piece flags. The same model shows why one barrier per call is
not enough, and why a pipelined call needs its B0 and its in-place event."""

from __future__ import annotations

import random
from collections import deque

import pytest

from glmctl.collectives.protocol import arrive_memops, await_memops, barrier_memops


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
    """Per rank, the ops of `calls`: "b2"/"b3" barrier calls as above, "flag" and "ll" direct-path
    calls (`direct.py`): the payload into slot (epoch & 1, rank) of the direct area, then, for
    "flag", the epoch into each peer's flag word (after the payload: the release) and a wait
    until every peer's word reaches it; for "ll" the payload word itself carries the epoch and the
    reader waits for it. Epochs count direct calls; nothing is ever reset."""
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
            ops.append(("write", ("dslot", q, r), tag))
            if kind == "flag":
                ops += [("write", ("df", r, j), epoch) for j in peers]
                ops += [("waitge", ("df", j, r), epoch) for j in peers]
            else:
                ops += [("wait", ("dslot", q, j), tag) for j in peers]
            ops += [("check", ("dslot", q, j), tag) for j in peers]
        progs.append(ops)
    return progs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_direct_calls_mixed_with_barrier_calls_never_break(world):
    rng = random.Random(200 + world)
    for seed in range(300):
        calls = [rng.choice(("b2", "b3", "flag", "ll", "flag", "ll")) for _ in range(8)]
        _run(world, calls, seed, programs=lambda w, c, calls=calls: _mixed_programs(w, calls))


def test_direct_calls_need_two_parities():
    """With one payload buffer, a fast rank's next call overwrites a slot a slow reader has not
    read yet (a wrong read, or an LL reader waiting forever for an epoch already overwritten)."""
    failures = 0
    for seed in range(300):
        calls = ["flag", "ll"] * 3
        try:
            _run(3, calls, seed, programs=lambda w, c, calls=calls: _mixed_programs(w, calls, False))
        except BrokenProtocol:
            failures += 1
    assert failures > 0


# ---- pipelined calls: two streams per rank ------------------------------------------------------


def _flag(f, src, dst):
    return ("f", f, src, dst)


def _pipelined_programs(world: int, calls: list[tuple[str, int]], *, b0: bool = True,
                        in_place_event: bool = True):
    """Per rank, the (side stream, main stream) op lists of `calls`, each ("one_shot" | "two_shot",
    pieces), in the order `pipeline.py` enqueues them. Ops beyond `_run`'s: ("record", ev),
    ("waitev", ev), and "x" ops on the rank's own device memory: ("xset", part, state) and
    ("xcheck", part, state) (the in-place buffer: a piece must leave on the side stream before the
    main stream overwrites it, and a result must exist before it leaves)."""
    return [_rank_program(world, r, calls, b0, in_place_event) for r in range(world)]


def _rank_program(world, r, calls, b0, in_place_event):
    side: list = []
    main: list = []
    peers = [j for j in range(world) if j != r]

    def memops(ops):
        return [(op.kind, op.address, op.value) for op in ops]

    def arrive(f):
        side.extend(memops(arrive_memops(r, world, f, _flag)))

    def await_(f):
        main.extend(memops(await_memops(r, world, f, _flag, ("status", r))))

    for k, (kind, pieces) in enumerate(calls):
        main.extend(("xset", ("x", p), ("in", k)) for p in range(pieces))  # the caller's input
        if b0:
            main.extend(memops(barrier_memops(r, world, 0, _flag, ("status", r))))
        main.append(("record", (k, "fork")))
        side.append(("waitev", (k, "fork")))
        if kind == "one_shot":
            for p in range(pieces):
                side.extend([("xcheck", ("x", p), ("in", k)), ("write", ("slot", r, p), k)])
                arrive(3 + p)
                side.append(("record", (k, "piece", p)))
            for p in range(pieces):
                await_(3 + p)
                main.extend(("check", ("slot", j, p), k) for j in peers)
                if in_place_event:
                    main.append(("waitev", (k, "piece", p)))
                main.append(("xset", ("x", p), ("out", k)))  # reduce, in place
        else:
            for s in range(pieces + 1):
                if s < pieces:  # send slice s: every region but the own one
                    side.extend([("xcheck", ("x", s), ("in", k)), ("write", ("slot", r, s), k)])
                    arrive(3 + s)
                if s:  # send the own result of slice s - 1, once reduced
                    side.extend([("waitev", (k, "reduced", s - 1)),
                                 ("xcheck", ("own", s - 1), ("out", k)),
                                 ("write", ("res", r, s - 1), k)])
                    arrive(3 + pieces + s - 1)
                if s < pieces:  # reduce the own region of slice s
                    await_(3 + s)
                    main.extend(("check", ("slot", j, s), k) for j in peers)
                    main.extend([("xset", ("own", s), ("out", k)), ("record", (k, "reduced", s))])
                if s:  # the other owners' results of slice s - 1, in place
                    await_(3 + pieces + s - 1)
                    main.extend(("check", ("res", j, s - 1), k) for j in peers)
                    main.append(("xset", ("x", s - 1), ("out", k)))
        side.append(("record", (k, "join")))
        main.append(("waitev", (k, "join")))
    return side, main


def _run_streams(world: int, progs, seed: int) -> None:
    rng = random.Random(seed)
    mem: dict = {}
    local = [dict() for _ in range(world)]
    events: set = set()
    streams = [(r, i) for r in range(world) for i in range(2)]
    ops = {(r, i): progs[r][i] for r, i in streams}
    pc = dict.fromkeys(streams, 0)
    fifo = {s: deque() for s in streams}

    def op_at(s):
        op = ops[s][pc[s]]
        return op if len(op) == 3 else (*op, None)

    def enabled(s):
        kind, a, v = op_at(s)
        return (kind != "wait" or mem.get(a, 0) == v) and (kind != "waitev" or (s[0], a) in events)

    while any(pc[s] < len(ops[s]) for s in streams) or any(fifo.values()):
        moves = [("drain", s) for s in streams if fifo[s]]
        moves += [("step", s) for s in streams if pc[s] < len(ops[s]) and enabled(s)]
        if not moves:
            stuck = {s: ops[s][pc[s]] for s in streams if pc[s] < len(ops[s])}
            raise BrokenProtocol(f"deadlock at {stuck}")
        what, s = rng.choice(moves)
        if what == "drain":
            addr, value = fifo[s].popleft()
            mem[addr] = value
            continue
        kind, a, v = op_at(s)
        pc[s] += 1
        r = s[0]
        if kind == "write":
            fifo[s].append((a, v))
        elif kind == "check" and mem.get(a) != v:
            raise BrokenProtocol(f"rank {r} read {a}={mem.get(a)}, wanted call {v}")
        elif kind == "record":
            events.add((r, a))  # a rank's events are its own
        elif kind == "xset":
            local[r][a] = v
        elif kind == "xcheck" and local[r].get(a) != v:
            raise BrokenProtocol(f"rank {r}'s {a} is {local[r].get(a)} when it leaves, not {v}")


def _random_calls(rng, n=5):
    return [(rng.choice(("one_shot", "two_shot")), rng.choice((1, 2, 3))) for _ in range(n)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_no_schedule_breaks_the_pipelined_protocol(world):
    rng = random.Random(100 + world)
    for seed in range(150):
        calls = _random_calls(rng)
        if world == 2:  # two-shot needs three ranks
            calls = [("one_shot", p) for _, p in calls]
        _run_streams(world, _pipelined_programs(world, calls), seed)


@pytest.mark.parametrize("broken", ["no B0", "no in-place event"])
def test_a_pipelined_call_needs_b0_and_the_in_place_event(broken):
    """Without B0 a fast writer overwrites a piece a slow reader has not read yet (or raises a flag
    its reader has not reset); without the event, a reduce in place can overwrite a piece before
    the side stream has copied it out."""
    world = 3 if broken == "no B0" else 2
    failures = 0
    for seed in range(150):
        calls = [("one_shot", 2)] * 4
        progs = _pipelined_programs(world, calls, b0=broken != "no B0",
                                    in_place_event=broken != "no in-place event")
        try:
            _run_streams(world, progs, seed)
        except BrokenProtocol:
            failures += 1
    assert failures > 0
