"""The small-message defaults (`plan.default_direct`, by rank count) against the thread rig's record
(bench/results/collectives-h200-threads.json): at every small size it measured, the path the
default plan takes is the fastest path measured there, wherever the record measured that path (a
record older than a path holds none of its rows; the rig's next run measures every path)."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from glmctl.collectives.calibration import CollectivesCalibration
from glmctl.collectives.call_plan import (
    DEFAULT_DIRECT_CAPACITY,
    DIRECT_BY_WORLD,
    Algorithm,
    DirectLimits,
    PathOptions,
    default_direct,
    plan_call,
    slot_capacity,
)
from tests.conftest import REPO

RECORD = REPO / "bench" / "results" / "collectives-h200-threads.json"
KiB, MiB = 1 << 10, 1 << 20
PATHS = set(get_args(Algorithm))


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
        if r["algorithm"] not in PATHS:  # a path the planner no longer has (the 2026-12-01 flag lines)
            continue
        cell = out.setdefault((r["ranks"], r["rank_bytes"]), {})
        k = _kind(r["algorithm"], r["d2h"], r["h2d"])
        cell[k] = min(cell.get(k, float("inf")), r["time_us"])
    # only sizes where the direct path was measured too: the small-message comparison
    return {key: cell for key, cell in out.items() if any(k[0].startswith("direct") for k in cell)}


# A gather may be up to 10% off its best path: both ops share one limit per rank count, set by the
# all-reduce (90 calls per decode step against one logits gather).
@pytest.mark.parametrize(("op", "elem_bytes", "tolerance", "min_cells"), [("all_reduce", 2, 1.02, 6),
                                                                          ("all_gather", 4, 1.10, 3)])
def test_the_default_path_is_the_fastest_measured(op, elem_bytes, tolerance, min_cells):
    doc = _record()
    engines = CollectivesCalibration.model_validate(doc["meta"]["calibration"]).engines()
    cells = _measured(op)
    assert {n for n, _ in cells} == {2, 4, 8} and len(cells) >= min_cells
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
    for n in (2, 4, 8):  # LL words only: the native one- and two-shot paths measured slow (2026-12-06)
        lim = default_direct(n)
        assert lim.ll_max_bytes >= 32 * KiB and lim.one_shot_max_bytes == lim.two_shot_max_bytes == 0
    assert default_direct(3) == default_direct(4)  # the next measured count up
    assert default_direct(5) == default_direct(16) == default_direct(8)  # beyond 8: the 8-rank limits
    assert default_direct(8, capacity=8192).capacity == 8192
    for n, lim in DIRECT_BY_WORLD.items():  # every size up to a limit fits the default area
        assert DirectLimits(ll_max_bytes=lim.ll_max_bytes, capacity=DEFAULT_DIRECT_CAPACITY).algorithm(
            "all_reduce", lim.ll_max_bytes // 2, 2, n) == "direct_ll"
        assert 2 * lim.ll_max_bytes <= DEFAULT_DIRECT_CAPACITY
