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
from glmctl.evals.transport import ApiKey, Deadline, validate_url

STARTUP_TIMEOUT_S = 600.0


@contextlib.contextmanager
def open_server(url: str | None, profile: str | None, *, model: str | None = None,
                checkpoint: Path | None = None, accept: list[str] | None = None, timeout: float = 600.0,
                note: Callable[[str], None] | None = None, api_key: ApiKey | None = None,
                deadline: Deadline | None = None) -> Iterator[OpenAIServer]:
    """Connect to `url`, or start `profile` (with `checkpoint` as its model, `accept` licence ids).

    `timeout` bounds each request in all; `deadline` the whole check, a profile's start-up included.
    """
    if (url is None) == (profile is None):
        raise UsageError("pass exactly one of --url (a running server) or --profile (start one)",
                         hint="e.g. --url http://127.0.0.1:8000")
    deadline = deadline or Deadline(None)
    if url is not None:
        if checkpoint is not None or accept:
            raise UsageError("--checkpoint and --accept-license only apply with --profile")
        url = validate_url(url)
        if note:
            note(f"asking {url} which model it serves")
        with OpenAIServer(url, model, timeout=timeout, api_key=api_key, deadline=deadline) as server:
            server.connect()
            yield server
        return
    with _launched(profile, checkpoint, accept or [], note, deadline) as (base_url, profile_key), \
            OpenAIServer(base_url, model, timeout=timeout, api_key=api_key or profile_key,
                         deadline=deadline) as server:
        server.connect()
        yield server


@contextlib.contextmanager
def _launched(profile: str, checkpoint: Path | None, accept: list[str],
              note: Callable[[str], None] | None, deadline: Deadline) -> Iterator[tuple[str, ApiKey | None]]:
    from glmctl.serving.server import start_server  # the library behind `glmctl serve`

    if note:
        note(f"starting vLLM from profile {profile!r} (stopped again when the check ends)")
    startup, _ = deadline.cut(STARTUP_TIMEOUT_S)
    with start_server(profile, model=checkpoint, port=None, accept=accept, timeout_s=startup) as server:
        if note:
            note(f"vLLM is up at {server.info.base_url} after {server.info.startup_s:.0f} s (log: {server.info.log_path})")
        key = server.launch.config.get("api-key")  # a profile that protects its server: use its key
        yield server.info.base_url, ApiKey(str(key), f"profile {profile!r}") if key else None
