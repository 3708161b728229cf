"""HTTP to one server with deadlines that hold, and the API key the checks send.

httpx's timeouts bound each socket operation, so a server that trickles a byte every second never
times out. Here a request runs as a task on an event loop of its own (a daemon thread) and the
caller waits for it at most `timeout` seconds in all: connect, the server's work and every byte of
the answer. A request past its time is cancelled, which closes its connection; vLLM aborts a
request whose client went away, so an abandoned check does not keep the server busy.

A `Deadline` bounds a whole command: every request is also cut at the deadline, and the error says
which limit was hit, with its real figure.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from glmctl.errors import GlmctlError, UsageError

T = TypeVar("T")

# vLLM's `--api-key` also reads VLLM_API_KEY; OpenAI clients read OPENAI_API_KEY.
API_KEY_ENV = ("VLLM_API_KEY", "OPENAI_API_KEY")
CONNECT_TIMEOUT_S = 10.0


class ServerUnreachable(GlmctlError):
    """Nothing answers at the URL (refused, timed out, DNS)."""


class ServerError(GlmctlError):
    """The server answered, but not with what an OpenAI-compatible (vLLM) server would."""


class AuthError(UsageError):
    """The server wants an API key that was not sent, or refused the one that was."""


class DeadlineExceeded(GlmctlError):
    """A command ran past its overall --deadline."""


@dataclass(frozen=True)
class ApiKey:
    value: str
    source: str
    """Where it came from: "--api-key", "VLLM_API_KEY" or "OPENAI_API_KEY" (never the value)."""

    def __repr__(self) -> str:  # never in a traceback or a log
        return f"ApiKey(source={self.source!r}, value='***')"


def resolve_api_key(flag: str | None) -> ApiKey | None:
    """`--api-key`, else $VLLM_API_KEY, else $OPENAI_API_KEY, else none."""
    if flag:
        return ApiKey(flag, "--api-key")
    for name in API_KEY_ENV:
        if value := os.environ.get(name, "").strip():
            return ApiKey(value, name)
    return None


def auth_hint(key: ApiKey | None) -> str:
    if key is None:
        return ("the server was started with an API key: pass --api-key KEY (or set "
                f"{' or '.join(API_KEY_ENV)})")
    return f"the key from {key.source} was refused: pass the key the server was started with"


def validate_url(url: str) -> str:
    """An http(s) base URL with a valid port, or a usage error (exit 2) that says what is wrong."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parsed = httpx.URL(text)
        port = parsed.port
    except (httpx.InvalidURL, ValueError) as exc:
        raise UsageError(f"--url {url!r} is not a URL ({exc})", hint="e.g. --url http://127.0.0.1:8000") from exc
    if parsed.scheme not in ("http", "https"):
        raise UsageError(f"--url {url!r}: the scheme must be http or https, not {parsed.scheme!r}",
                         hint="e.g. --url http://127.0.0.1:8000")
    if not parsed.host:
        raise UsageError(f"--url {url!r} names no host", hint="e.g. --url http://127.0.0.1:8000")
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"--url {url!r}: port {port} is not between 1 and 65535")
    return text


class Deadline:
    """The time a whole command must be done by; `seconds=None` (or 0) is no limit."""

    def __init__(self, seconds: float | None, what: str = "the command", flag: str = "--deadline") -> None:
        self.seconds = seconds if seconds else None
        self.what = what
        self.flag = flag
        self._end = None if self.seconds is None else time.monotonic() + self.seconds

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def cut(self, timeout: float | None) -> tuple[float | None, bool]:
        """(the time a step may take, whether the deadline rather than `timeout` sets it)."""
        left = self.remaining()
        if left is None or (timeout is not None and timeout <= left):
            return timeout, False
        return left, True

    def check(self, doing: str = "") -> None:
        if self._end is not None and time.monotonic() >= self._end:
            raise self.exceeded(doing)

    def exceeded(self, doing: str = "") -> DeadlineExceeded:
        where = f" ({doing})" if doing else ""
        return DeadlineExceeded(
            f"{self.what} did not finish within its {self.flag} of {_seconds(self.seconds)}{where}; "
            "nothing was written",
            hint=f"raise {self.flag} (0: no limit), or check why the server is slow (its log, its load)")


def _seconds(s: float | None) -> str:
    if s is None:
        return "no limit"
    return f"{s:,.0f} s" + (f" ({s / 3600:.1f} h)" if s >= 3600 else "")


class Transport:
    """Requests to `base_url`, each finished within `timeout` seconds in all (see the module doc)."""

    def __init__(self, base_url: str, *, timeout: float | None, headers: dict[str, str] | None = None,
                 deadline: Deadline | None = None) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.headers = dict(headers or {})
        self.deadline = deadline or Deadline(None)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="glmctl-http", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient | None = None

    def _async_client(self) -> httpx.AsyncClient:
        if self._client is None:
            per_op = self.timeout
            connect = CONNECT_TIMEOUT_S if per_op is None else min(CONNECT_TIMEOUT_S, per_op)
            self._client = httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                             timeout=httpx.Timeout(per_op, connect=connect))
        return self._client

    def run(self, make: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        """Run the coroutine `make()` on the loop; cancel it after `timeout` s (TimeoutError)."""

        async def bounded() -> T:
            return await asyncio.wait_for(make(), timeout)

        future = asyncio.run_coroutine_threadsafe(bounded(), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def request(self, method: str, path: str, json: Any = None, *, timeout: float | None = None,
                what: str | None = None) -> httpx.Response:
        """One request, body read in full; every failure is a GlmctlError that names the URL."""
        limit, by_deadline = self.deadline.cut(timeout if timeout is not None else self.timeout)
        url = f"{self.base_url}{path}"
        try:
            return self.run(lambda: self._async_client().request(method, path, json=json), limit)
        except TimeoutError as exc:
            if by_deadline:
                raise self.deadline.exceeded(f"waiting for {url}") from exc
            raise ServerUnreachable(
                f"{url} did not answer within {limit:g} s (the whole request: connecting, the "
                "server's work and every byte of the answer)",
                hint="the server may be overloaded or stuck (check its log); a slow one needs a larger --timeout",
            ) from exc
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ServerUnreachable(
                f"no server answers at {self.base_url} ({type(exc).__name__}: {exc})",
                hint="start one (glmctl serve --profile NAME) or pass the right --url",
            ) from exc
        except httpx.TimeoutException as exc:  # one socket operation stalled for the whole timeout
            raise ServerUnreachable(
                f"{url} stopped answering for {limit:g} s" + (f" ({what})" if what else ""),
                hint="the server may be overloaded or stuck; check its log",
            ) from exc
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"talking to {url} failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._client is not None:
            client = self._client
            try:
                self.run(client.aclose, 5.0)
            except (TimeoutError, httpx.HTTPError, RuntimeError):
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()
