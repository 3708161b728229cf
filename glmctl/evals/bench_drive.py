"""Drive N streaming sessions at once while sampling /metrics; record what each client saw, when.

Each session is one streamed `/v1/completions` request with a token-ID prompt, a fixed number of
output tokens and EOS ignored (`ignore_eos`, vLLM), so every session decodes exactly as long as
asked. Tokens are counted per stream chunk from vLLM's `token_ids` (`return_token_ids`), so a chunk
carrying several tokens counts as several. All sessions are sent at once: their prefills queue in
the server, which is what the per-session time to first token shows. A caller may end every
session early (`stop`, set from another thread): the streams are closed, which makes vLLM abort
the requests, and each trace says `stopped`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from glmctl.evals.client import AuthError, ServerError, ServerUnreachable
from glmctl.evals.metrics import MetricsSample, parse_metrics
from glmctl.evals.transport import CONNECT_TIMEOUT_S, Deadline, auth_hint


@dataclass
class SessionTrace:
    index: int
    prompt_tokens: int
    sent_at: float = 0.0  # seconds since the run started
    first_token_at: float | None = None
    done_at: float | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that chunk)
    output_tokens: int = 0
    usage_completion_tokens: int | None = None  # the server's own count, from the final usage chunk
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None  # the HTTP status of a refused request
    stopped: bool = False  # ended by the caller's `stop` before its last token

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in self.arrivals if t0 < t <= t1)


@dataclass
class DriveResult:
    traces: list[SessionTrace]
    samples: list[MetricsSample]
    started: float  # time.monotonic() of t = 0
    # (t, seconds) of each /metrics scrape that timed out (the run went on; see _poll)
    metrics_silences: list[tuple[float, float]] = field(default_factory=list)


# vLLM's API server can leave /metrics unanswered for tens of seconds while it admits very long
# prompts (eight 227k-token sessions at once): a scrape that times out is a gap in the samples,
# not the end of the run, until no scrape has been answered for this long.
METRICS_SILENCE_S = 300.0


async def _session(client: httpx.AsyncClient, trace: SessionTrace, payload: dict, t0: float,
                   on_tokens: Callable[[int], None] | None, timeout: float | None) -> None:
    """One streamed session; every failure ends up in `trace.error` (the cell reports it)."""
    trace.sent_at = time.monotonic() - t0
    try:
        await asyncio.wait_for(_stream(client, trace, payload, t0, on_tokens), timeout)
    except TimeoutError:
        trace.error = f"did not finish within --timeout {timeout:g} s (the whole stream)"
    except httpx.HTTPError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:  # only `_stop_when` cancels a session: the caller's early stop
        trace.stopped = True
    finally:
        trace.done_at = time.monotonic() - t0


async def _stop_when(stop: threading.Event, sessions: list[asyncio.Task]) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for task in sessions:
        task.cancel()


async def _stream(client: httpx.AsyncClient, trace: SessionTrace, payload: dict, t0: float,
                  on_tokens: Callable[[int], None] | None) -> None:
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code >= 400:
            body = (await response.aread()).decode(errors="replace")[:400]
            trace.error = f"HTTP {response.status_code}: {body}"
            trace.status = response.status_code
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.monotonic() - t0
            try:
                chunk = json.loads(data)
            except ValueError:
                trace.error = f"the stream carried something that is not JSON: {data[:80]!r}"
                return
            if not isinstance(chunk, dict):
                trace.error = f"the stream carried {type(chunk).__name__}, not a completion chunk"
                return
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"]
                count = usage.get("completion_tokens") if isinstance(usage, dict) else None
                trace.usage_completion_tokens = count if isinstance(count, int) else None
                continue
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                ids = choice.get("token_ids")
                n = len(ids) if isinstance(ids, list) else (1 if choice.get("text") else 0)
                if n:
                    trace.first_token_at = trace.first_token_at if trace.first_token_at is not None else now
                    trace.arrivals.append((now, n))
                    trace.output_tokens += n
                    if on_tokens:
                        on_tokens(n)
                if choice.get("finish_reason"):
                    trace.finish_reason = choice["finish_reason"]


async def _poll(client: httpx.AsyncClient, model: str, interval: float, t0: float, stop: asyncio.Event,
                samples: list[MetricsSample], timeout: float,
                silences: list[tuple[float, float]] | None = None,
                silence_limit: float = METRICS_SILENCE_S) -> None:
    answered = time.monotonic()
    while True:
        sent = time.monotonic()
        try:
            response = await asyncio.wait_for(client.get("/metrics"), timeout)
        except TimeoutError as exc:
            if silences is not None:
                silences.append((round(sent - t0, 2), round(time.monotonic() - sent, 2)))
            quiet = time.monotonic() - answered
            if silences is None or quiet >= silence_limit:
                raise ServerUnreachable(f"/metrics did not answer within {timeout:g} s during the bench"
                                        + (f" (nothing for {quiet:.0f} s)" if silences is not None else "")) from exc
            if stop.is_set():
                return
            continue
        answered = time.monotonic()
        mid = (sent + time.monotonic()) / 2 - t0
        if response.status_code >= 400:
            raise ServerError(f"/metrics answered HTTP {response.status_code} during the bench")
        samples.append(parse_metrics(response.text, model, mid))
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, interval - (time.monotonic() - sent)))
        except TimeoutError:
            pass


async def _drive(base_url: str, headers: dict, model: str, prompts: list[list[int]], output_tokens: int,
                 poll_interval: float, timeout: float | None, deadline: Deadline,
                 on_tokens: Callable[[int], None] | None, api_key=None,
                 stop_early: threading.Event | None = None) -> DriveResult:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    connect = CONNECT_TIMEOUT_S if timeout is None else min(CONNECT_TIMEOUT_S, timeout)
    session_limit, by_deadline = deadline.cut(timeout)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=connect)) as client:
        t0 = time.monotonic()
        samples: list[MetricsSample] = []
        silences: list[tuple[float, float]] = []
        stop = asyncio.Event()
        scrape_limit = min(30.0, timeout or 30.0)
        poller = asyncio.create_task(_poll(client, model, poll_interval, t0, stop, samples, scrape_limit,
                                           silences))
        traces = [SessionTrace(index=i, prompt_tokens=len(p)) for i, p in enumerate(prompts)]
        sessions = [
            asyncio.create_task(_session(client, trace, {
                "model": model, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True},
            }, t0, on_tokens, session_limit))
            for trace, prompt in zip(traces, prompts, strict=True)
        ]
        stopper = asyncio.create_task(_stop_when(stop_early, sessions)) if stop_early else None
        try:
            await asyncio.gather(*sessions)
        finally:
            if stopper:
                stopper.cancel()
            stop.set()
            try:
                await poller
            except httpx.HTTPError as exc:
                raise ServerUnreachable(f"scraping {base_url}/metrics failed during the bench: {exc}") from exc
        if by_deadline and any(t.error and t.error.startswith("did not finish") for t in traces):
            raise deadline.exceeded(f"{len(prompts)} session(s) still streaming")
        refused = [t.status for t in traces if t.status in (401, 403)]
        if refused:
            raise AuthError(f"{base_url}/v1/completions answered HTTP {refused[0]} to the bench's sessions",
                            hint=auth_hint(api_key))
        return DriveResult(traces, samples, t0, silences)


def drive(server, prompts: list[list[int]], output_tokens: int, *, poll_interval: float = 0.5,
          on_tokens: Callable[[int], None] | None = None, stop: threading.Event | None = None) -> DriveResult:
    """Run the sessions to completion, or until `stop` is set (blocking); see the module doc. Each
    session's whole stream is bounded by the server's request timeout, and all of them by its
    deadline."""
    return asyncio.run(_drive(server.base_url, server.headers, server.model_id, prompts, output_tokens,
                              poll_interval, server.request_timeout, server.deadline, on_tokens,
                              server.api_key, stop))
