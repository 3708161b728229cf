"""Drive N streaming sessions at once while sampling /metrics; record what each client saw, when.

Each session is one streamed `/v1/completions` request per turn with a token-ID prompt, a fixed
number of output tokens and EOS ignored (`ignore_eos`, vLLM), so every turn decodes exactly as
long as asked. A later turn sends the previous turn's prompt, the tokens it generated and a
follow-up: a conversation whose prefix a server (or the node a router keeps it on) has seen.
Every request carries the session's id in the `X-Session-ID` header, which vllm-router keys
session affinity on, and `X-Request-Id: <session id>-t<turn>`, which vLLM takes as its request id
(its request log then names the session). Tokens are counted per stream chunk from vLLM's
`token_ids` (`return_token_ids`), so a chunk carrying several tokens counts as several. All
sessions are sent at once: their prefills queue in the server, which is what the per-session time
to first token shows. A session whose turn fails (an HTTP error, a stream cut before its finish
reason) sends no further turn. A caller may end every session early (`stop`, set from another
thread): the streams are closed, which makes vLLM abort the requests, and each trace says
`stopped`.

Behind vllm-router, `nodes` lists the fleet's nodes: /metrics is sampled from each and summed (the
router's own forwards one node's); a node that stops answering is left out from then on and noted
in `lost_nodes`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from glmctl.evals.client import AuthError, ServerError, ServerUnreachable
from glmctl.evals.metrics import MetricsSample, combine, parse_metrics
from glmctl.evals.transport import CONNECT_TIMEOUT_S, Deadline, auth_hint
from glmctl.fleet.router import SESSION_HEADER


@dataclass
class SessionTrace:
    index: int
    prompt_tokens: int  # of the first turn
    session_id: str = ""
    turns: int = 1  # planned
    turns_done: int = 0
    turn_ttft_s: list[float] = field(default_factory=list)  # per completed turn
    sent_at: float = 0.0  # seconds since the run started
    first_token_at: float | None = None
    first_turn_done_at: float | None = None
    done_at: float | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that chunk)
    output_tokens: int = 0
    usage_completion_tokens: int | None = None  # the server's own count, from the final usage chunk
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None  # the HTTP status of a refused request
    stopped: bool = False  # ended by the caller's `stop` before its last token
    deadline_hit: bool = False  # a turn was cut by the run's deadline rather than --timeout

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in self.arrivals if t0 < t <= t1)


@dataclass
class DriveResult:
    traces: list[SessionTrace]
    samples: list[MetricsSample]
    started: float  # time.monotonic() of t = 0
    lost_nodes: dict[str, float] = field(default_factory=dict)  # node URL -> when its /metrics stopped answering
    # (t, seconds) of each /metrics scrape that timed out (the run went on; see _poll)
    metrics_silences: list[tuple[float, float]] = field(default_factory=list)


# vLLM's API server can leave /metrics unanswered for tens of seconds while it admits very long
# prompts (eight 227k-token sessions at once): a scrape that times out is a gap in the samples,
# not the end of the run, until no scrape has been answered for this long.
METRICS_SILENCE_S = 300.0


@dataclass(frozen=True)
class SessionPlan:
    """What one session sends: its first prompt, a follow-up per later turn, its id."""

    prompt: list[int]
    follow_ups: list[list[int]] = field(default_factory=list)
    session_id: str = ""


async def _session(client: httpx.AsyncClient, trace: SessionTrace, plan: SessionPlan, base: dict, t0: float,
                   on_tokens: Callable[[int], None] | None, timeout: float | None, deadline: Deadline) -> None:
    """One session, turn after turn; every failure ends up in `trace.error` (the cell reports it)."""
    trace.sent_at = time.monotonic() - t0
    prompt = plan.prompt
    generated: list[int] | None = []
    try:
        for turn in range(trace.turns):
            if turn:
                prompt = prompt + generated + plan.follow_ups[turn - 1]
            headers = {SESSION_HEADER: trace.session_id, "X-Request-Id": f"{trace.session_id}-t{turn + 1}"} \
                if trace.session_id else {}
            limit, by_deadline = deadline.cut(timeout)
            turn_sent = time.monotonic() - t0
            try:
                generated = await asyncio.wait_for(
                    _stream(client, trace, {**base, "prompt": prompt}, headers, t0, on_tokens, turn_sent), limit)
            except TimeoutError:
                trace.deadline_hit = by_deadline
                trace.error = f"did not finish within --timeout {limit:g} s (the whole stream)"
            except httpx.HTTPError as exc:
                trace.error = f"{type(exc).__name__}: {exc}"
            if trace.error is None and generated is None:
                return  # the first turn's stream ended without a token: the cell says so
            if trace.error is not None:
                if trace.turns > 1:
                    trace.error = f"turn {turn + 1} of {trace.turns}: {trace.error}"
                return
            trace.turns_done += 1
            if turn == 0:
                trace.first_turn_done_at = time.monotonic() - t0
    except asyncio.CancelledError:  # only `_stop_when` cancels a session: the caller's early stop
        trace.stopped = True
    finally:
        trace.done_at = time.monotonic() - t0


async def _stop_when(stop: threading.Event, sessions: list[asyncio.Task]) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for task in sessions:
        task.cancel()


async def _stream(client: httpx.AsyncClient, trace: SessionTrace, payload: dict, headers: dict, t0: float,
                  on_tokens: Callable[[int], None] | None, sent: float) -> list[int] | None:
    """One turn's stream; the token ids it generated, or None when it ended without a token (and
    without an error: a stream that is empty). Failures are written to `trace.error`."""
    ids_seen: list[int] = []
    count = 0
    finish = None
    async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as response:
        if response.status_code >= 400:
            body = (await response.aread()).decode(errors="replace")[:400]
            trace.error = f"HTTP {response.status_code}: {body}"
            trace.status = response.status_code
            return []
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
                return []
            if not isinstance(chunk, dict):
                trace.error = f"the stream carried {type(chunk).__name__}, not a completion chunk"
                return []
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"]
                counted = usage.get("completion_tokens") if isinstance(usage, dict) else None
                if isinstance(counted, int):  # the server's own count, summed over the turns
                    trace.usage_completion_tokens = (trace.usage_completion_tokens or 0) + counted
                continue
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                ids = choice.get("token_ids")
                n = len(ids) if isinstance(ids, list) else (1 if choice.get("text") else 0)
                if n:
                    if count == 0:
                        trace.turn_ttft_s.append(now - sent)
                    trace.first_token_at = trace.first_token_at if trace.first_token_at is not None else now
                    trace.arrivals.append((now, n))
                    trace.output_tokens += n
                    count += n
                    if isinstance(ids, list):
                        ids_seen += [i for i in ids if isinstance(i, int)]
                    if on_tokens:
                        on_tokens(n)
                if choice.get("finish_reason"):
                    finish = trace.finish_reason = choice["finish_reason"]
    if count == 0 and finish is None:
        if trace.turns_done == 0:
            return None
        trace.error = "the stream ended without a token"
    elif finish is None:
        trace.error = (f"the stream ended after {count} token(s) without a finish reason: it was cut off "
                       "(the server, or a router in front of it, dropped it)")
    elif len(ids_seen) != count and trace.turns > 1:
        trace.error = "the stream carried no token_ids (vLLM's return_token_ids), which --turns needs"
    return ids_seen


async def _scrape(client: httpx.AsyncClient, path: str, model: str, timeout: float) -> MetricsSample:
    try:
        response = await asyncio.wait_for(client.get(path), timeout)
    except TimeoutError as exc:
        raise ServerUnreachable(f"{path} did not answer within {timeout:g} s during the bench") from exc
    if response.status_code >= 400:
        raise ServerError(f"{path} answered HTTP {response.status_code} during the bench")
    return parse_metrics(response.text, model)


async def _poll(client: httpx.AsyncClient, model: str, interval: float, t0: float, stop: asyncio.Event,
                samples: list[MetricsSample], timeout: float, nodes: list[str] | None,
                lost: dict[str, float], silences: list[tuple[float, float]],
                silence_limit: float = METRICS_SILENCE_S) -> None:
    answered_at = time.monotonic()
    while True:
        sent = time.monotonic()
        if not nodes:
            try:
                sample = await _scrape(client, "/metrics", model, timeout)
            except ServerUnreachable as exc:  # a scrape that timed out: a gap, up to silence_limit
                quiet = time.monotonic() - answered_at
                if quiet >= silence_limit:
                    raise ServerUnreachable(f"{exc} (nothing for {quiet:.0f} s)") from exc
                silences.append((round(sent - t0, 2), round(time.monotonic() - sent, 2)))
                if stop.is_set():
                    return
                continue
        else:
            live = [n for n in nodes if n not in lost]
            answers = await asyncio.gather(*(_scrape(client, f"{n}/metrics", model, timeout) for n in live),
                                           return_exceptions=True)
            for node, answer in zip(live, answers, strict=True):
                if isinstance(answer, ServerUnreachable | ServerError | httpx.HTTPError):
                    lost[node] = sent - t0
                elif isinstance(answer, BaseException):
                    raise answer
            answered = [a for a in answers if isinstance(a, MetricsSample)]
            if not answered:
                raise ServerUnreachable(f"none of the {len(nodes)} node(s) behind the router answers /metrics")
            sample = combine(answered, 0.0)
        answered_at = time.monotonic()
        mid = (sent + time.monotonic()) / 2 - t0
        samples.append(dataclasses.replace(sample, t=mid))
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, interval - (time.monotonic() - sent)))
        except TimeoutError:
            pass


async def _drive(base_url: str, headers: dict, model: str, plans: list[SessionPlan], output_tokens: int,
                 poll_interval: float, timeout: float | None, deadline: Deadline,
                 on_tokens: Callable[[int], None] | None, api_key=None,
                 stop_early: threading.Event | None = None, nodes: list[str] | None = None) -> DriveResult:
    n = len(plans) + 4 + len(nodes or [])
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    connect = CONNECT_TIMEOUT_S if timeout is None else min(CONNECT_TIMEOUT_S, timeout)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=connect)) as client:
        t0 = time.monotonic()
        samples: list[MetricsSample] = []
        lost: dict[str, float] = {}
        silences: list[tuple[float, float]] = []
        stop = asyncio.Event()
        scrape_limit = min(30.0, timeout or 30.0)
        poller = asyncio.create_task(_poll(client, model, poll_interval, t0, stop, samples, scrape_limit,
                                           nodes, lost, silences))
        traces = [SessionTrace(index=i, prompt_tokens=len(p.prompt), session_id=p.session_id,
                               turns=1 + len(p.follow_ups)) for i, p in enumerate(plans)]
        base = {"model": model, "max_tokens": output_tokens, "min_tokens": output_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        sessions = [asyncio.create_task(_session(client, trace, plan, base, t0, on_tokens, timeout, deadline))
                    for trace, plan in zip(traces, plans, strict=True)]
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
        if any(t.deadline_hit for t in traces):
            raise deadline.exceeded(f"{sum(t.deadline_hit for t in traces)} session(s) still streaming")
        refused = [t.status for t in traces if t.status in (401, 403)]
        if refused:
            raise AuthError(f"{base_url}/v1/completions answered HTTP {refused[0]} to the bench's sessions",
                            hint=auth_hint(api_key))
        return DriveResult(traces, samples, t0, lost, silences)


def drive(server, prompts: list[list[int]] | list[SessionPlan], output_tokens: int, *, poll_interval: float = 0.5,
          on_tokens: Callable[[int], None] | None = None, stop: threading.Event | None = None,
          nodes: list[str] | None = None) -> DriveResult:
    """Run the sessions to completion, or until `stop` is set (blocking); see the module doc.
    `prompts`: one first prompt per single-turn session, or a SessionPlan per session. Each turn's
    whole stream is bounded by the server's request timeout, and all of them by its deadline."""
    plans = [p if isinstance(p, SessionPlan) else SessionPlan(prompt=p) for p in prompts]
    return asyncio.run(_drive(server.base_url, server.headers, server.model_id, plans, output_tokens,
                              poll_interval, server.request_timeout, server.deadline, on_tokens,
                              server.api_key, stop, nodes))
