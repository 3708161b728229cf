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
                checkpoint: Path | None = None, accept: list[str] | None = None, timeout: float = 600.0,
                note: Callable[[str], None] | None = None) -> Iterator[OpenAIServer]:
    """Connect to `url`, or start `profile` (with `checkpoint` as its model, `accept` licence ids)."""
    if (url is None) == (profile is None):
        raise UsageError("pass exactly one of --url (a running server) or --profile (start one)",
                         hint="e.g. --url http://127.0.0.1:8000")
    if url is not None:
        if checkpoint is not None or accept:
            raise UsageError("--checkpoint and --accept-license only apply with --profile")
        with OpenAIServer(url, model, timeout=timeout) as server:
            server.connect()
            yield server
        return
    with _launched(profile, checkpoint, accept or [], note) as base_url, \
            OpenAIServer(base_url, model, timeout=timeout) as server:
        server.connect()
        yield server


@contextlib.contextmanager
def _launched(profile: str, checkpoint: Path | None, accept: list[str],
              note: Callable[[str], None] | None) -> Iterator[str]:
    try:
        from glmctl.serving.server import start_server  # issue 8: the library behind `glmctl serve`
    except ImportError as exc:
        raise UsageError(
            "--profile needs glmctl's serving launcher, which this build does not have yet",
            hint="start the server yourself (glmctl serve or vllm serve) and pass --url",
        ) from exc
    if note:
        note(f"starting vLLM from profile {profile!r} (stopped again when the check ends)")
    with start_server(profile, model=checkpoint, port=None, accept=accept) as server:
        if note:
            note(f"vLLM is up at {server.info.base_url} after {server.info.startup_s:.0f} s (log: {server.info.log_path})")
        yield server.info.base_url
