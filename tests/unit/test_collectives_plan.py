"""Plan selection for host-staged collectives: algorithm by size, payload rule, layouts that fit."""

from __future__ import annotations

import pytest

from glmctl.collectives.call_plan import (
    ALIGN,
    CopyEngines,
    align_up,
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


def test_direct_path_by_size():
    from glmctl.collectives.call_plan import DirectLimits, direct_result_offset

    KiB = 1024
    lim = DirectLimits(ll_max_bytes=16 * KiB, one_shot_max_bytes=32 * KiB,
                       two_shot_max_bytes=256 * KiB, capacity=512 * KiB)
    ll = plan_all_reduce(4096, 2, 4, direct=lim)
    assert (ll.algorithm, ll.barriers) == ("direct_ll", 0)
    assert ll.bytes_moved() == (2 * 8192, 3 * 2 * 8192)  # LL: 8 bytes per 4 of payload
    one = plan_all_reduce(16 * KiB, 2, 4, direct=lim)
    assert (one.algorithm, one.slot_stride) == ("direct_1s", 512 * KiB)
    assert one.bytes_moved() == (32 * KiB, 3 * 32 * KiB)
    two = plan_all_reduce(32 * KiB, 2, 4, direct=lim)  # 64 KiB
    assert (two.algorithm, two.barriers, two.chunk_elems) == ("direct_2s", 0, 8 * KiB)
    # out: the three other chunks and the own sum; in: the own chunk of 3 peers, 3 peers' sums
    assert two.bytes_moved() == (64 * KiB, 3 * 16 * KiB + 48 * KiB)
    assert direct_result_offset(two) == 64 * KiB
    assert plan_all_reduce(256 * KiB, 2, 4, direct=lim).algorithm == "two_shot"  # 512 KiB: above
    assert plan_all_gather(1000, 4, 8, direct=lim).algorithm == "direct_ll"
    assert plan_all_gather(32 * KiB, 4, 8, direct=lim).algorithm == "direct_1s"  # one shot only
    small_area = DirectLimits(ll_max_bytes=1 << 20, capacity=8192)  # LL needs twice the message
    assert plan_all_reduce(2048, 2, 2, direct=small_area).algorithm == "direct_ll"
    assert plan_all_reduce(2049, 2, 2, direct=small_area).algorithm == "one_shot"
    tight = DirectLimits(two_shot_max_bytes=1 << 20, capacity=8192)  # message + sum must fit
    assert plan_all_reduce(3000, 2, 4, direct=tight).algorithm == "direct_2s"  # 6000 + 1504
    assert plan_all_reduce(3584, 2, 4, direct=tight).algorithm == "one_shot"  # 7168 + 1792


def test_two_shot_chunks_are_aligned_and_cover_the_message():
    from glmctl.collectives.call_plan import DirectLimits

    lim = DirectLimits(two_shot_max_bytes=1 << 20, capacity=1 << 20)
    for numel, world in ((5, 4), (1001, 3), (4096 * 32, 8), (9, 8)):
        plan = plan_all_reduce(numel, 2, world, direct=lim)
        spans = [plan.chunk_span(r) for r in range(world)]
        assert plan.chunk_elems % 8 == 0
        assert sum(count for _, count in spans) == numel
        assert all(lo == r * plan.chunk_elems for r, (lo, _) in enumerate(spans))


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
    assert plan_call("all_reduce", 1024, 2, 8, False, measured, cap).algorithm == "direct_ll"
    for world in (2, 4, 8):  # LL words to 128 KiB, then the barrier paths (the native shots: off)
        assert plan_call("all_reduce", 64 * 1024, 2, world, False, measured, cap).algorithm == "direct_ll"
        assert plan_call("all_reduce", 128 * 1024 + 8, 2, world, False, measured, cap).algorithm in (
            "one_shot", "two_shot")
    off = PathOptions(direct=DirectLimits())
    assert plan_call("all_reduce", 16 * 1024, 2, 8, False, off, cap).algorithm == "one_shot"
    assert plan_call("all_reduce", 4 * MiB, 2, 4, False, measured, slot_capacity(MiB, 4)) is None


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_int8_small_all_reduce_takes_the_direct_two_shot_records(world):
    """INT8 asked for a message the direct path takes (whichever way bf16 would go: LL, one shot
    or two) plans `direct_2s` with `world` INT8 records; gathers and larger messages do not."""
    from glmctl.collectives.call_plan import DirectLimits, direct_result_offset

    KiB = 1024
    lim = DirectLimits(ll_max_bytes=16 * KiB, one_shot_max_bytes=32 * KiB,
                       two_shot_max_bytes=256 * KiB, capacity=512 * KiB)
    for numel in (1, 7, 4096, 4096 * 4, 4096 * 32 - 3, 128 * KiB):  # up to 256 KiB of bf16
        native = plan_all_reduce(numel, 2, world, direct=lim)
        p = plan_all_reduce(numel, 2, world, int8=True, direct=lim)
        assert native.algorithm.startswith("direct") and not native.int8
        assert (p.algorithm, p.int8, p.barriers, p.d2h, p.h2d) == ("direct_2s", True, 0, "sm", "sm")
        assert p.layout == int8_layout(numel, world) and p.chunk_elems == p.layout.chunk_elems
        spans = [p.chunk_span(r) for r in range(world)]
        assert sum(n for _, n in spans) == numel
        assert all(lo == r * p.chunk_elems for r, (lo, _) in enumerate(spans))
        # records at 0, the reduced chunk's record after them, all within the slot
        assert direct_result_offset(p) == align_up(p.layout.total_bytes)
        assert direct_result_offset(p) + p.layout.record_bytes <= lim.capacity
        rec = p.layout.record_bytes
        assert p.bytes_moved() == (world * rec, 2 * (world - 1) * rec)
        assert p.key() != native.key()  # capture verification tells them apart
    # 32 tokens x 4096 bf16 (8x22k with MTP-3) at 8 ranks: ~0.52 of the native two shots' bytes
    if world == 8:
        native = plan_all_reduce(32 * 4096, 2, 8, direct=lim)
        p = plan_all_reduce(32 * 4096, 2, 8, int8=True, direct=lim)
        for d in (0, 1):
            ratio = p.bytes_moved()[d] / native.bytes_moved()[d]
            assert ratio == pytest.approx((1 + 4 / 128) / 2, rel=0.01)
    above = plan_all_reduce(128 * KiB + 1, 2, world, int8=True, direct=lim)
    assert above.algorithm in ("one_shot", "two_shot") and above.int8
    assert plan_all_gather(1000, 2, world, int8=True, direct=lim).algorithm == "gather"
    tight = DirectLimits(two_shot_max_bytes=1 << 20, capacity=4096)  # records + sum must fit
    assert plan_all_reduce(1024, 2, world, int8=True, direct=tight).algorithm == "direct_2s"
    assert plan_all_reduce(8192, 2, world, int8=True, direct=tight).algorithm in ("one_shot",
                                                                                 "two_shot")
    assert plan_all_reduce(1024, 2, world, int8=True).algorithm != "direct_2s"  # no direct area


def test_plan_call_sends_decode_sizes_as_int8_on_the_direct_two_shot_path():
    from glmctl.collectives.call_plan import PathOptions, plan_call

    cap = slot_capacity(4 * MiB, 8)
    for world in (2, 4, 8):
        for tokens in (1, 4, 8, 16):  # decode all-reduces of tokens x 4096 bf16 within the direct reach
            p = plan_call("all_reduce", tokens * 4096, 2, world, True, PathOptions(), cap)
            assert (p.algorithm, p.int8) == ("direct_2s", True), (world, tokens)
            native = plan_call("all_reduce", tokens * 4096, 2, world, False, PathOptions(), cap)
            assert not native.int8
        p = plan_call("all_reduce", 32 * 4096, 2, world, True, PathOptions(), cap)  # beyond it
        assert p.algorithm in ("one_shot", "two_shot") and p.int8
