"""The shared host segment on CPU: create, attach from another process, rendezvous, unlink after
attach, and cleanup of a segment whose creator crashed."""

from __future__ import annotations

import os
import time

import pytest

from glmctl.collectives.collective_errors import PeerLostError, SegmentError
from glmctl.collectives.segment import (
    FLAGS,
    GPU_WORDS_OFFSET,
    MAX_WORLD,
    R_PID,
    R_STATE,
    STATE_ATTACHED,
    SharedSegment,
    header_bytes,
    pid_alive,
    segment_bytes,
    sweep_stale,
)

CAP = 64 * 1024


@pytest.fixture(autouse=True)
def _shm_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMCTL_SHM_DIR", str(tmp_path))
    return tmp_path


def _names(path):
    return sorted(os.listdir(path))


def _fork(fn) -> int:
    """Run fn in a forked child that exits with fn's return code (0 also on success)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            code = fn() or 0
        finally:
            os._exit(code)
    return pid


def test_create_attach_rendezvous_and_unlink(tmp_path):
    seg = SharedSegment.create("grp", 2, CAP)
    assert _names(tmp_path) == [f"glmctl-coll-grp-{os.getpid()}"]
    assert os.path.getsize(seg.path) == segment_bytes(2, CAP)

    def child():
        peer = SharedSegment.attach("grp", 1, 2, CAP, timeout_s=10)
        peer.set_word_at(peer.data_offset + CAP, 0xC0FFEE)  # into slot 1
        peer.host_barrier(10, "test")
        # rank 0 unlinks after the barrier; the mapping keeps working
        deadline = time.monotonic() + 10
        while os.path.exists(peer.path) and time.monotonic() < deadline:
            time.sleep(0.01)
        ok = not os.path.exists(peer.path) and peer.word_at(peer.data_offset) == 0xBEEF
        peer.close()
        return 0 if ok else 3

    pid = _fork(child)
    seg.set_word_at(seg.data_offset, 0xBEEF)
    seg.host_barrier(10, "test")
    assert seg.rank_word(1, R_PID) == pid and seg.rank_word(1, R_STATE) == STATE_ATTACHED
    assert seg.word_at(seg.data_offset + CAP) == 0xC0FFEE
    seg.unlink()
    assert os.waitpid(pid, 0)[1] == 0
    assert _names(tmp_path) == []
    seg.close()


def test_segment_of_a_crashed_creator_is_swept(tmp_path):
    def crash_after_create():
        SharedSegment.create("dead", 2, CAP)
        os._exit(9)  # no unlink, no close: what a SIGKILL during start-up leaves

    pid = _fork(crash_after_create)
    os.waitpid(pid, 0)
    assert _names(tmp_path) == [f"glmctl-coll-dead-{pid}"]
    assert not pid_alive(pid)
    # a half-made segment (crash before the rename) is swept too
    (tmp_path / f"glmctl-coll-other-{pid}.init").write_bytes(b"x")
    mine = SharedSegment.create("live", 2, CAP)  # creating sweeps what dead creators left
    assert _names(tmp_path) == [f"glmctl-coll-live-{os.getpid()}"]
    assert sweep_stale(tmp_path) == []  # a live creator's segment is never touched
    mine.unlink()
    mine.close()


def test_attach_rejects_a_mismatched_group(tmp_path):
    seg = SharedSegment.create("g2", 2, CAP)
    with pytest.raises(SegmentError, match="expects"):
        SharedSegment.attach("g2", 1, 3, CAP, timeout_s=1)
    seg.unlink()
    seg.close()


def test_attach_times_out_with_a_hint():
    with pytest.raises(SegmentError, match="found no collectives segment"):
        SharedSegment.attach("nobody", 1, 2, CAP, timeout_s=0.2)


def test_host_barrier_names_a_peer_that_died():
    seg = SharedSegment.create("bar", 3, CAP)

    def attach_and_die():
        peer = SharedSegment.attach("bar", 2, 3, CAP, timeout_s=10)
        assert peer is not None
        os._exit(0)

    pid = _fork(attach_and_die)
    os.waitpid(pid, 0)
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match=f"rank 2 \\(pid {pid}\\) exited") as info:
        seg.host_barrier(30, "start-up")
    assert info.value.rank == 2
    assert time.monotonic() - t0 < 2
    seg.unlink()
    seg.close()


def test_space_check_names_the_fix(tmp_path, monkeypatch):
    import glmctl.collectives.segment as segmod

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(segmod.os, "statvfs", lambda _p: Tiny())
    with pytest.raises(SegmentError) as info:
        SharedSegment.create("big", 2, CAP)
    assert "shm-size" in info.value.hint
    assert _names(tmp_path) == []


@pytest.mark.parametrize("world", [2, 3, 8, MAX_WORLD])
def test_every_flag_line_lies_between_the_gpu_words_and_the_data(world):
    seg = SharedSegment.create(f"lay{world}", world, CAP)
    try:
        offsets = sorted(seg.flag_offset(f, s, d) for f in range(FLAGS) for s in range(world)
                         for d in range(world))
        assert len(set(offsets)) == FLAGS * world * world  # one 64-byte line each
        assert offsets[0] >= GPU_WORDS_OFFSET + 128 * MAX_WORLD
        assert offsets[-1] + 64 <= seg.data_offset == header_bytes(world)
        assert seg.data_offset % 65536 == 0 and seg.size == segment_bytes(world, CAP)
        assert seg.result_offset == seg.data_offset + world * CAP
    finally:
        seg.unlink()
        seg.close()


def test_direct_area_and_lines_fit_and_views_share_the_mapping(tmp_path):
    from glmctl.collectives.segment import DIRECT_ROUNDS, direct_flags_offset

    world, direct = 4, 8192
    seg = SharedSegment.create("direct", world, CAP, direct)
    try:
        assert seg.size == segment_bytes(world, CAP, direct) == os.path.getsize(seg.path)
        last_flag = max(seg.flag_offset(f, s, d) for f in range(FLAGS) for s in range(world)
                        for d in range(world))
        lines = [seg.direct_flag_offset(c, d) for c in range(DIRECT_ROUNDS) for d in range(world)]
        assert min(lines) == direct_flags_offset(world) > last_flag
        assert max(lines) + 64 <= seg.data_offset
        # the LL region, then the native one, each two parities of world slots
        assert seg.direct_native_offset == seg.direct_offset + 2 * world * direct
        assert seg.direct_native_offset + 2 * world * direct == seg.size
        words = {f(r) for r in range(world) for f in (seg.status_offset, seg.direct_epoch_offset,
                                                      seg.fence_offset, seg.progress_offset)}
        assert len(words) == 4 * world  # status, epoch, fence and progress words never overlap
        view = seg.view(2)
        assert (view.rank, view.address) == (2, seg.address)
        view.set_word_at(seg.direct_epoch_offset(2), 5)
        assert seg.word_at(seg.direct_epoch_offset(2)) == 5
        view.close()  # a view leaves the mapping alone
        assert seg.words is not None
    finally:
        seg.unlink()
        seg.close()
