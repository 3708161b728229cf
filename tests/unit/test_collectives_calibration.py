"""The copy-engine calibration cache and what `glmctl doctor` reads from it (no torch, no GPU)."""

from __future__ import annotations

import sys

from glmctl.collectives.calibration import (
    CollectivesCalibration,
    EngineChoice,
    cache_path,
    calibration_status,
    load_calibration,
    save_calibration,
)


def _cal(device="NVIDIA H200"):
    choices = [
        EngineChoice(direction="d2h", band="small", probe_bytes=65536, ce_us=3.06, sm_us=1.62,
                     engine="sm"),
        EngineChoice(direction="h2d", band="small", probe_bytes=65536, ce_us=4.03, sm_us=3.77,
                     engine="sm"),
        EngineChoice(direction="d2h", band="large", probe_bytes=1 << 24, ce_us=307.2, sm_us=323.0,
                     engine="ce"),
        EngineChoice(direction="h2d", band="large", probe_bytes=1 << 24, ce_us=309.4, sm_us=333.2,
                     engine="ce"),
    ]
    return CollectivesCalibration(device=device, key="k", measured_at="2026-11-29T10:56:52+00:00",
                                  method="test", choices=choices, pinned_d2h_gbps=54.6,
                                  pinned_h2d_gbps=54.2)


def test_cache_round_trip_and_engines():
    assert load_calibration("NVIDIA H200") is None
    path = save_calibration(_cal())
    assert path == cache_path("NVIDIA H200") and path.name == "collectives-nvidia-h200.json"
    cal = load_calibration("NVIDIA H200")
    engines = cal.engines()
    assert (engines.d2h(4096), engines.h2d(4096), engines.d2h(1 << 30), engines.h2d(1 << 30)) == (
        "sm", "sm", "ce", "ce")


def test_status_for_doctor_lists_every_gpu():
    save_calibration(_cal("NVIDIA H200"))
    save_calibration(_cal("NVIDIA L40"))
    cache_path("broken").write_text("{not json")
    status = calibration_status()
    assert sorted(e.device for e in status.entries) == ["NVIDIA H200", "NVIDIA L40"]
    assert status.cache_dir.endswith("calibration")


def test_package_import_stays_light():
    import subprocess

    code = ("import sys, glmctl.collectives as c; c.calibration_status(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'triton'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_doctor_seam_shapes():
    """What glmctl doctor reads: the cached calibration as a model, probe rows as CollectivePoints."""
    from glmctl.collectives import probe
    from glmctl.probe.doctor_report import CollectivePoint

    assert probe.cached_calibration() is None
    save_calibration(_cal("NVIDIA L40"))
    assert probe.cached_calibration().device == "NVIDIA L40"
    assert probe.cached_calibration("NVIDIA H200") is None
    row = {"op": "all_reduce", "backend": "host-staged", "dtype": "int8", "ranks": 8, "bytes": 1 << 20,
           "latency_us": 40.0, "algbw_gbps": 10.0, "busbw_gbps": 17.5}
    assert CollectivePoint(**row).backend == "host-staged"
