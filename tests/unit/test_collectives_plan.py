"""Plan selection for host-staged collectives: algorithm by size, payload rule, layouts that fit."""

from __future__ import annotations

import pytest

from glmctl.collectives.call_plan import (
    ALIGN,
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
    p = plan_all_reduce(numel, 2, world, one_shot_max_bytes=0)
    spans = [p.chunk_span(c) for c in range(world)]
    assert sum(n for _, n in spans) == numel
    assert all(lo * p.elem_bytes % ALIGN == 0 for lo, _ in spans)
    assert p.result_stride == p.chunk_elems * 2


def test_int8_payload_is_about_half_of_bf16():
    native = plan_all_reduce(8 * MiB // 2, 2, 4)
    q = plan_all_reduce(8 * MiB // 2, 2, 4, int8=True)
    for d in (0, 1):
        ratio = q.bytes_moved()[d] / native.bytes_moved()[d]
        assert ratio == pytest.approx((1 + 4 / 128) / 2, rel=0.02)
    assert q.layout.chunks == 4 and q.chunk_elems == q.layout.chunk_elems


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


def test_direct_path_by_size_and_never_int8():
    from glmctl.collectives.call_plan import DirectLimits

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
    from glmctl.collectives.call_plan import message_pieces

    pieces = message_pieces(3 * MiB // 2 + 5, 2, MiB)
    assert [c for _, c in pieces] == [MiB // 2, MiB // 2, MiB // 2, 5]
    assert all(lo * 2 % ALIGN == 0 for lo, _ in pieces)
    assert message_pieces(10, 4, MiB) == [(0, 10)]
    assert message_pieces(1000, 2, 100) == [(lo, min(128, 1000 - lo)) for lo in range(0, 1000, 128)]


def test_plan_call_takes_the_measured_direct_limits_for_the_rank_count():
    from glmctl.collectives.call_plan import DirectLimits, PathOptions, plan_call

    cap = slot_capacity(4 * MiB, 8)
    measured = PathOptions()
    assert plan_call("all_reduce", 16 * 1024, 2, 8, False, measured, cap).algorithm == "direct_ll"
    assert plan_call("all_reduce", 64 * 1024, 2, 8, False, measured, cap).algorithm == "direct"
    assert plan_call("all_reduce", 64 * 1024, 2, 4, False, measured, cap).algorithm == "direct_ll"
    off = PathOptions(direct=DirectLimits())
    assert plan_call("all_reduce", 16 * 1024, 2, 8, False, off, cap).algorithm == "one_shot"
    assert plan_call("all_reduce", 4 * MiB, 2, 4, False, measured, slot_capacity(MiB, 4)) is None
