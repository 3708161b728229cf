"""bench/gpu/vllm_lane.sh's control flow on the CPU, with a stand-in `python3` whose two pytest runs
(the lane, the DFlash2 cases) only write to the record: the DFlash2 cases start after the lane's
warm-up, the record names every case, nothing the lane started outlives it, and the script ends
within its budget even when the lane's tests hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "bench" / "gpu" / "vllm_lane.sh"
STAND_IN = r"""#!/usr/bin/env bash
# python3 for the test: pip and the environment line are no-ops, the two pytest runs pretend
case "$*" in
  "-m pip"*) exit 0 ;;
  "-") cat > /dev/null; echo "stand-in environment"; exit 0 ;;
  *test_vllm_lane_gpu.py*)
    sleep 1
    echo '{"ended_by": "phase"}' > "$GLMCTL_GPU_LANE_WORK/warm.done"
    "$REAL_PYTHON" -c "from tests.gpu.lane_record import record_case; record_case('eager', True, 'stand-in')"
    setsid sleep 300 < /dev/null > /dev/null 2>&1 &   # a process group a killed lane would leave behind
    echo $! > "$GLMCTL_LANE_PGID_DIR/$!.pgid"
    echo $! > "$STAND_IN_DIR/leftover.pid"
    sleep "$LANE_SLEEP"
    echo "1 passed" ;;
  *test_vllm_dflash2_gpu.py*)
    [ -f "$GLMCTL_GPU_LANE_WORK/warm.done" ] && touch "$STAND_IN_DIR/dflash-after-warm"
    "$REAL_PYTHON" -c "from tests.gpu.lane_record import record_case; record_case('dflash2_greedy', True, 'x')"
    echo "1 passed" ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


pytestmark = pytest.mark.skipif(subprocess.run(["which", "setsid", "timeout"], capture_output=True).returncode != 0,
                                reason="needs setsid and timeout (util-linux, coreutils)")


def _run_script(tmp_path: Path, budget: int, lane_sleep: float) -> tuple[subprocess.CompletedProcess, float, Path]:
    bin_dir, site = tmp_path / "bin", tmp_path / "vsite"
    bin_dir.mkdir()
    (site / "vllm").mkdir(parents=True)
    (bin_dir / "python3").write_text(STAND_IN)
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "REAL_PYTHON": sys.executable,
           "STAND_IN_DIR": str(tmp_path), "LANE_SLEEP": str(lane_sleep), "OUT": str(out),
           "VLLM_LANE_BUDGET": str(budget), "VLLM_LANE_SITE": str(site), "VLLM_LANE_ENTRY": str(tmp_path / "entry"),
           "GLMCTL_GPU_LANE_WORK": str(tmp_path / "work"), "GLMCTL_GPU_LANE_CACHE": str(tmp_path / "cache")}
    t = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=budget + 60)
    return proc, time.monotonic() - t, out


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent, not the lane, reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_the_lane_script_finishes_the_record_and_leaves_nothing_running(tmp_path):
    proc, seconds, out = _run_script(tmp_path, budget=120, lane_sleep=1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "dflash-after-warm").exists()
    record = json.loads((out / "vllm-gpu-lane.json").read_text())
    cases = {c["name"]: c for c in record["cases"]}
    assert cases["eager"]["passed"] and cases["dflash2_greedy"]["passed"]
    assert cases["dflash2_capacity"]["detail"].startswith("not run: no DFlash2 test recorded it")
    assert cases["serve_http"]["detail"].startswith("not run: no test recorded it")
    assert proc.stdout.rstrip().splitlines()[-1] == f"2/{len(cases)} cases passed"  # the table comes last
    assert _gone(int((tmp_path / "leftover.pid").read_text()))
    assert not (out / "vllm-gpu-lane.json.lock").exists()
    assert not [p for p in ("kernels", "quantize", "profiles") if (REPO / "glmctl" / p).is_symlink()]  # installed
    dists = list((tmp_path / "entry").glob("glmctl-*.dist-info"))  # one entry point for vLLM, no second copy
    assert len(dists) == 1
    assert "glmctl = glmctl.plugin:register" in (dists[0] / "entry_points.txt").read_text()


def test_a_hung_lane_is_stopped_within_the_budget(tmp_path):
    proc, seconds, out = _run_script(tmp_path, budget=50, lane_sleep=300)
    assert seconds < 50 + 5, seconds
    assert proc.returncode == 124, proc.stdout + proc.stderr
    record = json.loads((out / "vllm-gpu-lane.json").read_text())
    cases = {c["name"]: c for c in record["cases"]}
    assert cases["kv_fp8"]["detail"] == "not run: the lane's tests hit their limit (50 s script budget)"
    assert cases["dflash2_greedy"]["passed"]  # it ran beside the hung lane, from the warm-up on
    assert _gone(int((tmp_path / "leftover.pid").read_text()))
