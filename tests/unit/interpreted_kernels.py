"""What every Triton kernel test file declares to run its kernels in the interpreter (the CPU unit lane).

The interpreter is chosen when triton is first imported (see
:func:`glmctl.kernels.triton_env.import_interpreted`), so a test file imports its kernel modules
through :func:`interpreted_kernels`, before anything else imports triton, and binds what it
returns at module level::

    _modules, interpreted, test_in_fresh_process, _interpreter = interpreted_kernels(
        __file__, "glmctl.kernels.kpool_topk", "glmctl.kernels.kpool_topk_packed")

* ``_modules``: the modules in the order named, or None when triton was already imported
  compiled in this process;
* ``interpreted``: the mark for the tests that run the kernels; they are skipped when
  ``_modules`` is None ...
* ``test_in_fresh_process``: ... and this test then re-runs the whole file under
  ``TRITON_INTERPRET=1`` in a new process, failing unless the child passed a test and failed
  none; it is skipped when the modules loaded here;
* ``_interpreter``: an autouse fixture that sets ``TRITON_INTERPRET=1`` for each test, so the
  launchers pick their interpreter-safe dtypes (``triton_env.dot_dtype``).

pytest collects a test and registers a fixture by the module-level name they are bound to, so
the test must be bound to a ``test_`` name and the fixture to any module-level name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from glmctl.kernels.triton_env import import_interpreted, run_in_fresh_interpreter_process


class InterpretedKernels(NamedTuple):
    modules: list | None
    interpreted: pytest.MarkDecorator
    test_in_fresh_process: Callable[[], None]
    interpreter_fixture: Any


def interpreted_kernels(test_file: str, *module_names: str) -> InterpretedKernels:
    """Import ``module_names`` for the interpreter and build the pieces (module doc) for the
    test file at ``test_file`` (pass its ``__file__``)."""
    modules = import_interpreted(*module_names)

    # pytest reports this skip at this file's line, so the reason names the test file
    @pytest.mark.skipif(modules is not None, reason=f"ran in this process ({Path(test_file).name})")
    def test_in_fresh_process():
        run_in_fresh_interpreter_process(test_file)

    @pytest.fixture(autouse=True)
    def interpreter_env(monkeypatch):
        monkeypatch.setenv("TRITON_INTERPRET", "1")

    interpreted = pytest.mark.skipif(modules is None, reason="re-run by test_in_fresh_process")
    return InterpretedKernels(modules, interpreted, test_in_fresh_process, interpreter_env)
