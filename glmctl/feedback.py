"""How a library speaks to whoever runs it, without knowing the CLI: notes, warnings, a progress
bar and a yes/no question, each a callback. The CLI builds one from its `Output`
(`Output.feedback()`); tests and other callers pass their own; the default says nothing, draws
nothing and never asks (a question nobody can answer is a refusal).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any


def _silent(message: str) -> None:
    pass


def _no_bar() -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Feedback:
    note: Callable[[str], None] = _silent
    """A line for the operator."""
    warn: Callable[[str], None] = _silent
    """Something the operator should act on; the work goes on."""
    progress: Callable[[], AbstractContextManager[Any]] = _no_bar
    """A context giving an object with rich.progress.Progress's add_task/advance, or None."""
    bars: bool = False
    """Whether a library's own progress bars (huggingface_hub's) may draw."""
    confirm: Callable[[Any], bool] | None = None
    """Ask the operator to accept something (a licence); None: nobody can be asked."""


QUIET = Feedback()
