"""Doctor verdict rules and rendering, from recorded reports (tests/unit/fixtures/doctor/).

- no-gpu-cpu-host.json: recorded by `glmctl doctor --quick --record` on the CPU dev machine;
- synthetic-8xL40-no-p2p.json: a synthetic 8x L40 VM record built from the field report's figures
  (NCCL ~1 GB/s, host memory ~100 GB/s, P2P reported inside a switch but writes dropped);
- h200-*.json (when present): recorded by the gpu lane on the H200 test machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmctl.collectives.cost_model import PROTOCOL_COSTS
from glmctl.probe.doctor_report import CollectivePoint, DoctorReport, Gpu, P2PPair
from glmctl.probe.p2p import classify
from glmctl.probe.verdict import ProfileFit, decide, prefill_floor

_LATENCY_S = PROTOCOL_COSTS.latency_us("two_shot", 8) * 1e-6  # one 8-rank two-shot call's fixed cost

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"


def load(name: str) -> DoctorReport:
    return DoctorReport.model_validate_json((FIXTURES / name).read_text())


def test_every_recorded_report_still_parses_and_renders():
    from rich.console import Console

    from glmctl.probe.doctor_tables import render

    files = sorted(FIXTURES.glob("*.json"))
    assert len(files) >= 2
    for f in files:
        report = load(f.name)
        console = Console(record=True, width=160)
        render(report, decide(report), console)
        text = console.export_text()
        assert "Verdict" in text and "Software" in text


def test_no_gpu_means_tiny_cpu_only():
    report = load("no-gpu-cpu-host.json")
    v = decide(report)
    assert not v.can_serve and "tiny-cpu only" in v.reasons[0]
    assert decide(report, chosen="tiny-cpu").can_serve
    assert v.prefill_floor_s is None


def test_l40_vm_without_p2p():
    report = load("synthetic-8xL40-no-p2p.json")
    v = decide(report)
    assert v.kernels.startswith("glmctl Triton") and "sm_8x" in v.kernels
    assert v.collectives_mode.startswith("host-staged")
    assert "NCCL_P2P_DISABLE=1" in v.required_settings and "--disable-custom-all-reduce" in v.required_settings
    assert any("reported but broken for 24 pairs" in r for r in v.reasons)
    # 11,520 two-shot all-reduces of 16 MiB: 8 ranks * 2.875 * 16 MiB through 100 GB/s each, plus
    # the protocol's fixed cost per call (measured on the thread rig)
    assert v.prefill_floor_s == pytest.approx(11_520 * (8 * 2.875 * 16 * 2**20 / 100e9 + _LATENCY_S),
                                              abs=0.1)
    assert v.prefill_floor_method.startswith("predicted")
    assert v.can_serve  # no profile fit given: GPUs and kernels allow it


def test_profile_fit_decides_the_exit():
    report = load("synthetic-8xL40-no-p2p.json")
    fits = [ProfileFit(profile="commercial", fits=False, reasons=["KV short by 3.1 GiB per GPU"]),
            ProfileFit(profile="latency", fits=True)]
    assert not decide(report, "commercial", fits).can_serve
    assert decide(report, "latency", fits).can_serve
    assert "profile commercial: KV short by 3.1 GiB per GPU" in decide(report, "commercial", fits).reasons


def _report_with(**kw) -> DoctorReport:
    base = load("synthetic-8xL40-no-p2p.json")
    return base.model_copy(update=kw)


def test_working_p2p_everywhere_means_nccl():
    report = _report_with(p2p=[P2PPair(src=i, dst=j, cuda_can_access=True, write_test="pass", state="ok")
                               for i in range(8) for j in range(8) if i != j])
    v = decide(report)
    assert v.collectives_mode.startswith("nccl") and not v.required_settings


def test_measured_nccl_faster_wins_without_p2p():
    base = load("synthetic-8xL40-no-p2p.json")
    faster = [c.model_copy(update={"busbw_gbps": 50.0}) if c.backend == "nccl" else c for c in base.collectives]
    v = decide(base.model_copy(update={"collectives": faster, "p2p": []}))
    assert v.collectives_mode.startswith("nccl (measured faster")


def test_quick_run_without_p2p_test_says_so():
    v = decide(_report_with(p2p=[]))
    assert v.collectives_mode.startswith("host-staged")
    assert any("not tested" in r for r in v.reasons)


def test_old_gpus_are_refused():
    report = _report_with(gpus=[Gpu(index=0, name="T4", compute_capability=(7, 5), memory_bytes=16 << 30)], p2p=[])
    v = decide(report)
    assert not v.can_serve and v.kernels.startswith("unsupported")


def test_hopper_uses_vllm_kernels():
    report = _report_with(gpus=[Gpu(index=0, name="H200", compute_capability=(9, 0), memory_bytes=141 << 30)], p2p=[])
    assert decide(report).kernels.startswith("vLLM's native")


@pytest.mark.parametrize(("can", "write", "state"), [
    (True, "pass", "ok"), (True, "fail", "reported-but-broken"), (True, "timeout", "reported-but-broken"),
    (False, "error", "not-supported"), (False, "pass", "not-reported-but-works"), (None, "skipped", "untested"),
])
def test_p2p_classification(can, write, state):
    assert classify(can, write) == state


def test_prefill_floor_scales_with_host_bandwidth():
    report = load("synthetic-8xL40-no-p2p.json")
    slow = report.model_copy(update={"bandwidth": [b.model_copy(update={"gbps": 50.0}) for b in report.bandwidth]})
    fixed = 11_520 * _LATENCY_S  # the data term doubles, the per-call cost stays
    assert prefill_floor(slow, 8)[0] - fixed == pytest.approx(2 * (prefill_floor(report, 8)[0] - fixed),
                                                              rel=0.01)
    assert prefill_floor(report, 1) is None


def test_busbw_formula_matches_nccl_tests():
    from glmctl.probe.nccl_bench import busbw_all_reduce

    assert busbw_all_reduce(10.0, 8) == pytest.approx(17.5)
    assert busbw_all_reduce(10.0, 2) == pytest.approx(10.0)


def test_cli_replay_exit_codes_and_json_schema(run_cli):
    bad = run_cli("doctor", "--from", str(FIXTURES / "no-gpu-cpu-host.json"), "--json")
    assert bad.returncode == 1
    doc = json.loads(bad.stdout)
    assert set(doc) == {"report", "verdict"}
    DoctorReport.model_validate(doc["report"])
    assert set(doc["verdict"]) >= {"can_serve", "kernels", "collectives_mode", "prefill_floor_s", "reasons"}
    ok = run_cli("doctor", "--from", str(FIXTURES / "synthetic-8xL40-no-p2p.json"), "--profile", "commercial")
    assert ok.returncode == 0, ok.stderr
    assert "host-staged" in ok.stdout


def test_doctor_without_gpu_runs_and_exits_1(run_cli, tmp_path):
    record = tmp_path / "r.json"
    proc = run_cli("doctor", "--quick", "--record", str(record), "--json", timeout=120)
    assert proc.returncode == 1
    verdict = json.loads(proc.stdout)["verdict"]
    assert "tiny-cpu only" in " ".join(verdict["reasons"])
    report = DoctorReport.model_validate_json(record.read_text())
    assert report.bandwidth and report.bandwidth[0].name.startswith("host memcpy")


def test_collective_point_schema_is_stable():
    fields = set(CollectivePoint.model_fields)
    assert fields == {"op", "backend", "dtype", "ranks", "bytes", "latency_us", "algbw_gbps", "busbw_gbps", "env"}


def test_shipped_profiles_judged_for_the_synthetic_l40_node():
    """Planned from the GLM-5.3-Flash preset with each profile's declared weight format: the
    commercial profile (EXL3 experts) fits 8 sessions on 8x L40 only because of its 4-bit experts."""
    from glmctl.probe.fits import fits_for_node

    report = load("synthetic-8xL40-no-p2p.json")
    fits = {f.profile: f for f in fits_for_node(report)}
    assert "tiny-cpu" not in fits  # a CPU profile is not a question for a GPU node
    assert fits["commercial"].fits and fits["latency"].fits
    assert not fits["noncommercial"].fits and "drafter" in fits["noncommercial"].reasons[0]
    four = report.model_copy(update={"gpus": report.gpus[:4]})
    assert all(not f.fits and "needs 8 GPUs" in f.reasons[0] for f in fits_for_node(four))


def test_preset_planning_uses_the_profiles_weight_format():
    from glmctl.plan import load_model_spec
    from glmctl.serving import profile_fit, profiles
    from tests.unit.fake_gpus import gpu

    gpus = [gpu(i, "NVIDIA L40", (8, 9), 44.99) for i in range(8)]
    preset = load_model_spec("glm-5.3-flash")
    commercial = profiles.load("commercial")
    as_fp8 = commercial.model_copy(update={"model": commercial.model.model_copy(update={"weights": "fp8"})})
    verdicts = [profile_fit.predict(prof, profile_fit.planned_model(prof, preset), profile_fit.profile_node(prof, gpus))
                for prof in (commercial, as_fp8)]
    assert verdicts[0].fits and verdicts[0].sessions_fit == 8
    assert not verdicts[1].fits  # FP8 experts leave no room for 8 x 256k sessions


def test_an_unknown_profile_or_an_unreadable_report_is_a_usage_error_before_probing(capsys, tmp_path):
    from tests.unit.cli_inproc import run_glmctl

    nosuch = run_glmctl(capsys, "doctor", "--profile", "nosuch")
    assert nosuch.code == 2 and "no serving profile named 'nosuch'" in nosuch.err
    assert "[doctor]" not in nosuch.err  # nothing was probed
    missing = run_glmctl(capsys, "doctor", "--from", tmp_path / "none.json")
    assert missing.code == 2 and "does not exist" in missing.err
    for text in ("{not json", "[1, 2]", '{"gpus": "many"}'):
        (tmp_path / "bad.json").write_text(text)
        bad = run_glmctl(capsys, "doctor", "--from", tmp_path / "bad.json")
        assert bad.code == 2 and "is not a glmctl doctor report" in bad.err, bad.err
        assert "unexpected error" not in bad.err
    unwritable = run_glmctl(capsys, "doctor", "--from", FIXTURES / "no-gpu-cpu-host.json",
                            "--record", FIXTURES / "no-gpu-cpu-host.json" / "x.json")
    assert unwritable.code == 2 and "--record" in unwritable.err
