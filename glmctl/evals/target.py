"""The server a check runs against: a running one (`--url`), or one started from a profile.

A profile-started server lives exactly as long as the check: it is launched through
glmctl.serving (the same path as `glmctl serve --profile`), waited for, and stopped afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from glmctl.errors import UsageError
from glmctl.evals.client import OpenAIServer


@contextlib.contextmanager
def open_server(url: str | None, profile: str | None, *, model: str | None = None,
                model_path: Path | None = None, timeout: float = 600.0,
                note: Callable[[str], None] | None = None) -> Iterator[OpenAIServer]:
    if (url is None) == (profile is None):
        raise UsageError("pass exactly one of --url (a running server) or --profile (start one)",
                         hint="e.g. --url http://127.0.0.1:8000")
    if url is not None:
        with OpenAIServer(url, model, timeout=timeout) as server:
            server.connect()
            yield server
        return
    with _launched(profile, model_path, note) as base_url, OpenAIServer(base_url, model, timeout=timeout) as server:
        server.connect()
        yield server


@contextlib.contextmanager
def _launched(profile: str, model_path: Path | None, note: Callable[[str], None] | None) -> Iterator[str]:
    try:
        from glmctl.serving import launch  # the serve engineer's launch library (issue 8)
    except ImportError as exc:
        raise UsageError(
            "--profile needs glmctl's serving launcher, which this build does not have yet",
            hint="start the server yourself (glmctl serve or vllm serve) and pass --url",
        ) from exc
    with launch.running(profile, model=model_path, note=note) as handle:
        yield handle.base_url
