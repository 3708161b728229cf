"""A glmctl command that holds servers in the foreground (`glmctl serve`, `glmctl fleet up`), as the
vllm lane drives it: the profile file it serves, the ready document it prints, the process groups
it must leave behind empty."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path


def profile_file(tmp_path: Path, kind: str, extra: str = "", name: str | None = None) -> str:
    """A profile extending tiny-cpu under the served name of the tiny model `kind` serves."""
    served = "tiny-llama" if kind == "llama" else "tiny"
    path = tmp_path / (name or f"tiny-{kind}.yaml")
    path.write_text(f"extends: tiny-cpu\nmodel:\n  served_name: {served}\n{extra}")
    return str(path)


def read_ready(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The JSON document the command prints on stdout once it serves (its --json output)."""
    text, ready = "", None
    deadline = time.monotonic() + timeout_s
    while ready is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break  # the command exited before it was ready
        text += line
        try:
            ready = json.loads(text)
        except ValueError:
            continue
    assert ready is not None, proc.stderr.read() if proc.poll() is not None else "no ready document"
    return ready


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False
