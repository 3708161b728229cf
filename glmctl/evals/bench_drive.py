"""Drive N streaming sessions at once while sampling /metrics; record what each client saw, when.

Each session is one streamed `/v1/completions` request with a token-ID prompt, a fixed number of
output tokens and EOS ignored (`ignore_eos`, vLLM), so every session decodes exactly as long as
asked. Tokens are counted per stream chunk from vLLM's `token_ids` (`return_token_ids`), so a chunk
carrying several tokens counts as several. All sessions are sent at once: their prefills queue in
the server, which is what the per-session time to first token shows.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from glmctl.evals.client import ServerError, ServerUnreachable
from glmctl.evals.metrics import MetricsSample, parse_metrics


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

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in self.arrivals if t0 < t <= t1)


@dataclass
class DriveResult:
    traces: list[SessionTrace]
    samples: list[MetricsSample]
    started: float  # time.monotonic() of t = 0


async def _session(client: httpx.AsyncClient, trace: SessionTrace, payload: dict, t0: float,
                   on_tokens: Callable[[int], None] | None) -> None:
    trace.sent_at = time.monotonic() - t0
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code >= 400:
                body = (await response.aread()).decode(errors="replace")[:400]
                trace.error = f"HTTP {response.status_code}: {body}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.monotonic() - t0
                chunk = json.loads(data)
                if chunk.get("usage") and not chunk.get("choices"):
                    trace.usage_completion_tokens = chunk["usage"].get("completion_tokens")
                    continue
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                    if n:
                        trace.first_token_at = trace.first_token_at if trace.first_token_at is not None else now
                        trace.arrivals.append((now, n))
                        trace.output_tokens += n
                        if on_tokens:
                            on_tokens(n)
                    if choice.get("finish_reason"):
                        trace.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    finally:
        trace.done_at = time.monotonic() - t0


async def _poll(client: httpx.AsyncClient, model: str, interval: float, t0: float, stop: asyncio.Event,
                samples: list[MetricsSample]) -> None:
    while True:
        sent = time.monotonic()
        response = await client.get("/metrics")
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
                 poll_interval: float, timeout: float, on_tokens: Callable[[int], None] | None) -> DriveResult:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        t0 = time.monotonic()
        samples: list[MetricsSample] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll(client, model, poll_interval, t0, stop, samples))
        traces = [SessionTrace(index=i, prompt_tokens=len(p)) for i, p in enumerate(prompts)]
        sessions = [
            asyncio.create_task(_session(client, trace, {
                "model": model, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True},
            }, t0, on_tokens))
            for trace, prompt in zip(traces, prompts, strict=True)
        ]
        try:
            await asyncio.gather(*sessions)
        finally:
            stop.set()
            try:
                await poller
            except httpx.HTTPError as exc:
                raise ServerUnreachable(f"scraping {base_url}/metrics failed during the bench: {exc}") from exc
        return DriveResult(traces, samples, t0)


def drive(server, prompts: list[list[int]], output_tokens: int, *, poll_interval: float = 0.5,
          on_tokens: Callable[[int], None] | None = None) -> DriveResult:
    """Run the sessions to completion (blocking); see the module doc."""
    return asyncio.run(_drive(server.base_url, server.headers, server.model_id, prompts, output_tokens,
                              poll_interval, server.timeout.read or 3600.0, on_tokens))
