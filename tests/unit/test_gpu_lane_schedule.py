"""The gpu lane's schedule on made-up processes (no GPU, no vLLM): limits from the first H200 run's
phases, the warm-up gate, a killed engine costing only its own case, the deadline, the clean-up of
process groups, and what the first run's eager log says it was doing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gpu import vllm_lane_cases as cases
from tests.gpu import vllm_lane_runs as runs
from tests.gpu import vllm_lane_schedule as sched

FIRST_RUN_LOG = Path(__file__).parent / "fixtures" / "gpu-lane" / "eager-first-run.log"


def _fake(work: Path, label: str, body: str, timeout: float, env: dict | None = None) -> sched.Job:
    return sched.Job(label, [sys.executable, "-c", body], work / f"{label}.log", timeout, env or dict(os.environ))


def _reporting(label: str, sleep: float = 0.0, phase: str = "requests") -> str:
    report = {"engines": {label: {"label": label, "prompt_logprobs": {}, "greedy": {"alone": {}, "batches": {},
                                                                              "copies4": {}},
                                  "mtp": {"natural": {}, "oracle": {}}, "config": {}, "kv_log": None}}}
    return (f"import time; print('##phase {phase} 0.1', flush=True); time.sleep({sleep}); "
            f"print('@@' + {json.dumps(json.dumps(report))})")


def test_the_first_runs_eager_log_says_it_was_compiling_kernels_for_its_first_requests():
    phases = sched.vllm_log_phases(FIRST_RUN_LOG.read_text())
    assert phases["resolved_s"] == 25.0 and phases["init_reported_s"] == 65.22
    names = [name for _, name in phases["request_jit"]]
    assert len(names) == 10 and names[0] == "BuildPrefillChunkMetadataKernel.kernel"
    assert {"_kpool_topk_kernel", "fused_moe_kernel", "_indexer_logits_paged_kernel"} <= set(names)
    assert phases["last_line_s"] == 126.0  # 126 s after vLLM's first line, killed at 150 s after the start


def test_limits_are_the_measured_phases_with_margin_and_the_expected_run_fits_the_budget():
    measured = sum(sched.FIRST_RUN_EAGER_S.values())
    assert measured >= 146  # what the first run saw before the kill at 150 s
    assert sched.COLD_ENGINE_S == round(sched.MARGIN * (measured + sum(sched.UNMEASURED_EAGER_S.values())))
    assert sched.COLD_ENGINE_S > 150  # the limit that killed the first run is below a cold start
    # expected (no margin): the warm-up up to its first requests, then the longest later engine
    # and the probes; inside the lane's share of the 570 s script budget (45 s kept for the end)
    gate = sched.FIRST_RUN_EAGER_S["start"] + sched.FIRST_RUN_EAGER_S["inspect"] + sched.FIRST_RUN_EAGER_S["init"] + 32
    later = max(sched.engine_limit(x) for x in ("graphs_full", "mtp3", "serve", "exl3_eager")) / sched.MARGIN
    assert gate + later + sched.PROBES_S / 2 < 570 - 15 - 45


def test_the_gate_opens_at_the_phase_marker_and_a_killed_job_says_where_it_was(tmp_path):
    job = _fake(tmp_path, "eager", "import time; print('##phase ready 1.0', flush=True); "
                                   "print('##phase requests 2.0', flush=True); time.sleep(30)", 1.5).start()
    assert job.wait_phase("requests", time.monotonic() + 10) == "phase"
    report = job.collect()
    assert "killed after 2 s" in report["error"] and "last phase requests at 2 s" in report["error"]
    assert report["phases"]["markers"] == {"ready": 1.0, "requests": 2.0}
    quick = _fake(tmp_path, "quick", "print('no phase')", 5).start()
    assert quick.wait_phase("requests", time.monotonic() + 10) == "exited"


def test_pool_keeps_every_other_jobs_verdict_and_respects_the_deadline(tmp_path):
    hung = _fake(tmp_path, "hung", "import time; time.sleep(60)", 1.0)
    ok = [_fake(tmp_path, f"ok{i}", _reporting(f"ok{i}", 0.2), 20) for i in range(3)]
    late = _fake(tmp_path, "late", _reporting("late"), 20)
    t = time.monotonic()
    results = sched.run_pool([hung, *ok, late], max_parallel=2, until=time.monotonic() + 2.5)
    assert time.monotonic() - t < 15
    assert "killed after" in results["hung"]["error"]
    assert all("engines" in results[f"ok{i}"] for i in range(3))
    assert results["late"].get("error", "").startswith("not run: the lane's deadline") or "engines" in results["late"]


def test_recorded_process_groups_are_stopped_by_id(tmp_path):
    folder = tmp_path / "pgids"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    sched.record_group({sched.PGID_DIR_ENV: str(folder)}, proc.pid)
    assert sched.stop_recorded_groups(folder) == [proc.pid]
    assert proc.wait(10) == -9 and not list(folder.glob("*.pgid"))
    assert sched.stop_recorded_groups(folder) == []


@pytest.fixture
def fake_lane(tmp_path, monkeypatch):
    """run_lane with every process replaced: the eager engine hangs past its limit, the rest report."""
    monkeypatch.setattr(sched, "COLD_ENGINE_S", 5.0)  # the shortest limit run_lane gives
    monkeypatch.setattr(sched, "max_parallel", lambda: 16)
    monkeypatch.setattr(runs, "lane_prompts", lambda ckpt: ({"short": [1, 2, 3]}, None, "made-up prompts"))

    def no_quantize(run, checkpoint, work, env, wanted, timeout, ckpts):
        run.quantize.update(fp8={"error": "glmctl quantize fp8: left out of this test"},
                            exl3={"error": "glmctl quantize exl3: left out of this test"})

    monkeypatch.setattr(runs, "_quantize", no_quantize)

    def engine_job(env, work, label, checkpoint, spec, timeout):
        body = "import time; time.sleep(60)" if label == "eager" else _reporting(label, 0.2)
        return _fake(work, label, body, timeout, env)

    def reference_job(env, device, work, label, checkpoints, timeout):
        return _fake(work, label, "print('@@' + '{\"checkpoints\": {}}')", timeout, env)

    monkeypatch.setattr(runs, "engine_job", engine_job)
    monkeypatch.setattr(runs, "reference_job", reference_job)
    monkeypatch.setattr(runs, "serve_job", lambda env, target, work, ckpt, timeout: _fake(
        work, "serve", "print('@@' + '{\"error\": \"made-up server\"}')", timeout, env))
    return runs.run_lane(tmp_path / "ckpt", tmp_path / "work", budget_s=90, on_stage=lambda line: None)


def test_a_hung_eager_engine_costs_its_own_case_and_no_other_engine(fake_lane, tmp_path):
    run = fake_lane
    assert "killed after 5 s" in run.engines["eager"]["error"]
    assert run.schedule["stage_a_ended_by"] == "deadline"
    for label in ("graphs_full", "graphs_piecewise", "kv_fp8", "kv_fp8_ds_mla", "mtp3"):
        assert "error" not in run.engines[label], (label, run.engines[label])
    assert run.engines["fp8_attention"]["error"].startswith("not run: no fp8 checkpoint (glmctl quantize fp8")
    assert run.references["exl3_deq"]["error"].startswith("not run: no exl3_deq checkpoint (glmctl quantize exl3")
    assert json.loads((tmp_path / "work" / "warm.done").read_text())["ended_by"] == "deadline"
    assert not list((tmp_path / "work" / "pgids").glob("*.pgid"))  # nothing left running

    # the cases name the failure of their own inputs first
    run.references["bf16"] = {"error": "made-up reference"}
    exl3 = cases.judge(run, "exl3_experts")
    assert not exl3.passed and exl3.detail.startswith("not run: no exl3 checkpoint (glmctl quantize exl3")
    fp8 = cases.judge(run, "fp8_attention")
    assert fp8.detail.startswith("not run: no fp8 checkpoint")
    eager = cases.judge(run, "eager")
    assert not eager.passed and eager.detail.startswith("eager engine failed: eager: killed after 5 s")
    graphs = cases.judge(run, "graphs_full")  # its engine ran: the missing reference is what it says
    assert graphs.detail == "not run: transformers reference bf16: made-up reference"
