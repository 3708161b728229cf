"""bench/exl3_decode_rate.py, exl3_floor.py and exl3_round_summary.py without a GPU: the SASS loop counter,
the floor model's arithmetic (the issue's 8x22k cell), the pipe-bound rate, the L40 prediction
and the round's summary table from a folder of results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import exl3_decode_rate as rate  # noqa: E402
import exl3_floor as floor  # noqa: E402
import exl3_round_summary  # noqa: E402

SASS = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   IMAD R2, R3, 0x83dcd12d, RZ ;
        /*0120*/                   IDP.4A.U8.U8 R4, R2, UR4, R5 ;
        /*0130*/                   PRMT R6, R4, 0x5410, R7 ;
        /*0140*/                   HMMA.16816.F32 R8, R12, R6, R8 ;
        /*0150*/               @P0 BRA 0x110 ;
        /*0160*/                   EXIT ;
"""


def test_loop_counts_take_the_backward_branch_span():
    counts = rate.loop_counts(SASS)
    assert counts == {"IMAD": 1, "IDP": 1, "PRMT": 1, "HMMA": 1, "BRA": 1}


def test_issue_bound_rate_is_the_tightest_pipe():
    row = {"instr_per_weight": 4.0, "fma_heavy_per_weight": 2.5, "alu_per_weight": 1.0}
    # issue: 32 / 4 = 8 weights per clock per sub-partition; FMA-heavy: 16 / 2.5 = 6.4
    assert floor.issue_bound_rate(row, sms=1, clock_hz=1.0) == pytest.approx(4 * 6.4)


def test_step_model_reproduces_the_issues_bytes_floor():
    steps = floor.step_model(4.2e12, 5e12)
    cell = steps["8x22k"]
    assert cell["touched_experts"] == pytest.approx(171.1, abs=0.1)
    # 45 layers x 171.1 experts x 1.6 MB / 4.2 TB/s
    assert cell["bytes_floor_ms"] == pytest.approx(45 * 171.1 * 1_598_976 / 4.2e12 * 1e3, rel=1e-3)
    assert cell["decode_floor_ms"] == pytest.approx(45 * 171.1 * 3 * 4096 * 256 / 5e12 * 1e3, rel=1e-3)
    assert cell["bound"] == "decode" and cell["floor_ms"] == cell["decode_floor_ms"]
    assert floor.step_model(4.2e12, 1e15)["8x22k"]["bound"] == "bytes"


def _result():
    rows = [{"kernel": "glmctl_stream", "config": "raw_k64_w4_s1_x4", "mode": "raw", "residency": res,
             "us": 1.0, "weights_per_s": wps, "frac_copy": 0.5} for res, wps in (("dram", 4e12), ("l2", 6e12))]
    rows.append({"kernel": "exllamav3_exl3_gemm", "config": "m8 kernel tag 90", "mode": "affine", "residency": "l2",
                 "us": 1.0, "weights_per_s": 5e12, "frac_copy": 0.4})
    isa = [{"arch": arch, "config": "raw_k64_w4_s1_x4", "instr_per_weight": n, "fma_heavy_per_weight": 2.1,
            "alu_per_weight": 2.0, "opcodes": {}} for arch, n in (("sm_90", 4.9), ("sm_89", 4.9))]
    return {"device": "NVIDIA H200", "sm_count": 132, "clock_hz": 1.98e9, "clock_label": "spec",
            "copy_bw_bytes_per_s": 4.2e12, "rows": rows, "isa": isa, "notes": []}


def test_l40_prediction_scales_the_measured_rate_by_sms_and_clock():
    result = _result()
    m = floor.model(result)
    l40 = m["l40"]
    assert l40["decode_rate"] == pytest.approx(6e12 * 142 * 2.49e9 / (132 * 1.98e9))
    assert l40["bytes_per_s"] == pytest.approx(864e9 * 4.2 / 4.8)
    assert l40["steps"]["8x22k"]["bound"] == "bytes"  # the L40 is bandwidth-bound
    assert m["device"]["glmctl_steps"]["8x22k"]["bound"] == "decode"  # the H200 at 6e12 weights/s is not
    assert "predicted" in l40["label"] and "measured" in m["device"]["bytes_per_s"]["label"]
    result["model"] = m
    text = rate.table(result)
    assert text.splitlines()[-1].startswith("| L40 predicted")


def test_round_summary_reads_what_the_round_left(tmp_path):
    result = _result()
    result["model"] = floor.model(result)
    (tmp_path / "exl3-decode-rate.json").write_text(json.dumps(result))
    bench = {"rows": [{"path": p, "tokens": t, "us": us, "frac_copy": 0.2} for p, t, us in
                      (("exl3_coop_lean", 32, 375.0), ("exl3_triton", 32, 150.0), ("exl3_triton.split4_s2", 32, 160.0))],
             "agree": {"exl3_triton": {"32": 1e-3}}, "notes": []}
    (tmp_path / "moe-bench-uniform.json").write_text(json.dumps(bench))
    (tmp_path / "exl3-decode-tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
        '<testcase name="a"/><testcase name="b"/><testcase name="c"><failure/></testcase></testsuite></testsuites>')
    text = exl3_round_summary.summary(tmp_path)
    assert "gpu tests: 2 passed, 1 failed, 0 skipped (c)" in text
    assert "| 32 | 375.0 | 150.0 | 0.40 | - | - | - | 0.2 |" in text
    assert "split4_s2@32 160.0" in text and "hot16: no moe-bench-hot16.json" in text
    assert "glmctl raw     dram 4.00 (raw_k64_w4_s1_x4)   l2 6.00" in text
