"""`glmctl plan --predict`: a rank step measured on a stand-in GPU -> predicted 8x L40 cells, from a
synthetic measurement (every number below is made up for the test, not measured anywhere)."""

from __future__ import annotations

import json

import pytest

from glmctl.errors import ConfigError
from glmctl.plan import load_model_spec
from glmctl.plan.prediction.node_prediction import (
    L40_DATASHEET,
    REPORT_TOKENS_PER_STEP,
    HostStagedFallback,
    MeasuredRun,
    decode_step_collectives,
    load_measured_run,
    predict_node,
)
from glmctl.plan.prediction.node_prefill import floor_s

BREAKDOWN = {"mla_attention": 800.0, "indexer": 900.0, "kda": 1200.0, "routed_experts": 4500.0,
             "shared_dense_mlp": 400.0, "norms_mhc": 600.0, "sampler_mtp": 1100.0, "launch_gaps": 500.0}
SYNTHETIC = {
    "source": "synthetic test breakdown",
    "device": {"name": "H200", "memory_bandwidth_gbps": 4320.0, "bf16_tflops": 724.0,
               "source": "synthetic: copy 4.32 TB/s, bf16 724 TFLOP/s"},
    "reference": {"sessions": 8, "context_tokens": 240_000, "speculative": "mtp:3", "breakdown_us": BREAKDOWN},
    "cells": [{"sessions": 8, "context_tokens": 22_000, "speculative": "mtp:3", "step_us": 5_000.0},
              {"sessions": 8, "context_tokens": 240_000, "speculative": "none", "step_us": 6_000.0}],
    "prefill": {"chunk_tokens": 2048, "context_tokens": 240_000,
                "breakdown_us": {"mla_attention": 30_000.0, "indexer": 60_000.0, "routed_experts": 40_000.0,
                                 "launch_gaps": 1_000.0}},
}


def _free_collectives(op: str, ranks: int, nbytes: int, dtype: str) -> float:
    return 0.0


@pytest.fixture
def run() -> MeasuredRun:
    return MeasuredRun.model_validate(SYNTHETIC)


def test_kinds_scale_by_the_ratio_that_bounds_them(run):
    from glmctl.plan.prediction.decode_bytes import step_bytes
    from glmctl.plan.prediction.node_records import NON_BANDWIDTH_RATIO_LOW, TARGET_COPY_EFFICIENCY

    pred = predict_node(run, time_model=_free_collectives, collective_label="none")
    ref = pred.cells[0]
    lines = {k.kind: k for k in ref.kinds}
    bw = 4320.0 / 864.0  # 5.0: bandwidth-bound decode kinds
    need = step_bytes(load_model_spec("glm-5.3-flash"), 8, 240_000, 3, "exl3", 8)
    l40_bw = 864e9 * TARGET_COPY_EFFICIENCY
    # roofline kinds: their bytes at the L40's bandwidth, or their stand-in time where that is longer
    for kind in ("routed_experts", "mla_attention", "indexer", "kda", "norms_mhc"):
        line = lines[kind]
        floor = need[kind] / l40_bw * 1e6
        assert line.bound == "roofline" and line.bytes == need[kind]
        assert line.floor_us == pytest.approx(floor, abs=0.1)
        assert line.predicted_us == pytest.approx(max(floor, BREAKDOWN[kind]), rel=1e-6)
    assert lines["routed_experts"].predicted_us > BREAKDOWN["routed_experts"]  # 4 ms can't move ~12 GB on an L40
    assert lines["indexer"].predicted_us == BREAKDOWN["indexer"]  # far above its floor: not bandwidth-bound
    assert lines["shared_dense_mlp"].ratio == pytest.approx(bw) and lines["shared_dense_mlp"].bound == "bandwidth"
    assert lines["launch_gaps"].ratio == 1.0  # launch latency is not scaled
    expected = sum(k.predicted_us for k in ref.kinds)
    assert ref.predicted_step_us == pytest.approx(expected, abs=0.1)
    # tok/s = sessions x stated tokens per step / step
    assert ref.predicted_tok_s == pytest.approx(8 * REPORT_TOKENS_PER_STEP["mtp:3"] / (expected * 1e-6), abs=0.1)
    # the range's fast end: the time beyond the floors x the SM-count x clock ratio
    fast = sum(max(k.floor_us, k.measured_us * NON_BANDWIDTH_RATIO_LOW) if k.bound == "roofline" else k.predicted_us
               for k in ref.kinds)
    assert ref.range_tok_s == pytest.approx((ref.predicted_tok_s, 8 * REPORT_TOKENS_PER_STEP["mtp:3"] / (fast * 1e-6)),
                                            abs=0.2)
    assert (ref.report_tok_s, ref.context_label) == (704.0, "240k")
    assert ref.ratio_to_report == pytest.approx(ref.predicted_tok_s / 704.0, abs=1e-3)
    assert ref.dominated_by.startswith("routed_experts")
    assert ref.label.startswith("predicted (from the H200 rank step")
    assert any("roofline kinds" in n for n in pred.notes)


def test_compute_bound_override_uses_tensor_throughput(run):
    run = run.model_copy(update={"bounds": {"indexer": "compute_fp8"}})
    pred = predict_node(run, time_model=_free_collectives)
    indexer = next(k for k in pred.cells[0].kinds if k.kind == "indexer")
    assert indexer.ratio == pytest.approx(2 * 724.0 / 362.1, rel=1e-4)  # FP8 not measured: 2x bf16, said so
    assert any("FP8 throughput not measured" in n for n in pred.notes)


def test_cells_without_a_breakdown_take_the_reference_shares(run):
    pred = predict_node(run, time_model=_free_collectives)
    short, plain = pred.cells[1], pred.cells[2]
    assert short.measured_step_us == pytest.approx(5_000.0)
    experts = next(k for k in short.kinds if k.kind == "routed_experts")
    assert experts.measured_us == pytest.approx(5_000.0 * 4500 / sum(BREAKDOWN.values()))
    assert "shares" in short.breakdown_basis and short.report_tok_s == 646.0
    assert plain.tokens_per_step == 1.0 and plain.report_tok_s is None  # the report has no such cell


def test_collectives_are_the_models_calls_timed_by_the_given_model(run):
    glm = load_model_spec("glm-5.3-flash")
    calls = decode_step_collectives(glm, 8, sessions=8, num_spec=3)
    reduces = sum(c.count for c in calls if c.op == "all_reduce")
    assert reduces == 2 * 45 + 1 + 3 * 3  # 45 layers x 2, embedding; each of 3 MTP passes: embedding + 2
    assert calls[0].bytes == 8 * 4 * 4096 * 2  # 32 verify tokens of bf16 hidden state
    seen = []

    def per_call(op, ranks, nbytes, dtype):
        seen.append((op, ranks, dtype))
        return 10e-6

    pred = predict_node(run, time_model=per_call)
    ref = pred.cells[0]
    assert ref.collective_calls == sum(c.count for c in calls)
    assert ref.collectives_us == pytest.approx(10.0 * ref.collective_calls, abs=0.1)
    assert {s[1] for s in seen} == {8} and {s[2] for s in seen} >= {"bf16"}


def test_default_collectives_are_the_protocols_cost_model(run):
    from glmctl.collectives import cost_model

    pred = predict_node(run)
    calls = decode_step_collectives(load_model_spec("glm-5.3-flash"), 8, sessions=8, num_spec=3)
    expected = sum(c.count * cost_model.time(c.op, 8, c.bytes, c.dtype) for c in calls) * 1e6
    assert pred.cells[0].collectives_us == pytest.approx(expected, abs=0.1)
    assert pred.collective_model.startswith("glmctl.collectives.cost_model")
    assert "collectives from glmctl.collectives.cost_model" in pred.cells[0].label
    fallback = predict_node(run, time_model=HostStagedFallback())
    assert "assumed" in fallback.collective_model and "fallback" in fallback.cells[0].label


def test_fallback_collective_model_is_latency_bound_for_decode_and_link_bound_beyond():
    f = HostStagedFallback()
    small = f("all_reduce", 8, 262_144, "bf16")
    big = f("all_reduce", 8, 16 << 20, "bf16")
    assert 15e-6 < small < 60e-6  # latency + two-shot link time, host traffic in cache
    assert big > 100 * small - 1 and f("all_reduce", 8, 16 << 20, "int8") < big
    assert "assumed" in f.label


def test_prefill_chunks_take_the_roofline_at_their_context(run):
    from glmctl.plan.prediction.node_records import (
        TARGET_COMPUTE_EFFICIENCY,
        TARGET_COPY_EFFICIENCY,
    )
    from glmctl.plan.prediction.prefill_work import chunk_work

    pred = predict_node(run, time_model=_free_collectives)
    one, queue = pred.prefill
    assert one.prompt_tokens == 262_144 and one.report_s == (57.0, 72.0)
    model = load_model_spec("glm-5.3-flash")
    bf16, fp8, bw = 181.05e12 * TARGET_COMPUTE_EFFICIENCY, 362.1e12 * TARGET_COMPUTE_EFFICIENCY, 864e9 * TARGET_COPY_EFFICIENCY
    rate = {"mla_attention": bf16, "routed_experts": bf16, "indexer": fp8}
    measured = SYNTHETIC["prefill"]["breakdown_us"]
    total = 0.0
    for start in range(0, 262_144, 2048):
        work = chunk_work(model, start, 2048)
        grow = (start + 1024) / (240_000 + 1024)  # the indexer's stand-in time grows with the context
        for kind, us in measured.items():
            if kind == "launch_gaps":
                total += us
                continue
            flops, nbytes = work[kind]
            floor = max(flops / rate[kind], nbytes / bw) * 1e6
            total += max(floor, us * (grow if kind == "indexer" else 1.0))
    assert one.predicted_ttft_s == pytest.approx(total * 1e-6, abs=0.1)
    # the total rests on both sides of the max: some chunks' kinds at their floor, some at the stand-in
    floors = [max(chunk_work(model, s, 2048)[k][0] / rate[k], chunk_work(model, s, 2048)[k][1] / bw) * 1e6
              for s in (0, 250_000) for k in ("mla_attention", "routed_experts", "indexer")]
    assert any(f > measured[k] for f, k in zip(floors, ["mla_attention", "routed_experts", "indexer"] * 2, strict=True))
    assert any(f < measured[k] for f, k in zip(floors, ["mla_attention", "routed_experts", "indexer"] * 2, strict=True))
    assert "roofline per kind" in one.label and queue.label.endswith("prefilled one after another")


def test_bad_measurement_files_say_what_is_wrong(tmp_path):
    bad = dict(SYNTHETIC, device={"name": "H200", "memory_bandwidth_gbps": -1, "bf16_tflops": 1, "source": "x"})
    path = tmp_path / "m.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="device.memory_bandwidth_gbps"):
        load_measured_run(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_measured_run(tmp_path / "missing.json")
    no_breakdown = MeasuredRun.model_validate(dict(SYNTHETIC, reference={"sessions": 8, "context_tokens": 1}))
    with pytest.raises(ConfigError, match="cell 8 x 1 none has neither step_us nor breakdown_us"):
        predict_node(no_breakdown)


def test_cli_predict_prints_predicted_cells_beside_the_report(run_cli, tmp_path):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(SYNTHETIC))
    proc = run_cli("plan", "--predict", str(path), env={"COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr
    for text in ("predicted", "rep 704", "rep 646", "57-72 s", L40_DATASHEET.source[:30],
                 "glmctl.collectives.cost_model"):
        assert text in proc.stdout, text
    data = json.loads(run_cli("plan", "--predict", str(path), "--json").stdout)
    assert data["cells"][0]["report_tok_s"] == 704.0 and data["target"]["memory_bandwidth_gbps"] == 864.0


def test_predict_imports_nothing_heavy(tmp_path):
    from tests.unit.test_cli import _imported_heavy

    path = tmp_path / "measured.json"
    path.write_text(json.dumps(SYNTHETIC))
    assert _imported_heavy(["plan", "--predict", str(path)]) == []


# bench/rank_sim.py's record format (synthetic values): one record per served variant
RANK_SIM_MTP3 = {
    "name": "exl3-mtp3", "settings": {"mtp": 3, "chunk": 2048},
    "cells": [
        {"cell": "1x64k", "sessions": 1, "context": 64_000, "step_ms": 4.0, "ttft_s": [9.0]},
        {"cell": "8x227k", "sessions": 8, "context": 227_000, "step_ms": 11.0,
         "ttft_s": [20.0, 40.0, 80.0, 160.0, None, 170.0, 175.0, 180.0],
         "breakdown": {"us_per_iteration": {"routed_experts": 5000.0, "kda": 2000.0, "dense_gemm": 1500.0,
                                            "sampler": 300.0, "gpu_idle_in_span": 700.0}}},
        {"cell": "8x64k", "skipped": "deadline"},
    ],
    "prefill_ttft_256k_s": 30.0,
}
RANK_SIM_NOSPEC = {"name": "exl3-nospec", "settings": {"mtp": 0},
                   "cells": [{"cell": "8x22k", "sessions": 8, "context": 22_000, "step_ms": 6.0}]}


def test_rank_sim_records_become_cells_reference_and_prefill(tmp_path):
    (tmp_path / "rank-sim-exl3-mtp3.json").write_text(json.dumps(RANK_SIM_MTP3))
    measured = {"source": "synthetic rank-sim records", "device": SYNTHETIC["device"],
                "rank_sim": ["rank-sim-exl3-mtp3.json", RANK_SIM_NOSPEC]}
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    run = load_measured_run(tmp_path / "measured.json")
    ref = run.reference
    assert (ref.sessions, ref.context_tokens, ref.speculative) == (8, 227_000, "mtp:3")
    assert ref.breakdown_us["host_between_steps"] == pytest.approx(11_000.0 - 9_500.0)  # measured step - span
    assert [(c.sessions, c.speculative) for c in run.cells] == [(1, "mtp:3"), (8, "none")]  # skipped cell dropped
    assert (run.prefill.ttft_s, run.prefill.queue_ttft_s, run.prefill.queue_prompt_tokens) == (30.0, 180.0, 227_000)

    pred = predict_node(run, time_model=_free_collectives)
    lines = {k.kind: k for k in pred.cells[0].kinds}
    assert lines["host_between_steps"].ratio == lines["gpu_idle_in_span"].ratio == 1.0
    assert lines["dense_gemm"].bound == "roofline" and lines["sampler"].bound == "bandwidth"
    assert pred.cells[0].report_tok_s == 704.0  # 227k is the report's ~240k column
    one, queue = pred.prefill
    ratio = 724.0 / 181.05
    floor = floor_s(run, load_model_spec("glm-5.3-flash"), L40_DATASHEET, 256_000)
    queue_floor = 8 * floor_s(run, load_model_spec("glm-5.3-flash"), L40_DATASHEET, 227_000)
    # the longer of the measured time and the L40's floor; the range's top end all compute-bound
    assert one.predicted_ttft_s == pytest.approx(max(30.0, floor), abs=0.1) and one.prompt_tokens == 256_000
    assert one.range_s == pytest.approx((max(30.0, floor), max(30.0 * ratio, floor)), abs=0.1)
    assert queue.predicted_ttft_s == pytest.approx(max(180.0, queue_floor), abs=0.1)
    assert queue.report_s == (220.0, 220.0)


def test_rank_sim_records_without_any_step_are_refused(tmp_path):
    empty = {"name": "x", "settings": {"mtp": 3}, "cells": [{"cell": "8x64k", "no_window": "none"}]}
    measured = {"source": "x", "device": SYNTHETIC["device"], "rank_sim": [empty]}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    with pytest.raises(ConfigError, match="no measured step"):
        load_measured_run(tmp_path / "m.json")


# Records with steps but no profile (synthetic values, the H200 run's shape): cells measured whole
RANK_SIM_WHOLE = {
    "name": "exl3-mtp3", "settings": {"mtp": 3, "chunk": 2048},
    "cells": [
        {"cell": "1x64k", "sessions": 1, "context": 64_000, "step_ms": 10.0, "ttft_s": [12.0], "errors": []},
        {"cell": "8x22k", "sessions": 8, "context": 22_000, "step_ms": 20.0,
         "ttft_s": [4.0, 8.0, 12.5, 16.0, 20.0, 24.0, 28.0, 32.0], "errors": []},
        {"cell": "8x64k", "sessions": 8, "context": 64_000, "no_window": "no steady window",
         "ttft_s": [10.0, 20.0, 31.0, 40.0, 50.0, 61.0, 70.0, 80.0], "errors": []},
    ],
}


def test_steps_measured_whole_scale_by_the_stated_assumption_with_a_range(tmp_path):
    measured = {"source": "synthetic", "device": SYNTHETIC["device"], "rank_sim": [RANK_SIM_WHOLE]}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    run = load_measured_run(tmp_path / "m.json")
    assert run.reference is None and [(c.sessions, c.context_tokens) for c in run.cells] == [(1, 64_000), (8, 22_000)]
    pred = predict_node(run, time_model=_free_collectives)
    bw = 4320.0 / 864.0
    one, eight = pred.cells
    assert one.predicted_step_us == pytest.approx(10_000.0 * bw)  # default: all of it bandwidth-bound
    assert [k.kind for k in one.kinds] == ["whole_step_bandwidth_bound_assumed"]
    tps = REPORT_TOKENS_PER_STEP["mtp:3"]
    assert eight.range_tok_s == pytest.approx((8 * tps / (20e-3 * bw), 8 * tps / 20e-3), abs=0.1)
    assert eight.range_shares == (1.0, 0.0) and eight.report_tok_s == 646.0
    # the share at which the prediction meets the report's 646 tok/s (an inference, printed as one)
    share = ((8 * tps / 646.0 * 1e6) / 20_000.0 - 1) / (bw - 1)
    assert eight.report_implied_share == pytest.approx(share, abs=1e-3)
    assert "measured whole (no breakdown)" in eight.label and eight.label.startswith("predicted (from")
    assert any("no breakdown was measured" in n for n in pred.notes)
    # a stated half-share: half the step scales, half does not
    from glmctl.plan.prediction.node_records import WholeStepAssumption

    half = predict_node(run.model_copy(update={"whole_step": WholeStepAssumption(scaled_share=0.5)}),
                        time_model=_free_collectives)
    assert half.cells[0].predicted_step_us == pytest.approx(10_000.0 * (0.5 * bw + 0.5))
    assert [k.bound for k in half.cells[0].kinds] == ["bandwidth", "launch"]


def test_prefill_from_queue_gaps_is_extrapolated_to_the_reports_prompts(tmp_path):
    measured = {"source": "synthetic", "device": SYNTHETIC["device"], "rank_sim": [RANK_SIM_WHOLE]}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    run = load_measured_run(tmp_path / "m.json")
    p = run.prefill
    assert (p.prompt_tokens, p.ttft_s, p.queue_ttft_s, p.queue_prompt_tokens) == (64_000, 10.0, 80.0, 64_000)
    assert "median gap" in p.ttft_basis and "8 x 64,000" in p.ttft_basis
    one, queue = predict_node(run, time_model=_free_collectives).prefill
    ratio = 724.0 / 181.05
    h200_256k = 10.0 * 125 / 32  # 64,000 tokens = 32 chunks of 2,048; 256,000 = 125
    floor = floor_s(run, load_model_spec("glm-5.3-flash"), L40_DATASHEET, 256_000)
    assert 10.0 < floor < 30.0  # 125 chunks of ~11-14 TFLOP at ~144 TFLOP/s, bytes beside
    assert one.prompt_tokens == 256_000 and one.predicted_ttft_s == pytest.approx(max(h200_256k, floor), abs=0.1)
    assert one.range_s == pytest.approx((max(h200_256k, floor), h200_256k * ratio), abs=0.1)
    assert "extrapolated linearly in chunks" in one.label and one.report_s == (57.0, 72.0)
    assert queue.prompt_tokens == 8 * 227_000
    queue_s = 80.0 * (8 * 111) / (8 * 32)
    queue_floor = 8 * floor_s(run, load_model_spec("glm-5.3-flash"), L40_DATASHEET, 227_000)
    assert queue.predicted_ttft_s == pytest.approx(max(queue_s, queue_floor), abs=0.1)


def test_cli_predict_prints_cells_measured_whole(run_cli, tmp_path):
    measured = {"source": "synthetic", "device": SYNTHETIC["device"], "rank_sim": [RANK_SIM_WHOLE]}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    proc = run_cli("plan", "--predict", str(tmp_path / "m.json"), env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    for text in ("pred ", "rep 646", "range", "implies", "inferred", "measured whole", "extrapolated"):
        assert text in proc.stdout, text
