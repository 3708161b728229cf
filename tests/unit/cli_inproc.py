"""Run `glmctl ARGS` in this process, through the same guard as the console script (`main()`).

The subprocess runner (`run_cli` in tests/conftest.py) proves the real entry point; this one is for
the many failure-path cases, where a subprocess per case would cost more than the case itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class CliRun:
    code: int
    out: str
    err: str
    seconds: float

    @property
    def text(self) -> str:
        return self.out + self.err


def run_glmctl(capsys, *args: str) -> CliRun:
    from glmctl._cli.error_map import run_guarded
    from glmctl.app import app

    capsys.readouterr()
    started = time.monotonic()
    code = run_guarded(lambda: app([str(a) for a in args], prog_name="glmctl"))
    seconds = time.monotonic() - started
    captured = capsys.readouterr()
    return CliRun(code, captured.out, captured.err, seconds)
