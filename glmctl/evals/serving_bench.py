"""Serving bench: N concurrent sessions at a context length; steady-state decode from vLLM's counter.

`vllm bench serve`'s output throughput divides all output tokens by the whole run, prefill ramp and
drain included, which understates decode for long prompts. This bench reports instead the rate of
`vllm:generation_tokens_total` over the *steady window*: the span in which all N sessions are
running, none is waiting and no prompt is being processed (metrics.py says how that is detected).
Next to it: time to first token per session (the queue of long prefills), the per-session rate and
the client-counted rate in the same window (a cross-check), KV usage, preemptions, and the averaged
throughput for comparison with other tools.

Prompts are unique per session from their first token (a session header), so prefix caching cannot
share anything between sessions; the body is source text (the stdlib slice, or `--prompts DIR` of
real prompts, cycled to length), sent as token IDs so each prompt has exactly the requested number
of tokens. With `turns` > 1 each session is a conversation: every later turn resends the turn
before it (prompt and output) plus `turn_tokens` new tokens, so a server with prefix caching (and a
router that keeps the session on one node) reuses the prefix; the steady window is then measured in
the first turn, where all sessions decode together, and each turn's time to first token is kept.

Behind vllm-router (`glmctl fleet`) the counters come from every node's /metrics, summed.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel

from glmctl.errors import GlmctlError, UsageError
from glmctl.evals.bench_drive import DriveResult, SessionPlan, drive
from glmctl.evals.client import OpenAIServer
from glmctl.evals.corpus import SourceText
from glmctl.evals.metrics import scrape, steady_window
from glmctl.evals.results import SCHEMA_VERSION, ServerInfo, now, server_info
from glmctl.evals.tokenizer import Tokenizer

SWEEP_SESSIONS = (1, 2, 4, 8)
SWEEP_CONTEXTS = (22_000, 64_000, 128_000, 240_000)


class SessionResult(BaseModel):
    index: int
    session_id: str | None = None  # the X-Session-ID header (vllm-router's affinity key); X-Request-Id is it + "-tN"
    prompt_tokens: int  # of the first turn
    turns_done: int = 1
    turn_ttft_s: list[float] = []  # time to first token of each completed turn
    ttft_s: float | None
    output_tokens: int  # counted by the client, chunk by chunk
    usage_completion_tokens: int | None  # the server's count (final usage chunk)
    decode_tok_s: float | None  # this session, first to last token
    window_tokens: int  # client-counted, inside the steady window
    window_tok_s: float | None
    finish_reason: str | None
    error: str | None


class SteadyDecode(BaseModel):
    t0_s: float
    t1_s: float
    seconds: float
    samples: int
    decode_tok_s: float  # Δ vllm:generation_tokens_total / Δt
    client_tok_s: float  # tokens the clients received in the same window / Δt
    per_session_tok_s: float  # decode_tok_s / sessions
    kv_usage_mean: float  # fraction 0..1
    kv_usage_max: float


class BenchCell(BaseModel):
    sessions: int
    context_tokens: int
    output_tokens: int  # per turn
    turns: int = 1
    turn_tokens: int = 0  # new tokens each later turn adds
    steady: SteadyDecode | None
    no_steady_reason: str | None = None
    ttft_s: list[float | None]  # per session, in send order
    preemptions: int  # Δ vllm:num_preemptions_total over the run
    kv_usage_max: float
    averaged_output_tok_s: float  # all output tokens / wall time: what `vllm bench serve` reports
    wall_s: float
    metric_samples: int
    lost_nodes: dict[str, float] = {}  # behind a router: node -> when (s) its /metrics stopped answering
    sessions_detail: list[SessionResult]


class CellChange(BaseModel):
    sessions: int
    context_tokens: int
    baseline_tok_s: float | None
    tok_s: float | None
    change_percent: float | None


class BenchResult(BaseModel):
    kind: Literal["bench"] = "bench"
    schema_version: int = SCHEMA_VERSION
    created: str
    server: ServerInfo
    tokenizer: str
    prompt_source: str
    poll_interval_s: float
    nodes: list[str] | None = None  # behind vllm-router: the nodes whose /metrics were summed
    cells: list[BenchCell]
    comparison: list[CellChange] | None = None
    baseline_file: str | None = None
    method: str = ("steady decode = rate of vllm:generation_tokens_total over the longest span with all "
                   "sessions running, none waiting, every first token received and none finished, and the "
                   "prompt and preemption counters unchanged")


class BenchFailed(GlmctlError):
    """Sessions failed, or no cell measured steady decode: nothing is written."""


def failed_sessions(cell: BenchCell) -> list[SessionResult]:
    """Sessions that errored or never received a token: a cell with any measured nothing sound."""
    return [d for d in cell.sessions_detail if d.error or d.ttft_s is None]


def check_cell(cell: BenchCell) -> None:
    failed = failed_sessions(cell)
    if not failed:
        return
    whys = [d.error or "no token received (the stream ended empty)" for d in failed]
    listed = "; ".join(f"session {d.index + 1}: {why}" for d, why in zip(failed, whys, strict=True))
    lost = "".join(f"; node {url} stopped answering at {t:.1f} s" for url, t in cell.lost_nodes.items())
    raise BenchFailed(
        f"{len(failed)} of {cell.sessions} session(s) failed at {cell.context_tokens:,} prompt tokens "
        f"({listed}{lost}); no result was written",
        hint="the server's log says why it refused or dropped them" if any("HTTP" in w for w in whys)
        else "check the server's log (behind a router, the node's); a slow server needs a larger --timeout")


def unmeasured_cells(result: BenchResult) -> list[BenchCell]:
    return [c for c in result.cells if c.steady is None]


def parse_counts(spec: str, what: str) -> list[int]:
    """'1,2,4' or '22k,64k' -> ints (k = 1,000)."""
    out = []
    for part in (p.strip().lower() for p in spec.split(",")):
        if not part:
            continue
        try:
            out.append(int(float(part[:-1]) * 1000) if part.endswith("k") else int(part))
        except ValueError as exc:
            raise UsageError(f"cannot read {part!r} in --{what}", hint="e.g. 1,2,4,8 or 22k,64k") from exc
    if not out or min(out) <= 0:
        raise UsageError(f"--{what} needs positive numbers, got {spec!r}")
    return sorted(set(out))


class PromptSource:
    """Token bodies for session prompts: the stdlib slice, or real prompt files cycled to length."""

    def __init__(self, tokenizer: Tokenizer, source: SourceText | None = None,
                 prompt_files: list[tuple[str, str]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.files = prompt_files
        self._file_ids: list[list[int]] | None = None
        self._stream: list[int] = []
        self.description = (f"{len(prompt_files)} prompt file(s)" if prompt_files
                            else f"{source.describe()} (sha256 {source.sha256[:12]})" if source else "?")

    def _body(self, session: int, sessions: int, n: int) -> list[int]:
        if self.files:
            if self._file_ids is None:
                self._file_ids = [ids for ids in (self.tokenizer.encode(t) for _, t in self.files) if ids]
                if not self._file_ids:
                    raise UsageError("the --prompts files are empty")
            body: list[int] = []
            k = session
            while len(body) < n:
                body += self._file_ids[k % len(self._file_ids)]
                k += 1
            return body[:n]
        assert self.source is not None
        if len(self._stream) < n:
            chars = max(4 * n, 65_536)
            text = self.source.text * max(1, -(-chars // len(self.source.text)))
            self._stream = self.tokenizer.encode(text[:chars])
        offset = session * (len(self._stream) // max(1, sessions))
        doubled = self._stream[offset:] + self._stream
        return (doubled * (1 + n // max(1, len(doubled))))[:n]

    def prompts(self, sessions: int, context: int) -> list[list[int]]:
        return [plan.prompt for plan in self.session_plans(sessions, context)]

    def session_plans(self, sessions: int, context: int, turns: int = 1, turn_tokens: int = 0) -> list[SessionPlan]:
        """Each session's first prompt of `context` tokens and `turns - 1` follow-ups of
        `turn_tokens` (the source text read on), under an id unique to the run."""
        prefix = self.tokenizer.special_prefix()
        nonce = secrets.token_hex(4)  # unique per run too: nothing from an earlier run is cached
        out = []
        for i in range(sessions):
            header = self.tokenizer.encode(f"# glmctl bench session {i + 1} of {sessions} ({nonce})\n")
            need = context - len(prefix) - len(header)
            if need < 1:
                raise UsageError(f"--context {context} is shorter than the session header ({len(header)} tokens)")
            body = self._body(i, sessions, need + (turns - 1) * turn_tokens)
            follow_ups = [body[need + k * turn_tokens: need + (k + 1) * turn_tokens] for k in range(turns - 1)]
            out.append(SessionPlan(prompt=prefix + header + body[:need], follow_ups=follow_ups,
                                   session_id=f"glmctl-bench-{nonce}-s{i + 1}"))
        return out


def _cell(sessions: int, context: int, output_tokens: int, run: DriveResult, before, after,
          turns: int = 1, turn_tokens: int = 0) -> BenchCell:
    traces = run.traces
    errors = [t.error for t in traces if t.error]
    firsts = [t.first_token_at for t in traces]
    dones = [t.done_at for t in traces if t.done_at is not None]
    # with turns, all sessions decode together only in the first (later turns start one by one)
    window_ends = [t.first_turn_done_at for t in traces if t.first_turn_done_at is not None] if turns > 1 else dones
    steady, reason = None, None
    baseline_running = before.running
    if errors:
        reason = f"{len(errors)} session(s) failed: {errors[0]}"
    elif any(f is None for f in firsts):
        reason = "a session received no token"
    else:
        last_first, first_done = max(firsts), min(window_ends)  # type: ignore[type-var]
        window = steady_window(run.samples, sessions, after=last_first, before=first_done,
                               baseline_running=baseline_running)
        if window is None:
            reason = _why_no_window(run, sessions, output_tokens, last_first, first_done, baseline_running)
        else:
            in_window = run.samples[window.first:window.last + 1]
            client = sum(t.tokens_between(window.t0, window.t1) for t in traces)
            steady = SteadyDecode(
                t0_s=window.t0, t1_s=window.t1, seconds=window.seconds, samples=len(in_window),
                decode_tok_s=window.tokens_per_second, client_tok_s=client / window.seconds,
                per_session_tok_s=window.tokens_per_second / sessions,
                kv_usage_mean=sum(s.kv_usage for s in in_window) / len(in_window),
                kv_usage_max=max(s.kv_usage for s in in_window))
    detail = []
    for t in traces:
        span = (t.arrivals[-1][0] - t.first_token_at) if t.arrivals and t.first_token_at is not None else 0.0
        in_win = t.tokens_between(steady.t0_s, steady.t1_s) if steady else 0
        detail.append(SessionResult(
            index=t.index, session_id=t.session_id or None, prompt_tokens=t.prompt_tokens,
            turns_done=t.turns_done, turn_ttft_s=t.turn_ttft_s,
            ttft_s=None if t.first_token_at is None else t.first_token_at - t.sent_at,
            output_tokens=t.output_tokens, usage_completion_tokens=t.usage_completion_tokens, decode_tok_s=(t.output_tokens - 1) / span if span > 0 else None,
            window_tokens=in_win, window_tok_s=in_win / steady.seconds if steady else None,
            finish_reason=t.finish_reason, error=t.error))
    wall = (max(dones) if dones else 0.0) - min(t.sent_at for t in traces)
    total_out = sum(t.output_tokens for t in traces)
    return BenchCell(
        sessions=sessions, context_tokens=context, output_tokens=output_tokens, turns=turns,
        turn_tokens=turn_tokens, steady=steady, lost_nodes=run.lost_nodes,
        no_steady_reason=reason, ttft_s=[d.ttft_s for d in detail],
        preemptions=int(after.preemptions - before.preemptions),
        kv_usage_max=max([s.kv_usage for s in run.samples] or [0.0]),
        averaged_output_tok_s=total_out / wall if wall > 0 else float("nan"), wall_s=wall,
        metric_samples=len(run.samples), sessions_detail=detail)


def _why_no_window(run: DriveResult, sessions: int, output_tokens: int, last_first: float,
                   first_done: float, baseline_running: float) -> str:
    most = max((s.running - baseline_running for s in run.samples), default=0)
    waited = max((s.waiting for s in run.samples), default=0)
    capacity = (f"at most {most:.0f} of {sessions} sessions ran at once ({waited:.0f} waited): if the server's "
                f"max_num_seqs or KV capacity is below {sessions}, no output length helps")
    if last_first >= first_done:
        return (f"the last session's first token came at {last_first:.1f} s, after the first session finished at "
                f"{first_done:.1f} s, so all {sessions} never decoded together"
                + (f"; {capacity}" if most < sessions else "")
                + f"; raise --output-tokens (try {math.ceil(output_tokens * 2.5)})")
    if most < sessions:
        return capacity
    return (f"all {sessions} decoded together for only {first_done - last_first:.2f} s, too short for two "
            "metric samples with nothing else happening; raise --output-tokens or lower --poll-interval")


def wait_idle(server: OpenAIServer, timeout_s: float, nodes: list[str] | None = None):
    """The first sample with nothing running or waiting; the gauges of a request that just ended
    may lag by a step, so wait a little before calling the server busy."""
    deadline = time.monotonic() + timeout_s
    while True:
        sample = scrape(server, 0.0, nodes)
        if not (sample.running or sample.waiting):
            return sample
        if time.monotonic() > deadline:
            raise UsageError(f"the server is busy before the bench ({sample.running:.0f} running, "
                             f"{sample.waiting:.0f} waiting): steady-state numbers need it to itself",
                             hint="wait for other clients to finish, or bench a server of your own")
        time.sleep(0.5)


def session_tokens(context: int, output_tokens: int, turns: int = 1, turn_tokens: int = 0) -> int:
    """The longest prompt plus output a session sends: its last turn's."""
    return context + turns * output_tokens + (turns - 1) * turn_tokens


def _check_fits(server: OpenAIServer, context: int, output_tokens: int, turns: int, turn_tokens: int) -> None:
    total = session_tokens(context, output_tokens, turns, turn_tokens)
    what = (f"a session of {context:,} prompt + {output_tokens:,} output tokens" if turns == 1 else
            f"a session of {turns} turns ({context:,} prompt tokens, {output_tokens:,} output and "
            f"{turn_tokens:,} new tokens a turn: {total:,} by its last)")
    server.check_fits(total, what, hint=f"use --context {(server.max_model_len or 0) - (total - context)} or less")


def fleet_nodes(server: OpenAIServer) -> list[str] | None:
    """The nodes behind `server` when it is a vllm-router, else None: those it routes to (a node it
    has taken out gets no session), whose /metrics are summed."""
    from glmctl.fleet.router import router_workers

    workers = router_workers(server.base_url, headers=server.headers)
    if not workers:
        return None
    return [w.url for w in workers if w.healthy] or [w.url for w in workers]


def run_cell(server: OpenAIServer, prompts: PromptSource, *, sessions: int, context: int, output_tokens: int,
             poll_interval: float = 0.5, on_tokens: Callable[[int], None] | None = None,
             idle_wait_s: float = 15.0, turns: int = 1, turn_tokens: int = 0,
             nodes: list[str] | None = None) -> BenchCell:
    _check_fits(server, context, output_tokens, turns, turn_tokens)
    plans = prompts.session_plans(sessions, context, turns, turn_tokens)
    before = wait_idle(server, idle_wait_s, nodes)
    run = drive(server, plans, output_tokens, poll_interval=poll_interval, on_tokens=on_tokens, nodes=nodes)
    after = scrape(server, 0.0, nodes)
    return _cell(sessions, context, output_tokens, run, before, after, turns, turn_tokens)


def compare(result: BenchResult, baseline: BenchResult) -> list[CellChange]:
    base = {(c.sessions, c.context_tokens): c for c in baseline.cells}
    out = []
    for c in result.cells:
        b = base.get((c.sessions, c.context_tokens))
        if b is None:
            continue
        now_v = c.steady.decode_tok_s if c.steady else None
        base_v = b.steady.decode_tok_s if b.steady else None
        change = 100.0 * (now_v / base_v - 1.0) if now_v and base_v else None
        out.append(CellChange(sessions=c.sessions, context_tokens=c.context_tokens, baseline_tok_s=base_v,
                              tok_s=now_v, change_percent=change))
    return out


def new_result(server: OpenAIServer, tokenizer: Tokenizer, prompts: PromptSource, poll_interval: float) -> BenchResult:
    return BenchResult(created=now(), server=server_info(server), tokenizer=tokenizer.source,
                       prompt_source=prompts.description, poll_interval_s=poll_interval, cells=[])


def sweep_contexts(server: OpenAIServer, output_tokens: int, turns: int = 1, turn_tokens: int = 0) -> list[int]:
    """The report's context columns that fit this server (all of them when it does not say)."""
    limit = server.max_model_len
    fitting = [c for c in SWEEP_CONTEXTS if limit is None or session_tokens(c, output_tokens, turns, turn_tokens) <= limit]
    if not fitting:
        raise UsageError(f"none of the sweep's default contexts ({', '.join(f'{c:,}' for c in SWEEP_CONTEXTS)}) "
                         f"fits the server's max_model_len of {limit:,} with {output_tokens} output tokens",
                         hint="pass --context with lengths that fit")
    return fitting


def run_bench(server: OpenAIServer, tokenizer: Tokenizer, prompts: PromptSource, *, sessions: list[int],
              contexts: list[int], output_tokens: int, poll_interval: float = 0.5,
              on_cell: Callable[[int, int], None] | None = None,
              on_tokens: Callable[[int], None] | None = None, turns: int = 1, turn_tokens: int = 0) -> BenchResult:
    """Every (sessions, context) cell, one after the other, fit-checked before the first one runs."""
    _check_fits(server, max(contexts), output_tokens, turns, turn_tokens)
    result = new_result(server, tokenizer, prompts, poll_interval)
    result.nodes = fleet_nodes(server)
    for n in sessions:
        for context in contexts:
            if on_cell:
                on_cell(n, context)
            cell = run_cell(server, prompts, sessions=n, context=context, output_tokens=output_tokens,
                            poll_interval=poll_interval, on_tokens=on_tokens, turns=turns,
                            turn_tokens=turn_tokens, nodes=result.nodes)
            check_cell(cell)  # a failed session makes every later number suspect: stop here
            result.cells.append(cell)
    if len(unmeasured_cells(result)) == len(result.cells):
        reasons = "; ".join(f"{c.sessions} x {c.context_tokens:,}: {c.no_steady_reason}" for c in result.cells)
        raise BenchFailed(f"no cell measured steady decode ({reasons}); no result was written",
                          hint="follow the reason given for each cell")
    return result
