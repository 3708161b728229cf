"""How commands talk to people and to machines.

Three modes: `human` (Rich tables and progress bars on a terminal), `json` (one JSON document on
stdout and nothing else there; progress and notes go to stderr without colour) and `quiet` (only
errors). A command builds its result as data (a pydantic model, dataclass or dict), then calls
`Output.result(data, render)`; `render` draws the human form and is skipped in the other modes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from rich.console import Console


class Mode(StrEnum):
    human = "human"
    json = "json"
    quiet = "quiet"


def to_jsonable(data: Any) -> Any:
    """Turn pydantic models, dataclasses, enums and paths into plain JSON values."""
    if hasattr(data, "model_dump"):
        return data.model_dump(mode="json")
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return to_jsonable(dataclasses.asdict(data))
    if isinstance(data, dict):
        return {str(k): to_jsonable(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [to_jsonable(v) for v in data]
    if isinstance(data, Enum):
        return data.value
    if isinstance(data, Path):
        return str(data)
    if isinstance(data, float) and (data != data or data in (float("inf"), float("-inf"))):
        return None  # JSON has no NaN/inf; null says "not measured" honestly
    return data


class Output:
    def __init__(self, mode: Mode = Mode.human) -> None:
        self.mode = mode
        # stdout carries the result; stderr carries notes and progress in every mode.
        self.out = Console(highlight=False, soft_wrap=False)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True, no_color=mode is not Mode.human)

    @classmethod
    def from_flags(cls, json_: bool = False, quiet: bool = False) -> Output:
        return cls(Mode.json if json_ else Mode.quiet if quiet else Mode.human)

    @property
    def human(self) -> bool:
        return self.mode is Mode.human

    def note(self, message: str) -> None:
        """A line for the operator (stderr); silent in quiet mode. Plain text: never parsed as markup."""
        if self.mode is not Mode.quiet:
            self.err.print(message, markup=False)

    def warn(self, message: str) -> None:
        from rich.markup import escape

        self.err.print(f"[yellow]warning:[/yellow] {escape(message)}" if self.human else f"warning: {message}",
                       markup=self.human)

    def feedback(self, confirm: Callable[[Any], bool] | None = None):
        """This output as a library's callbacks (`glmctl.feedback.Feedback`); `confirm`: the
        question to ask, when there is a terminal to ask on."""
        from glmctl.feedback import Feedback

        return Feedback(note=self.note, warn=self.warn, progress=self.progress, bars=self.human, confirm=confirm)

    def result(self, data: Any, render: Callable[[Console], None] | None = None) -> None:
        """Emit the command's result: JSON on stdout, or the human rendering."""
        if self.mode is Mode.json:
            sys.stdout.write(json.dumps(to_jsonable(data), indent=2, allow_nan=False) + "\n")
            sys.stdout.flush()
        elif self.mode is Mode.human:
            if render is not None:
                render(self.out)
            else:
                self.out.print_json(json.dumps(to_jsonable(data), allow_nan=False))

    @contextlib.contextmanager
    def progress(self, transient: bool = True, unit: str = "bytes") -> Iterator[Any]:
        """A Rich progress bar in human mode on a terminal; a do-nothing stand-in otherwise.

        `unit="bytes"` shows sizes and transfer speed; any other unit ("tokens", "cells") shows
        "done/total unit".
        """
        if self.human and self.err.is_terminal:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            amount = ([DownloadColumn(), TransferSpeedColumn()] if unit == "bytes"
                      else [MofNCompleteColumn(), TextColumn(unit)])
            columns = [
                TextColumn("{task.description}"),
                BarColumn(),
                *amount,
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            ]
            with Progress(*columns, console=self.err, transient=transient) as bar:
                yield bar
        else:
            yield _NoProgress()


class _NoProgress:
    """Same calls as rich.progress.Progress, no output: for json/quiet modes and pipes."""

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        return 0

    def update(self, task_id: int, **_: Any) -> None:
        pass

    def advance(self, task_id: int, advance: float = 1) -> None:
        pass
