"""Resumable JSON Lines result files: a header line, then one line per finished unit of work.

A line is appended (and fsynced) as soon as its unit is done, so a killed run resumes where it
stopped. Reading tolerates exactly one kind of damage, a last line cut off mid-write, which is
dropped before anything is appended; any other unreadable line is an error that names the line.
The header's `identity` must match the new run's, or the file is refused rather than mixed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel

from glmctl.errors import UsageError


def read_records(path: Path, what: str) -> list[dict]:
    """The parsed lines of `path` ([] when it does not exist), without a cut-off last line."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict) or "kind" not in raw:
                raise ValueError("not a JSON object with a kind")
        except ValueError as exc:
            if number == len(lines):  # a crash mid-write: that unit simply runs again
                break
            raise UsageError(f"{path}:{number} is not a {what} line ({exc})",
                             hint="pass another --out, or --restart to start that file over") from exc
        records.append(raw)
    return records


def drop_cut_tail(path: Path) -> None:
    """Cut a last line that a crash left unfinished, so appended lines start on a line of their own."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    with path.open("r+b") as fh:
        fh.truncate(data.rfind(b"\n") + 1)


def append(path: Path, record: BaseModel | dict) -> None:
    text = record.model_dump_json() if isinstance(record, BaseModel) else json.dumps(record, allow_nan=False)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def start(path: Path, header: BaseModel) -> None:
    """A new file (or --restart): the header line alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("", encoding="utf-8")
    append(path, header)


def check_identity(path: Path, found: dict, wanted: dict, what: str) -> None:
    if found != wanted:
        diff = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
        raise UsageError(f"{path} holds a {what} run with other settings ({', '.join(diff)})",
                         hint="pass another file, or --restart to start that file over")
