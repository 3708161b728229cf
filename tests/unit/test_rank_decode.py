"""The rank decode record: the bytes model and the components read from a profiled cell."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import rank_decode  # noqa: E402


def test_expert_bytes_follow_the_distinct_experts():
    b8 = rank_decode.step_bytes(8, 22_000, 3)
    b1 = rank_decode.step_bytes(1, 64_000, 3)
    per_expert = 1_598_976  # one expert's 4-bit EXL3 slice on a TP8 rank (bench/results/moe-decode-h200.json)
    from glmctl.plan.prediction.decode_bytes import distinct_experts as d
    want = per_expert * (42 * d(32, 288, 8) + d(32, 288, 8) + 2 * d(8, 288, 8))
    assert b8["routed_experts"] == pytest.approx(want, rel=1e-3)
    assert b1["routed_experts"] < b8["routed_experts"] / 4
    # weights do not depend on the batch; attention reads grow with the context
    assert b1["fp8_linear"] == b8["fp8_linear"]
    assert rank_decode.step_bytes(8, 64_000, 3)["indexer"] > b8["indexer"]


def test_cell_components_and_floor():
    table = [{"name": "void exl3_moe_coop_ns::exl3_moe_coop_a_kernel<4, 2, true, false>", "calls_per_iteration": 45,
              "us_per_iteration": 4000.0},
             {"name": "void marlin::Marlin<1, 2>", "calls_per_iteration": 276, "us_per_iteration": 2900.0},
             {"name": "mystery_kernel", "calls_per_iteration": 1, "us_per_iteration": 100.0},
             {"name": "Memcpy DtoD (Device -> Device)", "calls_per_iteration": 3, "us_per_iteration": 20.0}]
    cell = {"cell": "8x22k", "step_ms": 17.4, "breakdown": {"kernels_table": table, "us_per_iteration": {}}}
    e = rank_decode.cell_entry(cell, mtp=3, copy_bw=4.19e12)
    comps = {c["name"]: c for c in e["components"]}
    assert comps["routed_experts"]["us_per_step"] == 4000.0
    assert comps["fp8_linear"]["us_per_step"] == 2900.0
    assert comps["memcpy"]["us_per_step"] == 20.0
    need = rank_decode.step_bytes(8, 22_000, 3)
    assert comps["routed_experts"]["frac_copy"] == round(need["routed_experts"] / 4000e-6 / 4.19e12, 3)
    assert e["floor_ms"] == round(sum(need.values()) / 4.19e12 * 1e3, 3)
    assert e["other_frac"] == round(100.0 / 7020.0, 4)
    assert e["measured_over_target"] == round(17.4 / 7.0, 2)


def test_kernel_choices_name_what_ran():
    stock = {"cells": [{"breakdown": {"kernels_table": [{"name": "void marlin::Marlin<...>"}]}}]}
    ours = {"cells": [{"breakdown": {"kernels_table": [{"name": "_fp8_block_linear_kernel"},
                                                       {"name": "_bf16_gemv_kernel"}]}}]}
    assert rank_decode.kernel_choices([stock]) == rank_decode.KERNEL_CHOICES
    choices = rank_decode.kernel_choices([stock, ours])
    assert "glmctl's Triton W8A16" in choices["fp8_linear"] and "GEMV" in choices["dense_gemm"]
    assert choices["routed_experts"] == rank_decode.KERNEL_CHOICES["routed_experts"]
