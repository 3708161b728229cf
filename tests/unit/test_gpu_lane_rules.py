"""The vLLM lanes' judging rules on made-up runs (tests/vllm/noise_floor.py), and the gpu lane's
record file (tests/gpu/lane_record.py): what a near-tie is, what a defect is, what gets recorded."""

from __future__ import annotations

import json

import numpy as np

from tests.gpu import lane_record
from tests.vllm import noise_floor as nf


def _step(token: int, lp: float, other: int, other_lp: float) -> dict:
    top = sorted([[token, lp], [other, other_lp]], key=lambda x: -x[1])
    return {"token": token, "top": top}


def test_runs_that_part_at_a_near_tie_the_reference_cannot_decide():
    a = [_step(5, -0.5, 6, -2.0), _step(7, -1.00, 8, -1.02)]
    b = [_step(5, -0.5, 6, -2.0), _step(8, -1.01, 7, -1.015)]
    d = nf.classify_divergence("p", a, b, floor=0.3, reference_top2=((7, -1.0), (8, -1.05)))
    assert (d.kind, d.step, d.tokens) == ("near-tie", 1, (7, 8))
    assert d.max_delta_before == 0.0 and abs(d.reference_margin - 0.05) < 1e-9


def test_a_decisive_reference_or_an_earlier_logprob_gap_makes_it_a_defect():
    a = [_step(5, -0.5, 6, -2.0), _step(7, -0.2, 8, -3.0)]
    b = [_step(5, -0.5, 6, -2.0), _step(8, -0.9, 7, -1.0)]
    decisive = nf.classify_divergence("p", a, b, floor=0.3, reference_top2=((7, -0.2), (8, -3.0)))
    assert decisive.kind == "defect" and "exceeds the floor" in decisive.reason
    drifted = [_step(5, -1.5, 6, -2.0), _step(8, -1.01, 7, -1.015)]
    early = nf.classify_divergence("p", [_step(5, -0.5, 6, -2.0), _step(7, -1.0, 8, -1.02)], drifted, floor=0.3,
                                   reference_top2=((7, -1.0), (8, -1.05)))
    assert early.kind == "defect" and "before step 1" in early.reason
    third = nf.classify_divergence("p", a, b, floor=5.0, reference_top2=((7, -0.2), (9, -0.3)))
    assert third.kind == "defect" and "not the chosen" in third.reason
    same = nf.classify_divergence("p", a, a, floor=0.3)
    assert same.kind == "same" and same.step is None


def test_a_routing_near_tie_excuses_a_token_the_reference_does_not_rank_but_a_decisive_routing_does_not():
    """The batch-invariance parting seen on the H200: the batched run took a token outside the
    reference's top-2 at a position whose fp32 MoE routing gap was 0.0027."""
    a = [_step(5, -0.5, 6, -2.0), _step(912, -2.67, 772, -2.79)]
    b = [_step(5, -0.5, 6, -2.0), _step(128, -2.68, 912, -2.90)]
    top2 = ((912, -2.66), (772, -2.76))
    tie = nf.classify_divergence("p", a, b, floor=1.16, reference_top2=top2, routing_gap=0.0027)
    assert tie.kind == "near-tie" and "routing near-tie" in tie.reason
    decisive = nf.classify_divergence("p", a, b, floor=1.16, reference_top2=top2, routing_gap=0.05)
    assert decisive.kind == "defect" and "routing there is decisive" in decisive.reason
    assert nf.classify_divergence("p", a, b, floor=1.16, reference_top2=top2).kind == "defect"
    # a routing near-tie does not excuse runs whose log p already differed beyond the floor
    far = [_step(5, -0.5, 6, -2.0), _step(912, -2.67, 772, -2.79)]
    far_b = [_step(5, -2.0, 6, -2.1), _step(128, -2.68, 912, -2.90)]
    assert nf.classify_divergence("p", far, far_b, floor=1.16, reference_top2=top2, routing_gap=0.001).kind == "defect"


def test_greedy_parity_may_part_at_a_decisive_margin_only_where_routing_is_a_near_tie():
    reference = {"x": [(1, 2.0, 0.05), (2, 2.0, 0.001), (3, 2.0, 0.05)]}
    assert nf.greedy_parity({"x": [1, 9, 9]}, reference, floor=0.5).passed is False  # too few followed
    assert not [f for f in nf.greedy_parity({"x": [1, 9, 9]}, reference, floor=0.5).failures
                if "decisive" in f and "too few" not in f]
    bad = nf.greedy_parity({"x": [1, 2, 9]}, {"x": [(1, 2.0, 0.05), (2, 2.0, 0.05), (3, 2.0, 0.05)]}, floor=0.5)
    assert any("step 2" in f for f in bad.failures)


def test_logprob_parity_judges_each_prompt_at_decisively_routed_positions_and_pools_all():
    fp32 = {"p": np.linspace(-3, -1, 40)}
    bf16 = {"p": fp32["p"] + 0.01}
    served = {"p": fp32["p"].copy()}
    served["p"][7] += 1.5  # one swapped expert at a routing near-tie
    gaps = {"p": np.full(40, 0.05)}
    gaps["p"][7] = 0.001
    assert not nf.logprob_parity(served, fp32, fp32, bf16).passed
    judged = nf.logprob_parity(served, fp32, fp32, bf16, routing_gaps=gaps)
    assert not [f for f in judged.failures if f.startswith("p:")], judged.failures
    assert judged.tokens == 40 and judged.mean > 0.03  # the pooled figure still counts position 7
    few = {"p": np.full(40, 0.001)}
    assert any("route decisively" in f for f in nf.logprob_parity(served, fp32, fp32, bf16, routing_gaps=few).failures)


def test_greedy_parity_allows_parting_only_where_not_decisive():
    reference = {"x": [(1, 2.0), (2, 2.0), (0, 2.0), (3, 0.1), (4, 2.0)]}
    assert nf.greedy_parity({"x": [1, 2, 0, 9, 9]}, reference, floor=0.5).passed
    bad = nf.greedy_parity({"x": [1, 9, 0, 3, 4]}, reference, floor=0.5)
    assert not bad.passed and "decisive" in bad.failures[0]
    too_few = nf.greedy_parity({"x": [1, 2, 0, 9, 9]}, reference, floor=5.0)
    assert not too_few.passed and "too few" in too_few.failures[0]


def test_logprob_parity_pools_and_skips_per_prompt_bounds_for_short_prompts():
    rng = np.random.default_rng(0)
    fp32 = {"long": rng.normal(-3, 1, 200), "short": rng.normal(-3, 1, 8)}
    bf16 = {n: v + rng.normal(0, 0.05, v.size) for n, v in fp32.items()}
    served = {n: v + rng.normal(0, 0.05, v.size) for n, v in fp32.items()}
    served["short"][3] += 0.8  # one noisy token of an 8-token prompt
    check = nf.logprob_parity(served, fp32, fp32, bf16)
    assert check.passed and check.tokens == 208 and len(check.rows) == 2, check.failures
    served["long"] = served["long"] + 0.3  # a biased path
    assert not nf.logprob_parity(served, fp32, fp32, bf16).passed
    assert nf.logprob_parity(served, fp32, fp32, bf16, sides=2).limit_mean > check.limit_mean


def test_fp8_kv_bounds():
    base = {"p": np.linspace(-5, 0, 100)}
    assert nf.fp8_kv_parity({"p": base["p"] + 0.1}, base).passed
    assert not nf.fp8_kv_parity({"p": base["p"] + 0.2}, base).passed


def test_record_cases_replace_by_name_and_missing_ones_count_as_not_passed(tmp_path, monkeypatch):
    path = tmp_path / "out" / "vllm-gpu-lane.json"
    monkeypatch.setenv(lane_record.RECORD_ENV, str(path))
    lane_record.record_environment(vllm_version="0.30.0", torch_version="2.11.0", device="H200")
    lane_record.record_case("eager", False, "first try")
    lane_record.record_case("eager", True, "second try", data={"mean": 0.01})
    lane_record.record_case("dflash2_greedy", True, "another engineer's case")
    record = lane_record.finish_record(path)
    names = [c["name"] for c in record["cases"]]
    assert names.count("eager") == 1 and "dflash2_greedy" in names
    assert set(lane_record.REQUIRED_CASES) <= set(names)
    eager = next(c for c in record["cases"] if c["name"] == "eager")
    assert eager == {"name": "eager", "passed": True, "detail": "second try", "data": {"mean": 0.01}}
    missing = next(c for c in record["cases"] if c["name"] == "serve_http")
    assert missing["passed"] is False and missing["detail"].startswith("not run")
    assert json.loads(path.read_text())["device"] == "H200"
    table = lane_record.render_table(record)
    assert table.splitlines()[-1] == f"2/{len(names)} cases passed"
    monkeypatch.delenv(lane_record.RECORD_ENV)
    lane_record.record_case("eager", False, "no record file: nothing happens")
    assert json.loads(path.read_text()) == record
