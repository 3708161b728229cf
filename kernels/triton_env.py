"""What the Triton interpreter (``TRITON_INTERPRET=1``, the CPU unit lane) gets wrong, and the one
switch the launchers use to stay testable under it.

Checked with triton 3.9.0 on CPU:

* ``tl.dot`` of two bf16 tensors returns garbage (errors of 1e11 on unit-normal inputs); fp16
  and fp32 dots are right. Launchers therefore pass ``DOT_DTYPE = tl.float32`` under the
  interpreter and bf16/fp16 on a GPU: the CPU tests check indexing, masking, the online
  softmax and the split merge; the 16-bit rounding itself is checked by the GPU lane.
* fp32 -> float8e4nv conversion rounds wrongly (see :mod:`.fp8_bits`, which avoids it).
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(gpu_dtype=None):
    """Operand dtype for the kernels' matrix products: ``gpu_dtype`` (bf16 by default) on a GPU,
    fp32 under the interpreter."""
    import triton.language as tl

    if interpreting():
        return tl.float32
    return tl.bfloat16 if gpu_dtype is None else gpu_dtype


def import_interpreted(*module_names: str) -> list | None:
    """Import kernel modules so that their kernels run in the Triton interpreter (for tests).

    The interpreter is chosen when ``@triton.jit`` runs, for our kernels and for Triton's own
    ``tl.max``/``tl.sum``..., so ``TRITON_INTERPRET=1`` must be set before ``triton`` is first
    imported in the process. Returns the modules, or None when triton was already imported
    without the interpreter (the caller then re-runs its tests in a fresh process, see
    :func:`run_in_fresh_interpreter_process`). The variable is restored afterwards so that
    processes started later (vLLM servers in the vllm lane) do not inherit it.
    """
    import importlib
    import sys

    if "triton" in sys.modules:
        import triton.language as tl_mod

        if type(tl_mod.standard.max).__name__ != "InterpretedFunction":
            return None
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        modules = [importlib.import_module(name) for name in module_names]
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    # A module imported earlier without the interpreter keeps compiled-mode kernels.
    for module in modules:
        if any(type(obj).__name__ == "JITFunction" for obj in vars(module).values()):
            return None
    return modules


def run_in_fresh_interpreter_process(test_file: str, timeout: float = 600.0, cwd: str | None = None) -> None:
    """Run a kernel test file under ``TRITON_INTERPRET=1`` in a new Python process; raise with its
    output unless it passed at least one test and failed none. A child that collected nothing or
    skipped everything exits 0 too, but proved nothing."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with tempfile.TemporaryDirectory(prefix="glmctl-fresh-") as tmp:
        report = Path(tmp) / "junit.xml"
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", test_file],
            capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd,
        )
        problem = child_run_problem(result.returncode, junit_counts(report))
    if problem is not None:
        raise AssertionError(f"{test_file} in a fresh process: {problem}\n{result.stdout[-4000:]}"
                             f"\n{result.stderr[-2000:]}")


def junit_counts(report) -> dict[str, int] | None:
    """{"tests", "failures", "errors", "skipped"} summed over a pytest JUnit XML report's suites;
    None when there is no readable report (the child died before writing it)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}


def child_run_problem(returncode: int, counts: dict[str, int] | None) -> str | None:
    """Why a fresh-process test run does not count as passed, or None when it does."""
    if counts is None:
        return f"no test report (exit status {returncode})"
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    if counts["failures"] or counts["errors"]:
        return f"{counts['failures']} failed, {counts['errors']} errors, {passed} passed"
    if returncode != 0:
        return f"exit status {returncode}"
    if passed < 1:
        return f"no test passed ({counts['tests']} collected, {counts['skipped']} skipped)"
    return None
