"""The collectives' cost model (pure Python): what it predicts for the report's node, how it splits
a call into latency and data terms, and how it fits protocol costs from the thread rig's rows."""

from __future__ import annotations

import subprocess
import sys

import pytest

from glmctl.collectives import cost_model as cm
from glmctl.collectives.call_plan import plan_all_reduce

MiB = 1 << 20
COSTS = cm.ProtocolCosts("test", {p: (10.0, 1.0) for p in (
    "one_shot", "two_shot", "gather", "direct", "direct_ll")})


def test_small_messages_are_latency_and_large_ones_host_memory_on_8_l40s():
    small = cm.breakdown("all_reduce", 8, 8192, costs=COSTS)
    assert small.bound == "latency" and small.latency_s == pytest.approx(17e-6)
    big = cm.breakdown("all_reduce", 8, 16 * MiB, costs=COSTS)
    assert (big.path, big.bound) == ("two_shot", "host memory")
    d2h, h2d = plan_all_reduce(8 * MiB, 2, 8).bytes_moved()
    assert big.host_s == pytest.approx(8 * (d2h + h2d) / 100e9)
    assert big.link_s == pytest.approx(d2h / 25e9 + h2d / 25e9)
    assert big.seconds == pytest.approx(big.latency_s + big.host_s)


def test_time_grows_with_the_message_and_int8_about_halves_large_ones():
    sizes = [4096 * 2**k for k in range(14)]
    times = [cm.time("all_reduce", 4, s, costs=COSTS) for s in sizes]
    assert times == sorted(times)
    bf16 = cm.breakdown("all_reduce", 8, 32 * MiB, "bf16", costs=COSTS)
    int8 = cm.breakdown("all_reduce", 8, 32 * MiB, "int8", costs=COSTS)
    assert int8.path == "two_shot_int8"
    assert int8.host_s / bf16.host_s == pytest.approx((1 + 4 / 128) / 2, rel=0.02)


def test_messages_above_max_bytes_go_in_several_calls():
    one = cm.breakdown("all_reduce", 8, 32 * MiB, costs=COSTS)
    three = cm.breakdown("all_reduce", 8, 96 * MiB, costs=COSTS)
    assert (one.calls, three.calls) == (1, 3)
    assert three.seconds == pytest.approx(3 * one.seconds)


def test_an_all_gather_counts_each_ranks_contribution():
    g = cm.breakdown("all_gather", 8, MiB, "fp32", costs=COSTS)
    assert g.path == "gather" and (g.d2h_bytes, g.h2d_bytes) == (MiB, 7 * MiB)


@pytest.mark.parametrize("args", [("broadcast", 8, 1), ("all_reduce", 1, 1024),
                                  ("all_reduce", 8, 0), ("all_reduce", 8, 64, "int4")])
def test_bad_questions_are_refused(args):
    with pytest.raises(ValueError):
        cm.time(*args)


def test_prefill_and_nccl_arithmetic():
    # 128 chunks x 90 all-reduces of 16 MiB; NCCL at 1 GB/s busbw moves 2(n-1)/n of each
    nccl = cm.prefill_all_reduce_s(nccl_busbw_gbps=1.0)
    assert nccl == pytest.approx(128 * 90 * 16 * MiB * 1.75 / 1e9)
    one = cm.time("all_reduce", 8, 16 * MiB, costs=COSTS)
    assert cm.prefill_all_reduce_s(costs=COSTS) == pytest.approx(128 * 90 * one)
    partial = cm.prefill_all_reduce_s(tokens=3000, costs=COSTS)  # a last chunk of 952 tokens
    assert partial == pytest.approx(90 * (one + cm.time("all_reduce", 8, 952 * 8192, costs=COSTS)))


def test_report_cases_sit_beside_the_reports_figures():
    rows = {r["case"]: r for r in cm.report_cases()}
    assert len(rows) == 6 and all("report" in r and r["predicted_s"] > 0 for r in rows.values())
    saved = rows["saved by INT8 (bf16 - INT8)"]["predicted_s"]
    staged = rows["256k prefill, all-reduce time, host-staged bf16"]["predicted_s"]
    int8 = rows["256k prefill, all-reduce time, host-staged INT8"]["predicted_s"]
    assert saved == pytest.approx(staged - int8) and int8 < staged
    assert all(line for line in cm.report_lines())


def _row(path, ranks, us, nbytes=4096, dtype="bf16", d2h=4096, h2d=4096):
    return {"graph": "captured", "wrong": 0, "algorithm": path, "dtype": dtype, "ranks": ranks,
            "time_us": us, "rank_bytes": nbytes, "payload_bytes_d2h": d2h, "payload_bytes_h2d": h2d}


def test_costs_are_fitted_from_the_smallest_message_per_path():
    ceiling = {"d2h": 1.0, "h2d": 1.0}  # GB/s: 4096 B each way per rank costs n * 8.192 us
    rows = [_row("one_shot", n, 20.0 + 3.0 * (n - 1) + n * 8.192) for n in (2, 4, 8)]
    rows += [_row("one_shot", 2, 999.0, nbytes=1 << 20), _row("direct_ll", 4, 9.0, d2h=0, h2d=0),
             _row("one_shot", 2, 1.0, dtype="int8") | {"wrong": 3}]  # a wrong row does not count
    costs = cm.costs_from_rows(rows, ceiling, "unit")
    assert costs.paths["one_shot"] == pytest.approx((20.0, 3.0), abs=0.01)
    assert costs.paths["direct_ll"] == (9.0, 0.0)
    assert "one_shot_int8" not in costs.paths
    assert costs.latency_us("one_shot_int8", 3) == pytest.approx(26.0)  # falls back to native


def test_the_model_imports_no_torch():
    code = "import sys, glmctl.collectives.cost_model as m; m.time('all_reduce', 8, 1 << 20); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
