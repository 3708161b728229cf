"""The shipped `vllm serve` flag list (glmctl/serving/vllm_serve_flags.json) is what the installed
vLLM's parser accepts: regenerated here and compared, so a vLLM upgrade cannot drift past it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.vllm


def test_shipped_flag_list_matches_vllms_parser():
    proc = subprocess.run([sys.executable, "scripts/gen_vllm_flags.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
