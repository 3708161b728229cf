"""Result files: one JSON document per run, written atomically, read back as a baseline.

Every result carries `kind` (perplexity, needle, bench), a schema version, when and against what it
was measured; `--baseline FILE` loads one and refuses a file of another kind or version.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from glmctl.errors import GlmctlError, UsageError

SCHEMA_VERSION = 1


class OutputError(GlmctlError):
    """A result could not be written (disk full, permissions). Exit code 1."""

M = TypeVar("M", bound=BaseModel)


class ServerInfo(BaseModel):
    url: str
    model: str
    max_model_len: int | None = None
    root: str | None = None  # vLLM: the checkpoint the served name stands for


def server_info(server) -> ServerInfo:
    model = server.model
    return ServerInfo(url=server.base_url, model=model.id, max_model_len=model.max_model_len, root=model.root)


def now() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


def check_writable(path: Path | None, flag: str = "--out") -> None:
    """Refuse before the run, not after it, an output path that cannot be written."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory", hint=f"give a file name, e.g. {flag} {path / 'result.json'}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path} exists and is not writable", hint=f"choose another {flag}")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot create files in {parent}", hint=f"choose another {flag}")


def write_atomic(path: Path, text: str) -> None:
    """Write next to `path` and rename over it: a crash never leaves a half file that looks valid."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600: a result is an ordinary file
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_result(path: Path, result: BaseModel) -> None:
    write_atomic(path, result.model_dump_json(indent=1) + "\n")


def load_result(path: Path, model: type[M], kind: str) -> M:
    """Read a result file written by an earlier run of the same command."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise UsageError(f"baseline {path} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"baseline {path} is not JSON ({exc.msg} at line {exc.lineno})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read baseline {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    if not isinstance(raw, dict) or raw.get("kind") != kind:
        found = raw.get("kind") if isinstance(raw, dict) else type(raw).__name__
        raise UsageError(f"baseline {path} is a {found!r} result, not a {kind!r} result",
                         hint=f"pass a file written by an earlier `glmctl ... --out` of the same check ({kind})")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(f"baseline {path} has schema version {raw.get('schema_version')}, "
                         f"this glmctl writes {SCHEMA_VERSION}", hint="re-run the baseline with this glmctl")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"baseline {path} does not validate: {where}: {first['msg']}") from exc
