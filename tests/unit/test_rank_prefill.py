"""The rank prefill record: the work model of a chunk (FLOPs and bytes per component), the writer
on a recorded-profile fixture (a synthetic trace split as on the GPU), and the chunk as the node
prediction's prefill measurement. Every timing here is made up for the test."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import rank_prefill as rp  # noqa: E402
import rank_sim_profile as prof  # noqa: E402

H, LAYERS_MOE, TOP_K, I_RANK = 4096, 42, 8, 256  # GLM-5.3-Flash, one TP8 rank


def test_routed_experts_and_fp8_linears_count_their_matmuls():
    w = rp.chunk_work(64_000)
    # 42 MoE layers + the MTP drafter's: 2048 tokens x top-8 x three 4096 x 256 matmuls
    assert w["routed_experts"][0] == pytest.approx(2 * 2048 * TOP_K * 3 * H * I_RANK * (LAYERS_MOE + 1))
    assert rp.chunk_work(64_000, drafter_passes=0)["routed_experts"][0] == pytest.approx(
        w["routed_experts"][0] * LAYERS_MOE / (LAYERS_MOE + 1))
    # KDA q,k,v,o (34 layers) + MLA q_a+kv_a, q_b, o, wq_b (11 + 1) + shared experts (43) + dense MLPs (3)
    per_token = (34 * (H * 3 * 1024 + 1024 * H) + 12 * (H * 2048 + 1536 * 2048 + 2048 * H + 1536 * 4096)
                 + 43 * 3 * H * 256 + 3 * 3 * H * 1536)
    assert w["fp8_linear"][0] == pytest.approx(2 * 2048 * per_token)
    # every expert's 4-bit weights are read: ~1.6 MB per expert per rank, 288 experts, 43 layers
    assert 19e9 < w["routed_experts"][1] < 24e9


def test_a_chunk_is_about_eleven_tflop_at_64k_and_the_indexer_grows_with_context():
    total = {c: sum(f for f, _ in rp.chunk_work(c).values()) for c in (0, 8000, 64_000, 240_000)}
    assert 10.5e12 < total[64_000] < 12e12  # the count: ~11 TFLOP per chunk
    idx = {c: rp.chunk_work(c)["indexer"][0] for c in (0, 64_000, 240_000)}
    assert idx[0] == 0.0  # the first chunk takes its causal set whole: no logits
    assert idx[240_000] / idx[64_000] == pytest.approx((240_000 + 1024) / (64_000 + 1024))
    mla = {c: rp.chunk_work(c)["mla_attention"][0] for c in (0, 64_000, 240_000)}
    assert mla[0] < mla[64_000] == mla[240_000]  # a fixed top-k once the context exceeds it
    assert total[0] < total[8000] < total[64_000] < total[240_000]


def _record() -> dict:
    """A rank-sim record as the driver writes it: decode cells, the 256k TTFT, the 8x227k queue
    and a prefill cell whose traces were split by rank_sim_profile.chunk_breakdown."""
    from tests.unit.test_rank_sim_prefill import _trace

    traces = [{"trace": f"w{i}.pt.trace.json.gz", **prof.chunk_breakdown(_trace(context0=c), layers=2)}
              for i, c in enumerate((8192, 63_488, 239_616))]
    return {"name": "exl3-mtp3", "device": "NVIDIA H200", "vllm_version": "0.30.0", "torch_version": "2.11",
            "settings": {"mtp": 3, "chunk": 2048, "model": "/tmp/rank-exl3"},
            "bf16_matmul": {"bf16_tflops": 790.0, "how": "synthetic"},
            "prefill_ttft_256k_s": 33.4,
            "cells": [{"cell": "8x227k", "sessions": 8, "context": 227_000, "ttft_s": [30.0, 61.0, 240.5]},
                      {"cell": "256k", "ttft_s": 33.4},
                      {"cell": "prefill", "prompt_tokens": 252_288, "admission_s": 1.5, "finish_s": 0.5,
                       "profiled_ttft_s": 50.0, "windows": [], "traces": traces}]}


def test_writer_on_a_recorded_profile():
    doc = rp.prefill_doc([_record()], "synthetic")
    assert (doc["ttft_256k_s"], doc["queue_8x227k_last_ttft_s"]) == (33.4, 240.5)
    assert doc["peak"]["bf16_tflops"] == 790.0 and "same run" in doc["peak"]["source"]
    assert [c["context"] for c in doc["chunks"]] == [9216, 64_512, 240_640]  # the complete chunks' mean
    c = doc["chunks"][0]
    comps = {x["name"]: x for x in c["components"]}
    assert set(rp.MODELLED) | {"glue", "gpu_idle"} <= set(comps)
    # two MoE layers' kernels (100 us each) and their sorts, per chunk
    assert comps["routed_experts"]["ms"] == pytest.approx(0.21)
    flop = rp.chunk_work(9216, 2048, 1)["routed_experts"][0]
    assert comps["routed_experts"]["tflop"] == round(flop / 1e12, 4)
    assert comps["routed_experts"]["frac_peak"] == round(flop / 0.21e-3 / 790e12, 4)
    assert comps["glue"]["ms"] == pytest.approx(0.001) and c["glue_kinds"] == {"other": 0.001}
    assert comps["gpu_idle"]["ms"] == pytest.approx(c["ms"] - c["busy_ms"], abs=0.01)  # both rounded
    assert c["wall_ms"] > c["ms"] and c["chunks_averaged"] == 2
    assert doc["ttft_256k_from_chunks_s"] == pytest.approx(125 * c["wall_ms"] / 1e3 + 2.0, rel=1e-3)
    json.dumps(doc)  # the record is plain JSON


def test_writer_without_a_profile_says_so():
    rec = _record()
    rec["cells"] = [x for x in rec["cells"] if x["cell"] != "prefill"]
    del rec["bf16_matmul"]
    doc = rp.prefill_doc([rec], "synthetic", peak_tflops=700.0)
    assert doc["chunks"] == [] and "absent" in doc["prefill_cell"]
    assert doc["peak"] == {"bf16_tflops": 700.0, "source": "--peak-tflops"}


def test_the_longest_context_chunk_feeds_the_node_prediction(tmp_path):
    from glmctl.plan.prediction.node_prediction import MeasuredRun, predict_node
    from glmctl.plan.prediction.node_records import H200_MEASURED_HERE

    m = rp.node_prefill_measurement([_record()])
    assert m["context_tokens"] == 240_640 and m["chunk_tokens"] == 2048
    assert {"routed_experts", "indexer", "gpu_idle_in_span", "host_between_steps"} <= set(m["breakdown_us"])
    run = MeasuredRun.model_validate({"source": "synthetic", "device": H200_MEASURED_HERE.model_dump(), "prefill": m,
                                      "cells": [{"sessions": 8, "context_tokens": 22_000, "step_us": 17_000.0}]})
    one, queue = predict_node(run, time_model=lambda *a: 0.0, collective_label="none").prefill
    assert one.label.startswith("predicted (from one 2048-token H200 chunk at 240,640 context")
    assert one.predicted_ttft_s > 0 and queue.prompt_tokens == 8 * 227_000


def test_the_assembled_rank_sim_record_carries_the_chunk_for_glmctl_plan_predict(tmp_path):
    import rank_sim_results

    from glmctl.plan.prediction.node_prediction import load_measured_run

    decode = json.loads((REPO / "bench/results/rank-sim-main-h200.json").read_text())  # a real decode record
    decode["cells"].append(_record()["cells"][-1])
    doc = rank_sim_results.assemble([decode], "synthetic prefill cell on the 2026-12-04 record", [], "not run")
    assert doc["prefill"]["context_tokens"] == 240_640
    labels = [p["basis"] for p in doc["predicted_node"]["prefill"]]
    assert len(labels) == 2 and all(b.startswith("predicted (from one 2048-token H200 chunk") for b in labels)
    path = tmp_path / "rank-sim.json"
    path.write_text(json.dumps(doc))
    assert load_measured_run(path).prefill.breakdown_us == doc["prefill"]["breakdown_us"]  # what --predict reads
