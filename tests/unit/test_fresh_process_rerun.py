"""A test file re-run in a fresh interpreter counts only when the child passed a test and failed none."""

from __future__ import annotations

import pytest
from glmctl.kernels.triton_env import child_run_problem, run_in_fresh_interpreter_process

from tests.unit import collectives_interp


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "test_child.py"
    path.write_text("import pytest\n\n" + body)
    return str(path)


@pytest.mark.parametrize("rerun", [run_in_fresh_interpreter_process, collectives_interp.rerun_fresh])
def test_a_child_that_runs_no_test_fails_the_rerun(tmp_path, rerun):
    only_skips = _write(tmp_path, "@pytest.mark.skip(reason='nothing here')\ndef test_x():\n    pass\n")
    with pytest.raises(AssertionError, match="no test passed"):
        rerun(only_skips)


def test_a_failing_child_fails_and_a_passing_one_passes(tmp_path):
    with pytest.raises(AssertionError, match="1 failed"):
        run_in_fresh_interpreter_process(_write(tmp_path, "def test_a():\n    pass\n\ndef test_b():\n    assert False\n"))
    run_in_fresh_interpreter_process(_write(tmp_path, "def test_a():\n    pass\n\n@pytest.mark.skip\ndef test_b():\n    pass\n"))


def test_the_verdict_reads_the_counts_not_only_the_exit_status():
    counts = {"tests": 3, "failures": 0, "errors": 0, "skipped": 3}
    assert "no test passed" in child_run_problem(0, counts)
    assert "no test passed" in child_run_problem(0, {**counts, "tests": 0, "skipped": 0})
    assert "exit status 5" in child_run_problem(5, {**counts, "tests": 0, "skipped": 0})  # nothing collected
    assert child_run_problem(0, {**counts, "skipped": 2}) is None
    assert "1 errors" in child_run_problem(1, {**counts, "skipped": 0, "errors": 1})
    assert "no test report" in child_run_problem(1, None)
