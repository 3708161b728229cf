"""The small-message defaults (`plan.default_direct`, by rank count) against the thread rig's record
(bench/results/collectives-h200-threads.json): at every small size it measured, the path the
default plan takes is the fastest path measured there, wherever the record measured that path (a
record older than a path holds none of its rows; the rig's next run measures every path)."""

from __future__ import annotations

import json

import pytest

from glmctl.collectives.calibration import CollectivesCalibration
from glmctl.collectives.call_plan import (
    DEFAULT_DIRECT_CAPACITY,
    DIRECT_BY_WORLD,
    DirectLimits,
    PathOptions,
    default_direct,
    plan_call,
    slot_capacity,
)
from tests.conftest import REPO

RECORD = REPO / "bench" / "results" / "collectives-h200-threads.json"
KiB, MiB = 1 << 10, 1 << 20


def _record():
    return json.loads(RECORD.read_text())


def _kind(algorithm: str, d2h: str, h2d: str) -> tuple:
    """What a measured row ran: the direct path's payload format, or the barrier path's engines."""
    return (algorithm,) if algorithm.startswith("direct") else (algorithm, d2h, h2d)


def _measured(op: str) -> dict:
    """(ranks, bytes per rank) -> {kind: fastest captured time, us} over every variant measured."""
    out: dict = {}
    for r in _record()["rows"]:
        if r["op"] != op or r["graph"] != "captured" or r["dtype"] == "int8" or r["wrong"]:
            continue
        cell = out.setdefault((r["ranks"], r["rank_bytes"]), {})
        k = _kind(r["algorithm"], r["d2h"], r["h2d"])
        cell[k] = min(cell.get(k, float("inf")), r["time_us"])
    # only sizes where the direct path was measured too: the small-message comparison
    return {key: cell for key, cell in out.items() if any(k[0].startswith("direct") for k in cell)}


# A gather may be up to 10% off its best path: both ops share one limit per rank count, set by the
# all-reduce (90 calls per decode step against one logits gather).
@pytest.mark.parametrize(("op", "elem_bytes", "tolerance"), [("all_reduce", 2, 1.02),
                                                             ("all_gather", 4, 1.10)])
def test_the_default_path_is_the_fastest_measured(op, elem_bytes, tolerance):
    doc = _record()
    engines = CollectivesCalibration.model_validate(doc["meta"]["calibration"]).engines()
    cells = _measured(op)
    assert {n for n, _ in cells} == {2, 4, 8} and len(cells) >= 6
    checked = set()
    for (n, nbytes), cell in sorted(cells.items()):
        plan = plan_call(op, nbytes // elem_bytes, elem_bytes, n, False, PathOptions(engines=engines),
                         slot_capacity(4 * MiB, n))
        mine = cell.get(_kind(plan.algorithm, plan.d2h, plan.h2d))
        if mine is None:
            continue
        checked.add(n)
        best = min(cell.values())
        assert mine <= best * tolerance, (n, nbytes, plan.algorithm, mine, cell)
    assert checked == {2, 4, 8} if op == "all_reduce" else checked, checked


def test_the_limits_by_rank_count():
    assert default_direct(2).two_shot_max_bytes == 0  # two shots move no fewer bytes at 2 ranks
    four, eight = default_direct(4), default_direct(8)
    assert four.ll_max_bytes < four.one_shot_max_bytes < four.two_shot_max_bytes
    assert eight.ll_max_bytes < eight.one_shot_max_bytes < eight.two_shot_max_bytes
    assert eight.two_shot_max_bytes >= 48 * 4096 * 2  # every decode all-reduce, 48 tokens
    assert default_direct(3) == default_direct(4)  # the next measured count up
    assert default_direct(5) == default_direct(16) == eight  # beyond 8: the 8-rank limits
    assert default_direct(8, capacity=8192).capacity == 8192
    for n, lim in DIRECT_BY_WORLD.items():  # every size up to a limit fits the default area
        assert DirectLimits(ll_max_bytes=lim.ll_max_bytes, capacity=DEFAULT_DIRECT_CAPACITY).algorithm(
            "all_reduce", lim.ll_max_bytes // 2, 2, n) in ("direct_ll", None)
        assert 2 * lim.ll_max_bytes <= DEFAULT_DIRECT_CAPACITY
        top = max(lim.one_shot_max_bytes, lim.two_shot_max_bytes)
        assert default_direct(n).algorithm("all_reduce", top // 2, 2, n) is not None
