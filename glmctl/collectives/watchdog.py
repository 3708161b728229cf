"""Deadlines for waits the GPU does in a stream: a host thread that notices a lost peer and unblocks.

A stream memory wait has no timeout of its own, so each rank runs this thread. It reads, from the
shared segment, the rank's own status word (written by its GPU stream: `2f+1` on starting to wait
at barrier f, `2f+2` after passing it; f = DIRECT while a direct-path kernel polls), its progress
word (bumped by the last kernel of every call), its incoming flags (for DIRECT: whether each
peer's direct-path epoch word has reached this rank's), and every peer's pid and state. It declares the group broken when

- a peer process is gone (exited or a zombie) without closing its communicator: at once;
- this rank waits at a barrier for a peer that closed its communicator: at once;
- this rank waits at a barrier and neither its status nor its progress changed for `timeout_s`:
  the peers whose flag has not arrived are named as stalled.

Then it records the error (the next call on the communicator raises it), writes the culprit into the
header so the other ranks stop with the same diagnosis, and keeps writing 1 into this rank's incoming
flags, so that whatever the GPU already has queued, graph replays included, runs to its end instead
of hanging (a direct-path kernel gives up on its own once the abort word is set). The data those
calls produce is garbage; the error says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from glmctl.collectives.collective_errors import CollectiveError, PeerLostError
from glmctl.collectives.protocol import waiting_flag
from glmctl.collectives.segment import (
    DIRECT,
    FLAGS,
    R_PID,
    R_STATE,
    REASONS,
    STATE_CLOSED,
    SharedSegment,
    pid_alive,
)

REASON_EXITED, REASON_STALLED, REASON_CLOSED = 1, 2, 3


@dataclass(frozen=True)
class Peer:
    rank: int
    pid: int
    closed: bool
    alive: bool


@dataclass(frozen=True)
class Snapshot:
    rank: int
    status: int
    progress: int
    incoming: tuple[tuple[int, ...], ...]  # incoming[f][j]: flag f from rank j
    peers: tuple[Peer, ...]
    abort: tuple[int, int] | None


@dataclass(frozen=True)
class Verdict:
    culprit: int
    reason: int
    message: str


def diagnose(snap: Snapshot, unchanged_s: float, timeout_s: float) -> Verdict | None:
    """Is the group broken, and whose fault is it? Pure, so the unit lane can test every branch."""
    if snap.abort is not None:
        culprit, reason = snap.abort
        what = REASONS.get(reason, "failed")
        return Verdict(culprit, reason, f"rank {culprit} {what}; the collective group is broken")
    for p in snap.peers:
        if p.rank != snap.rank and not p.closed and p.pid and not p.alive:
            return Verdict(p.rank, REASON_EXITED,
                           f"rank {p.rank} (pid {p.pid}) exited; the collective group is broken")
    b = waiting_flag(snap.status)
    if b is None:
        return None
    pending = [j for j, flag in enumerate(snap.incoming[b]) if j != snap.rank and flag == 0]
    for j in pending:
        if snap.peers[j].closed:
            return Verdict(j, REASON_CLOSED,
                           f"rank {snap.rank} waits at {_where(b)} for rank {j}, which closed its "
                           "communicator")
    if pending and unchanged_s >= timeout_s:
        j = pending[0]
        return Verdict(j, REASON_STALLED,
                       f"rank {j} (pid {snap.peers[j].pid}) made no progress for {unchanged_s:.1f} s: "
                       f"rank {snap.rank} waits at {_where(b)} for rank(s) {pending}")
    return None


def _where(f: int) -> str:
    if f == DIRECT:
        return "a direct-path call"
    return f"barrier {f}"


class StallClock:
    """How long (status, progress) has stayed the same: the input `diagnose` needs."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None
        self._since = 0.0

    def unchanged_for(self, status: int, progress: int, now: float) -> float:
        if (status, progress) != self._last:
            self._last, self._since = (status, progress), now
        return now - self._since


def snapshot(seg: SharedSegment) -> Snapshot:
    me = seg.rank
    peers = []
    for j in range(seg.world):
        pid = seg.rank_word(j, R_PID)
        closed = seg.rank_word(j, R_STATE) == STATE_CLOSED
        alive = True if (j == me or closed or not pid) else pid_alive(pid)
        peers.append(Peer(j, pid, closed, alive))
    incoming = tuple(
        tuple(seg.word_at(seg.flag_offset(f, j, me)) for j in range(seg.world)) for f in range(FLAGS)
    )
    mine = seg.word_at(seg.direct_epoch_offset(me))
    ahead = tuple(int(((seg.word_at(seg.direct_epoch_offset(j)) - mine) & 0xFFFFFFFF) < 1 << 31)
                  for j in range(seg.world))
    incoming += (ahead,)  # index DIRECT: 1 where peer j has started this rank's direct call
    return Snapshot(
        rank=me,
        status=seg.word_at(seg.status_offset(me)),
        progress=seg.word_at(seg.progress_offset(me)),
        incoming=incoming,
        peers=tuple(peers),
        abort=seg.abort,
    )


class Watchdog:
    def __init__(self, seg: SharedSegment, timeout_s: float, *, poll_s: float = 0.02,
                 on_error: Callable[[CollectiveError], None] | None = None) -> None:
        self.seg, self.timeout_s, self.poll_s, self.on_error = seg, timeout_s, poll_s, on_error
        self.error: CollectiveError | None = None
        self._stop = threading.Event()
        self._clock = StallClock()
        self._thread = threading.Thread(target=self._run, name=f"glmctl-coll-watchdog-{seg.rank}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def fail(self, culprit: int, reason: int, message: str) -> None:
        """Declare the group broken from this process (used by the watchdog and by the communicator)."""
        if self.error is not None:
            return
        self.seg.set_abort(culprit, reason)
        self.error = PeerLostError(
            message, rank=culprit,
            hint="every rank of the group must run the same collectives; restart the whole group",
        )
        if self.on_error is not None:
            try:
                self.on_error(self.error)
            except Exception:  # noqa: BLE001 - a faulty callback must not kill the watchdog
                pass

    def release(self) -> None:
        """Satisfy every wait this rank's GPU has queued (abort mode only: it breaks single-writer)."""
        seg = self.seg
        for f in range(FLAGS):
            for j in range(seg.world):
                if j != seg.rank:
                    seg.set_word_at(seg.flag_offset(f, j, seg.rank), 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.error is None:
                    snap = snapshot(self.seg)
                    unchanged = self._clock.unchanged_for(snap.status, snap.progress, time.monotonic())
                    verdict = diagnose(snap, unchanged, self.timeout_s)
                    if verdict is not None:
                        self.fail(verdict.culprit, verdict.reason, verdict.message)
                if self.error is not None:
                    self.release()
                    self._stop.wait(0.002)
                else:
                    self._stop.wait(self.poll_s)
            except Exception:  # noqa: BLE001 - the segment went away under us during close()
                if self._stop.is_set():
                    return
                self._stop.wait(self.poll_s)
