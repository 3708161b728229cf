"""Plan selection for host-staged collectives: algorithm by size, payload rule, layouts that fit."""

from __future__ import annotations

import pytest

from glmctl.collectives.plan import (
    ALIGN,
    MAX_PIECES,
    CopyEngines,
    fits,
    int8_layout,
    plan_all_gather,
    plan_all_reduce,
    slot_capacity,
    use_int8,
)

MiB = 1 << 20


def test_two_ranks_always_one_shot():
    for nbytes in (4096, 64 * MiB):
        assert plan_all_reduce(nbytes // 2, 2, 2).algorithm == "one_shot"


def test_algorithm_by_size_for_four_ranks():
    small = plan_all_reduce(128 * 1024 // 2, 2, 4, one_shot_max_bytes=256 * 1024)
    large = plan_all_reduce(8 * MiB // 2, 2, 4, one_shot_max_bytes=256 * 1024)
    assert (small.algorithm, small.barriers) == ("one_shot", 2)
    assert (large.algorithm, large.barriers) == ("two_shot", 3)
    # reduce-scatter + all-gather reads 2(n-1)/n of the message from host memory, one-shot n-1
    one = plan_all_reduce(8 * MiB // 2, 2, 4, one_shot_max_bytes=64 * MiB)
    assert large.bytes_moved()[1] == pytest.approx(1.5 * 8 * MiB, rel=0.01)
    assert one.bytes_moved()[1] == 3 * 8 * MiB


@pytest.mark.parametrize("numel", [1, 7, 1000, 1000003, 4 * 128 * 1000 + 1])
@pytest.mark.parametrize("world", [3, 4, 8])
def test_two_shot_chunks_cover_the_message_and_stay_aligned(numel, world):
    p = plan_all_reduce(numel, 2, world, one_shot_max_bytes=0, piece_bytes=0)
    assert p.pieces == 0
    spans = [p.chunk_span(c) for c in range(world)]
    assert sum(n for _, n in spans) == numel
    assert all(lo * p.elem_bytes % ALIGN == 0 for lo, _ in spans)
    assert p.result_stride == p.chunk_elems * 2


@pytest.mark.parametrize("piece_bytes", [0, 512 * 1024, 2 * MiB])
def test_int8_payload_is_about_half_of_bf16(piece_bytes):
    native = plan_all_reduce(8 * MiB // 2, 2, 4, piece_bytes=piece_bytes)
    q = plan_all_reduce(8 * MiB // 2, 2, 4, int8=True, piece_bytes=piece_bytes)
    for d in (0, 1):
        ratio = q.bytes_moved()[d] / native.bytes_moved()[d]
        assert ratio == pytest.approx((1 + 4 / 128) / 2, rel=0.02)
    assert q.layout.chunks == 4 * max(1, q.pieces) and q.chunk_elems == q.layout.chunk_elems


@pytest.mark.parametrize("op", ["one_shot", "two_shot", "gather"])
@pytest.mark.parametrize("numel", [3000, 1 << 20, 8 * MiB + 77])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("int8", [False, True])
def test_pipelined_pieces_tile_the_message(op, numel, world, int8):
    """Pieces (two-shot: slices of `world` regions) cover every element once, start on 256-byte
    boundaries, number 1..MAX_PIECES, and INT8 records keep the message's 128-element groups."""
    if op == "two_shot" and world == 2:
        return
    kw = dict(int8=int8, engines=CopyEngines.uniform("ce"), piece_bytes=1024)
    p = (plan_all_gather(numel, 2, world, **kw) if op == "gather" else
         plan_all_reduce(numel, 2, world, one_shot_max_bytes=0 if op == "two_shot" else 1 << 40, **kw))
    assert p.algorithm == op and 1 <= p.pieces <= MAX_PIECES
    chunks = p.pieces * (world if op == "two_shot" else 1)
    spans = [p.chunk_span(c) for c in range(chunks)]
    assert sum(n for _, n in spans) == numel and spans[0][0] == 0
    assert all(a + n == b for (a, n), (b, m) in zip(spans, spans[1:], strict=False) if m)
    assert all(lo * 2 % ALIGN == 0 for lo, _ in spans)
    if int8:
        assert p.layout.chunks == chunks and p.chunk_elems % p.layout.group == 0
    if op == "two_shot":
        slices = [p.slice_span(s) for s in range(p.pieces)]
        assert sum(n for _, n in slices) == numel
    if numel > MAX_PIECES * 1024 and not int8:
        assert p.pieces == MAX_PIECES
    unpiped = (plan_all_gather(numel, 2, world, int8=int8) if op == "gather" else
               plan_all_reduce(numel, 2, world, int8=int8, piece_bytes=0,
                               one_shot_max_bytes=0 if op == "two_shot" else 1 << 40))
    # pipelining never moves more: two-shot keeps its own region's input on the device
    assert p.bytes_moved()[0] <= unpiped.bytes_moved()[0] * 1.01 + 4096
    assert p.key() != unpiped.key() or op == "gather"


def test_pipelining_only_on_the_copy_engine_both_ways():
    assert plan_all_reduce(4 * MiB, 2, 2).pieces == 4  # 8 MiB in 2 MiB pieces
    assert plan_all_reduce(4 * MiB, 2, 2, piece_bytes=0).pieces == 0
    mixed = CopyEngines(d2h_large="sm")
    assert plan_all_reduce(4 * MiB, 2, 2, engines=mixed).pieces == 0
    assert plan_all_reduce(1024, 2, 2).pieces == 0  # small messages: SM reads, one pass
    ce = CopyEngines.uniform("ce")
    assert plan_all_reduce(MiB // 2 - 1, 2, 2, engines=ce).pieces == 0  # under one piece
    assert plan_all_reduce(MiB // 2, 2, 2, engines=ce, piece_bytes=MiB).pieces == 2
    assert plan_all_reduce(1 << 30, 2, 2).pieces == MAX_PIECES


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_capacity_fits_every_plan_up_to_max_bytes(world, group):
    max_bytes = 3 * MiB + 10
    cap = slot_capacity(max_bytes, world, group)
    assert cap % 4096 == 0
    for elem in (2, 4):
        for numel in (1, 129, 65537, max_bytes // elem - 3, max_bytes // elem):
            for int8 in (False, True):
                for osm in (0, 1 << 40):
                    assert fits(plan_all_reduce(numel, elem, world, int8=int8, group=group,
                                                one_shot_max_bytes=osm), cap)
                assert fits(plan_all_gather(numel, elem, world, int8=int8, group=group), cap)
    too_big = plan_all_reduce(cap // 2 + 1, 2, world)
    assert not fits(too_big, cap)


def test_engines_by_direction_and_band():
    e = CopyEngines(d2h_small="sm", d2h_large="ce", h2d_small="sm", h2d_large="ce", band_bytes=MiB)
    assert plan_all_reduce(1024, 2, 2, engines=e).d2h == "sm"
    big = plan_all_reduce(4 * MiB, 2, 2, engines=e)
    assert (big.d2h, big.h2d) == ("ce", "ce")
    assert CopyEngines.uniform("sm").h2d(1 << 30) == "sm"


def test_int8_rule():
    assert use_int8(100, True, None) is True
    assert use_int8(1 << 30, False, 0) is False
    assert use_int8(1 << 30, None, None) is False  # no threshold configured: never implicitly
    assert use_int8(8 * MiB, None, 8 * MiB) is True
    assert use_int8(8 * MiB - 1, None, 8 * MiB) is False


def test_int8_layout_rejects_odd_groups():
    with pytest.raises(ValueError):
        int8_layout(100, 1, 100)


def test_pipelining_is_off_unless_asked(monkeypatch):
    """Measured slower on ranks sharing one GPU; opt-in until measured on separate GPUs."""
    from glmctl.collectives.communicator import default_piece_bytes

    monkeypatch.delenv("GLMCTL_COLLECTIVES_PIECE_KIB", raising=False)
    assert default_piece_bytes() == 0
    monkeypatch.setenv("GLMCTL_COLLECTIVES_PIECE_KIB", "2048")
    assert default_piece_bytes() == 2 * MiB


def test_direct_path_by_size_and_never_int8():
    from glmctl.collectives.plan import DirectLimits

    lim = DirectLimits(ll_max_bytes=16 * 1024, flag_max_bytes=256 * 1024, capacity=512 * 1024)
    assert plan_all_reduce(4096, 2, 4, direct=lim).algorithm == "direct_ll"
    flag = plan_all_reduce(64 * 1024, 2, 4, direct=lim)
    assert (flag.algorithm, flag.barriers, flag.slot_stride) == ("direct", 0, 512 * 1024)
    assert flag.bytes_moved() == (128 * 1024, 3 * 128 * 1024)
    assert plan_all_reduce(4096, 2, 4, direct=lim).bytes_moved()[0] == 2 * 8192  # LL: 8 B per 4
    assert plan_all_reduce(4096, 2, 4, int8=True, direct=lim).algorithm == "one_shot"
    assert plan_all_reduce(256 * 1024, 2, 4, direct=lim).algorithm == "two_shot"  # 512 KiB: above
    assert plan_all_gather(1000, 4, 8, direct=lim).algorithm == "direct_ll"
    small_area = DirectLimits(ll_max_bytes=1 << 20, capacity=8192)  # LL needs twice the message
    assert plan_all_reduce(2048, 2, 2, direct=small_area).algorithm == "direct_ll"
    assert plan_all_reduce(2049, 2, 2, direct=small_area).algorithm == "one_shot"


def test_messages_are_cut_into_calls_in_one_place():
    from glmctl.collectives.plan import message_pieces

    pieces = message_pieces(3 * MiB // 2 + 5, 2, MiB)
    assert [c for _, c in pieces] == [MiB // 2, MiB // 2, MiB // 2, 5]
    assert all(lo * 2 % ALIGN == 0 for lo, _ in pieces)
    assert message_pieces(10, 4, MiB) == [(0, 10)]
    assert message_pieces(1000, 2, 100) == [(lo, min(128, 1000 - lo)) for lo in range(0, 1000, 128)]


def test_plan_call_falls_back_to_unpipelined_when_pieces_overflow():
    from glmctl.collectives.plan import PathOptions, plan_call

    opts = PathOptions(engines=CopyEngines.uniform("ce"), piece_bytes=MiB)
    cap = slot_capacity(4 * MiB, 4)
    assert plan_call("all_reduce", 2 * MiB, 2, 4, False, opts, cap).pieces > 0
    assert plan_call("all_reduce", 4 * MiB, 2, 4, False, opts, slot_capacity(MiB, 4)) is None
