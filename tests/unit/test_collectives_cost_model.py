"""The collectives' cost model (pure Python): the protocol's terms apart from what the thread rig
imposes, how a call splits into latency and data terms on a node, how the terms are fitted from
the rig's rows, and that the recorded terms are the fit of the committed record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glmctl.collectives import cost_model as cm
from glmctl.collectives import cost_terms as ct
from glmctl.collectives.call_plan import PREDICTED_SHOTS_8, PathOptions, plan_all_reduce
from tests.conftest import REPO

MiB = 1 << 20
PATHS = ("one_shot", "two_shot", "gather", "direct_ll", "direct_1s", "direct_2s")
COSTS = ct.ProtocolCosts("test", per_memop_us=0.5, rig_ceiling_gbps=50.0,
                         paths={p: ct.PathTerms(10.0, 1.0, 50.0) for p in PATHS})
# the native direct shots, as a communicator configured for them takes them (the defaults do not)
NATIVE = PathOptions(direct=PREDICTED_SHOTS_8)


def test_small_messages_are_latency_and_large_ones_host_memory_on_8_l40s():
    small = cm.breakdown("all_reduce", 8, 8192, costs=COSTS, options=NATIVE)  # one native shot at 8 ranks
    assert (small.path, small.bound) == ("direct_1s", "latency")
    assert small.latency_s == pytest.approx((10 + 0.5 * 1 + 1.0 * 1) * 1e-6)  # a fence, a poll
    big = cm.breakdown("all_reduce", 8, 16 * MiB, costs=COSTS)
    assert (big.path, big.bound) == ("two_shot", "host memory")
    d2h, h2d = plan_all_reduce(8 * MiB, 2, 8).bytes_moved()
    assert big.host_s == pytest.approx(8 * (d2h + h2d) / 100e9)
    assert big.link_s == pytest.approx(d2h / 25e9 + h2d / 25e9)
    assert big.latency_s == pytest.approx((10 + 0.5 * 3 * (3 * 7 + 2)) * 1e-6)  # its own memops
    assert big.seconds == pytest.approx(big.latency_s + big.host_s)


def test_a_path_slower_than_the_copy_engines_is_slower_on_the_links_too():
    slow = ct.ProtocolCosts("t", 0.5, 50.0, {**COSTS.paths, "direct_2s": ct.PathTerms(10, 1, 25)})
    a = cm.breakdown("all_reduce", 8, 256 * 1024, costs=COSTS, options=NATIVE)
    b = cm.breakdown("all_reduce", 8, 256 * 1024, costs=slow, options=NATIVE)
    assert a.path == b.path == "direct_2s"
    assert b.link_s == pytest.approx(2 * a.link_s) and b.host_s == a.host_s


def test_the_rig_queues_every_ranks_memops_and_shares_one_link():
    """What the rig imposes: n ranks' memops in one queue, n ranks' bytes on one link; on a node
    a rank pays only its own."""
    d2h, h2d = 4096, 7 * 4096
    rig = COSTS.rig_time_us("one_shot", 8, d2h, h2d)
    assert rig == pytest.approx(10 + 0.5 * 8 * 2 * 23 + 8 * (d2h + h2d) / 50e3)
    assert COSTS.latency_us("one_shot", 8) == pytest.approx(10 + 0.5 * 2 * 23)
    assert COSTS.latency_us("direct_2s", 8) == pytest.approx(10 + 0.5 * 2 + 1.0 * 2)
    assert COSTS.rig_time_us("direct_ll", 4, 0, 0, poll_count=lambda n: n - 1) == 13.0


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
    assert len(rows) == 5 and all("report" in r and r["predicted_s"] > 0 for r in rows.values())
    saved = rows["saved by INT8 (bf16 - INT8)"]["predicted_s"]
    staged = rows["256k prefill, all-reduce time, host-staged bf16"]["predicted_s"]
    int8 = rows["256k prefill, all-reduce time, host-staged INT8"]["predicted_s"]
    assert saved == pytest.approx(staged - int8) and int8 < staged
    assert all(line for line in cm.report_lines())


def _row(path, ranks, us, nbytes=4096, dtype="bf16", d2h=4096, h2d=4096, op="all_reduce"):
    return {"graph": "captured", "wrong": 0, "algorithm": path, "dtype": dtype, "ranks": ranks,
            "time_us": us, "rank_bytes": nbytes, "payload_bytes_d2h": d2h, "payload_bytes_h2d": h2d,
            "op": op, "variant": "default"}


def test_terms_are_fitted_from_the_rigs_rows():
    truth = ct.ProtocolCosts("truth", per_memop_us=0.6, rig_ceiling_gbps=50.0, paths={
        "one_shot": ct.PathTerms(7.0, 0.0, 40.0), "direct_ll": ct.PathTerms(0.5, 3.0, 55.0)})
    rows = [{"op": "barrier", "graph": "captured", "ranks": n,
             "time_us": 0.6 * n * 2 * ct.barrier_memops(n)} for n in (2, 4, 8)]
    for n in (2, 4, 8):
        for b in (4096, 65536, 1 << 20):
            d2h, h2d = b, (n - 1) * b
            rows.append(_row("one_shot", n, truth.rig_time_us("one_shot", n, d2h, h2d), b, d2h=d2h,
                             h2d=h2d))
            rows.append(_row("direct_ll", n, truth.rig_time_us(
                "direct_ll", n, 2 * d2h, 2 * h2d, poll_count=lambda k: k - 1), b, d2h=2 * d2h,
                h2d=2 * h2d))
    rows.append(_row("one_shot", 2, 1.0, dtype="int8") | {"wrong": 3})  # a wrong row does not count
    fit = ct.fit_costs(rows, 50.0, "unit", poll_counts=ct.SEQUENTIAL_POLLS)
    assert fit.per_memop_us == pytest.approx(0.6)
    for path, t in truth.paths.items():
        got = fit.paths[path]
        assert (got.fixed_us, got.per_poll_us, got.rate_gbps) == pytest.approx(
            (t.fixed_us, t.per_poll_us, t.rate_gbps), abs=0.02)
        assert got.basis.startswith("fitted: 9 rows at [2, 4, 8] ranks") and "rms 0.0%" in got.basis
    assert "one_shot_int8" not in fit.paths
    assert fit.latency_us("one_shot_int8", 3) == fit.latency_us("one_shot", 3)  # falls back to native
    predicted = ct.with_direct_predictions(fit, launch_us=1.5).paths["direct_2s"]
    assert predicted.fixed_us == pytest.approx(0.5 + 3.0) and predicted.basis.startswith("predicted")


def test_the_recorded_terms_are_the_fit_of_the_committed_record():
    """`cost_model.PROTOCOL_COSTS` is the fit of bench/results/collectives-h200-threads.json: after
    a new record, `python -m glmctl.collectives.cost_terms` on it prints the terms to paste."""
    doc = json.loads((REPO / "bench" / "results" / "collectives-h200-threads.json").read_text())
    fit = ct.record_costs(doc)
    rec = cm.PROTOCOL_COSTS
    assert (fit.per_memop_us, fit.rig_ceiling_gbps) == (rec.per_memop_us, rec.rig_ceiling_gbps)
    assert fit.paths == rec.paths
    assert all(p in rec.paths for p in ("direct_ll", "direct_1s", "direct_2s", "one_shot",
                                        "two_shot", "gather", "one_shot_int8", "two_shot_int8"))


def test_the_terms_print_as_the_literal_to_paste(capsys):
    path = REPO / "bench" / "results" / "collectives-h200-threads.json"
    assert ct.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("per_memop_us=0.5744") and "'direct_ll': PathTerms(0.62, 3.362, 58.3" in out


def test_the_model_imports_no_torch():
    code = "import sys, glmctl.collectives.cost_model as m; m.time('all_reduce', 8, 1 << 20); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
