"""Plan selection for host-staged collectives: algorithm by size, payload rule, layouts that fit."""

from __future__ import annotations

import pytest

from glmctl.collectives.plan import (
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
    ratio = q.bytes_moved()[1] / native.bytes_moved()[1]
    assert ratio == pytest.approx((1 + 4 / 128) / 2, rel=0.01)
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
