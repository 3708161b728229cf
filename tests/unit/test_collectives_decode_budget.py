"""The decode step's collectives on the node (`glmctl.plan.prediction.decode_collectives`): the
calls come from the model's layer structure, each priced by the collectives' cost model on the
path the auto rule picks, and the levers are the same model with one thing changed."""

from __future__ import annotations

import pytest

from glmctl.collectives import cost_model as cm
from glmctl.plan.model import load_model_spec
from glmctl.plan.prediction.decode_collectives import (
    decode_levers,
    decode_step_collectives,
    decode_step_prediction,
)

GLM = load_model_spec("glm-5.3-flash")


def test_the_calls_follow_the_layers_and_the_drafts():
    calls = decode_step_collectives(GLM, 8, sessions=8, num_spec=3)
    ar = [c for c in calls if c.op == "all_reduce"]
    assert sum(c.count for c in ar) == 2 * GLM.num_hidden_layers + 1 + 3 + 3 * 2
    assert sum(c.count for c in calls) == 104
    assert {c.bytes for c in ar} == {32 * GLM.hidden_size * 2, 8 * GLM.hidden_size * 2}
    assert sum(c.count for c in decode_step_collectives(GLM, 8, 1, 0)) == 2 * 45 + 1 + 1


def test_the_drafts_gather_token_pairs_as_glmctl_serves_them():
    from glmctl.serving import profiles
    from glmctl.serving.launch_files import _speculative_config

    assert _speculative_config(profiles.load("commercial"))["use_local_argmax_reduction"] is True
    pairs = [c for c in decode_step_collectives(GLM, 8, 8, 3) if c.what.startswith("MTP") and c.op == "all_gather"]
    logits = [c for c in decode_step_collectives(GLM, 8, 8, 3, draft_argmax=False)
              if c.what.startswith("MTP") and c.op == "all_gather"]
    assert [(c.bytes, c.dtype, c.count) for c in pairs] == [(32 * 8, "fp32", 1), (8 * 8, "fp32", 2)]
    assert [c.bytes for c in logits] == [32 * GLM.vocab_size // 8 * 2, 8 * GLM.vocab_size // 8 * 2]
    with_pairs = {r["cell"]: r["ms"] for r in decode_step_prediction(GLM)}
    for cell, sessions in (("8x22k", 8), ("1x64k", 1)):
        from glmctl.plan.prediction.decode_collectives import _priced

        old = sum(p["count"] * p["us"] for p in _priced(decode_step_collectives(GLM, 8, sessions, 3,
                                                                                draft_argmax=False), 8, None, None))
        assert with_pairs[cell] < old / 1e3


def test_each_cell_is_the_sum_of_its_calls_on_the_auto_paths():
    rows = {r["cell"]: r for r in decode_step_prediction(GLM)}
    assert set(rows) == {"8x22k", "1x64k"}
    for r in rows.values():
        assert {"cell", "calls", "ms", "bound"} <= set(r) and r["calls"] == 104
        kinds = r["calls_by_kind"]
        assert r["ms"] == pytest.approx(sum(k["count"] * k["us"] for k in kinds) / 1e3, abs=2e-3)
        assert r["ms"] == pytest.approx(r["latency_ms"] + r["data_ms"], abs=2e-3)
        assert r["ms_if_host_caches_hold_it"] <= r["ms"]
        assert r["bound"] in ("latency", "host memory", "PCIe link")
    big = rows["8x22k"]
    layer = big["calls_by_kind"][0]
    # 32 tokens x 4096 bf16: beyond LL words' 128 KiB, a barrier path (the native direct shots are off)
    assert layer["bytes"] == 262144 and layer["path"] in ("one_shot", "two_shot")
    assert layer["us"] == pytest.approx(cm.time("all_reduce", 8, 262144) * 1e6, abs=0.01)
    assert big["bound"] == "host memory"  # 1x64k: LL words' 16 bytes per byte at 8 ranks, near the latency
    assert big["ms"] > rows["1x64k"]["ms"]


def test_the_host_memory_figure_is_an_input():
    fast = cm.NodeLinks("unbounded host", 25.0, 25.0, 1e6)
    rows = {r["cell"]: r for r in decode_step_prediction(GLM, node=fast)}
    slow = {r["cell"]: r for r in decode_step_prediction(GLM)}
    assert rows["8x22k"]["bound"] != "host memory"
    assert rows["8x22k"]["ms"] == pytest.approx(slow["8x22k"]["ms_if_host_caches_hold_it"], abs=2e-3)


def test_levers_lower_the_step_and_say_what_they_assume():
    base = {r["cell"]: r["ms"] for r in decode_step_prediction(GLM)}
    levers = decode_levers(GLM, int8_rel_err="0.7% (test)")
    assert {lv["cell"] for lv in levers} == {"8x22k", "1x64k"}
    for lv in levers:
        if lv["lever"].startswith("overlap"):
            assert lv["cell"] == "8x22k" and lv["saved_ms"] == pytest.approx(base["8x22k"])
            continue
        assert 0 < lv["ms"] < base[lv["cell"]], lv
        assert lv["saved_ms"] == pytest.approx(base[lv["cell"]] - lv["ms"], abs=2e-3)
    shots = {lv["cell"]: lv for lv in levers if lv["lever"] == "native direct shots as priced"}
    assert set(shots) == {"8x22k", "1x64k"} and "off by default" in shots["8x22k"]["note"]
    int8 = next(lv for lv in levers if lv["lever"] == "INT8 decode all-reduce")
    assert "0.7% (test)" in int8["note"]


def test_int8_all_reduce_is_priced_on_the_direct_two_shot_records():
    """GLMCTL_COLLECTIVES_INT8=all: the decode all-reduces go as INT8 records in the direct
    path's two shots, priced by the plan's bytes (scales included) and the stated codec term."""
    from dataclasses import replace

    from glmctl.collectives.call_plan import DirectLimits, PathOptions
    from glmctl.collectives.cost_terms import DIRECT_INT8_CODEC_US_PER_MIB

    native = PathOptions(direct=DirectLimits(two_shot_max_bytes=384 * 1024, capacity=512 * 1024))
    t8 = cm.breakdown("all_reduce", 8, 262144, "int8", options=native)
    t16 = cm.breakdown("all_reduce", 8, 262144, options=native)
    assert (t8.path, t16.path) == ("direct_2s_int8", "direct_2s")
    ratio = (t8.d2h_bytes + t8.h2d_bytes) / (t16.d2h_bytes + t16.h2d_bytes)
    assert ratio == pytest.approx((1 + 4 / 128) / 2, rel=0.01)
    assert (t8.latency_s - t16.latency_s) * 1e6 == pytest.approx(DIRECT_INT8_CODEC_US_PER_MIB / 4)
    # a record that measured the path keeps its fitted terms: no codec on top
    fitted = replace(cm.PROTOCOL_COSTS, paths={**cm.PROTOCOL_COSTS.paths,
                                               "direct_2s_int8": cm.PROTOCOL_COSTS.paths["direct_2s"]})
    assert cm.breakdown("all_reduce", 8, 262144, "int8", costs=fitted, options=native).latency_s == t16.latency_s

    base = {r["cell"]: r for r in decode_step_prediction(GLM)}
    rows = {r["cell"]: r for r in decode_step_prediction(GLM, int8_all_reduce=True)}
    layer = rows["8x22k"]["calls_by_kind"][0]  # 256 KiB: beyond the direct reach, a barrier path's INT8
    assert layer["bytes"] == 262144 and layer["path"] in ("one_shot_int8", "two_shot_int8")
    assert layer["us"] == pytest.approx(cm.time("all_reduce", 8, 262144, "int8") * 1e6, abs=0.01)
    assert all(k["path"] == "direct_2s_int8" for k in rows["1x64k"]["calls_by_kind"]
               if k["op"] == "all_reduce")
    assert rows["8x22k"]["ms"] < base["8x22k"]["ms"]
    for lv in decode_levers(GLM):
        if lv["lever"] == "INT8 decode all-reduce":
            assert lv["ms"] == pytest.approx(rows[lv["cell"]]["ms"], abs=2e-3)
            assert "direct_2s_int8" in lv["note"]
