"""Run one of the vllm lane's subprocess scripts and read the JSON report it prints.

The scripts (`tiny_vllm_load.py`, `mtp_parity.py`, `test_quantize_vllm.py` as a script) build vLLM
objects in a fresh interpreter and print one line `@@<json>`; the last such line is the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

NO_TORCHVISION = REPO / "tests" / "vllm" / "no_torchvision"


def run_report(args: list[str], timeout: float, *, no_torchvision: bool = False, stderr_tail: int = 4000):
    """`python ARGS` from the repository root with it on PYTHONPATH (and the torchvision-free
    import shim first, if asked); fails with the end of stderr unless it exits 0 with a report."""
    paths = [str(NO_TORCHVISION)] if no_torchvision else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-stderr_tail:]
    return json.loads(lines[-1][2:])
