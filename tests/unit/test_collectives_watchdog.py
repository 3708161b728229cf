"""Deadline logic of the collectives' watchdog, without CUDA: the diagnosis of a snapshot, and the
thread on a real segment declaring a stalled or exited peer and releasing this rank's waits."""

from __future__ import annotations

import os
import time

import pytest

from glmctl.collectives.protocol import waiting_barrier
from glmctl.collectives.segment import BARRIERS, FLAGS, R_PID, SharedSegment
from glmctl.collectives.watchdog import (
    REASON_CLOSED,
    REASON_EXITED,
    REASON_STALLED,
    Peer,
    Snapshot,
    StallClock,
    Watchdog,
    diagnose,
)


def _snap(status=0, progress=0, incoming=None, peers=None, abort=None, rank=0, world=3):
    incoming = incoming or tuple(tuple(0 for _ in range(world)) for _ in range(3))
    peers = peers or tuple(Peer(j, 100 + j, False, True) for j in range(world))
    return Snapshot(rank, status, progress, incoming, peers, abort)


def test_status_words():
    assert waiting_barrier(0) is None
    assert [waiting_barrier(s) for s in (1, 2, 3, 4, 5, 6)] == [0, None, 1, None, 2, None]


def test_waiting_on_a_silent_peer_is_a_stall_only_after_the_timeout():
    incoming = ((0, 1, 0), (0, 0, 0), (0, 0, 0))  # barrier 0: rank 1 arrived, rank 2 did not
    snap = _snap(status=1, incoming=incoming)
    assert diagnose(snap, unchanged_s=4.9, timeout_s=5) is None
    v = diagnose(snap, unchanged_s=5.0, timeout_s=5)
    assert (v.culprit, v.reason) == (2, REASON_STALLED)
    assert "rank 2" in v.message and "barrier 0" in v.message


def test_a_wait_at_the_last_barrier_names_it():
    incoming = [(0, 0, 0)] * FLAGS
    incoming[BARRIERS - 1] = (0, 1, 0)  # two-shot's B2: rank 1 arrived, rank 2 did not
    snap = _snap(status=2 * (BARRIERS - 1) + 1, incoming=tuple(incoming))
    v = diagnose(snap, unchanged_s=5.0, timeout_s=5)
    assert v.culprit == 2 and f"barrier {BARRIERS - 1}" in v.message


def test_idle_ranks_are_never_stalled():
    assert diagnose(_snap(status=4), unchanged_s=1e6, timeout_s=5) is None
    closed = tuple(Peer(j, 100 + j, j == 1, True) for j in range(3))
    assert diagnose(_snap(status=2, peers=closed), unchanged_s=0, timeout_s=5) is None


def test_exited_peer_is_named_at_once():
    peers = (Peer(0, 100, False, True), Peer(1, 101, False, False), Peer(2, 102, False, True))
    v = diagnose(_snap(peers=peers), unchanged_s=0, timeout_s=5)
    assert (v.culprit, v.reason) == (1, REASON_EXITED)
    assert "pid 101" in v.message


def test_waiting_on_a_closed_peer_is_named_at_once():
    peers = (Peer(0, 100, False, True), Peer(1, 101, True, True), Peer(2, 102, False, True))
    incoming = ((0, 0, 1), (0, 0, 0), (0, 0, 0))
    v = diagnose(_snap(status=1, incoming=incoming, peers=peers), unchanged_s=0, timeout_s=5)
    assert (v.culprit, v.reason) == (1, REASON_CLOSED)


def test_a_verdict_of_another_rank_is_adopted():
    v = diagnose(_snap(abort=(2, REASON_EXITED)), unchanged_s=0, timeout_s=5)
    assert v.culprit == 2 and "rank 2 exited" in v.message


def test_stall_clock_restarts_on_any_change():
    clock = StallClock()
    assert clock.unchanged_for(1, 7, now=10.0) == 0
    assert clock.unchanged_for(1, 7, now=13.0) == 3
    assert clock.unchanged_for(1, 8, now=14.0) == 0  # progress moved: a slow call, not a stall
    assert clock.unchanged_for(3, 8, now=15.0) == 0


@pytest.fixture
def seg(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMCTL_SHM_DIR", str(tmp_path))
    s = SharedSegment.create("wd", 2, 4096)
    s.set_rank_word(1, R_PID, os.getpid())  # a live stand-in for rank 1
    yield s
    s.unlink()
    s.close()


def test_watchdog_declares_a_stall_and_releases_the_waits(seg):
    errors = []
    seg.set_word_at(seg.status_offset(0), 2 * (BARRIERS - 1) + 1)  # waits at the last barrier
    dog = Watchdog(seg, timeout_s=0.3, poll_s=0.01, on_error=errors.append)
    t0 = time.monotonic()
    dog.start()
    try:
        while dog.error is None and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert dog.error is not None and dog.error.rank == 1
        assert 0.3 <= time.monotonic() - t0 < 2
        assert errors == [dog.error]
        time.sleep(0.05)
        assert all(seg.word_at(seg.flag_offset(f, 1, 0)) == 1 for f in range(FLAGS))
        assert seg.abort == (1, REASON_STALLED)
    finally:
        dog.stop()


def test_watchdog_names_a_peer_that_exited(seg):
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0)
    os.waitpid(pid, 0)
    seg.set_rank_word(1, R_PID, pid)
    dog = Watchdog(seg, timeout_s=60, poll_s=0.01)
    dog.start()
    try:
        t0 = time.monotonic()
        while dog.error is None and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert dog.error is not None and f"pid {pid}" in str(dog.error)
        assert time.monotonic() - t0 < 1
    finally:
        dog.stop()


def test_a_direct_path_wait_names_the_peer_whose_epoch_lags(seg):
    from glmctl.collectives.segment import DIRECT
    from glmctl.collectives.watchdog import snapshot

    seg.set_word_at(seg.direct_epoch_offset(0), 7)  # rank 0 started its 7th direct call
    seg.set_word_at(seg.direct_epoch_offset(1), 6)  # rank 1 is still at its 6th
    seg.set_word_at(seg.status_offset(0), 2 * DIRECT + 1)
    snap = snapshot(seg)
    assert snap.incoming[DIRECT] == (1, 0)
    v = diagnose(snap, unchanged_s=5.0, timeout_s=5)
    assert v.culprit == 1 and "direct-path" in v.message
    seg.set_word_at(seg.direct_epoch_offset(1), 7)
    assert diagnose(snapshot(seg), unchanged_s=5.0, timeout_s=5) is None
