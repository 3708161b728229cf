"""vLLM's Prometheus metrics, sampled over time, and the steady decode window found in them.

Names as vLLM 0.30 registers them (vllm/v1/metrics/loggers.py); prometheus_client appends `_total`
to counters. Every series carries `model_name` and `engine` labels; a sample sums the series of the
model over engines (data parallel), as vLLM's own bench does for its spec-decode counters.

    vllm:generation_tokens_total   counter  tokens generated (one per decoded token per request)
    vllm:prompt_tokens_total       counter  prompt tokens, counted when a request's prefill *ends*
    vllm:num_preemptions_total     counter  requests preempted (their KV is recomputed later)
    vllm:num_requests_running      gauge    requests scheduled (decoding, or in a chunked prefill)
    vllm:num_requests_waiting      gauge    requests queued
    vllm:kv_cache_usage_perc       gauge    fraction of KV blocks in use, 0..1
    vllm:request_success_total     counter  requests finished (one series per finish reason)

Behind vllm-router, whose own /metrics forwards one node's, a sample is taken from every node and
summed (`combine`): the counters and request gauges add up, KV usage is the mean over the nodes.

The prompt counter moves only when a prefill finishes, and a request in the middle of a chunked
prefill already counts as running. So the server's counters alone cannot tell "all decoding" from
"one still prefilling": the steady window also requires, from the client's side, that every session
has received its first token and none has received its last.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from glmctl.evals.client import QUICK_TIMEOUT_S, ServerError, ServerUnreachable

GENERATION = "vllm:generation_tokens"
PROMPT = "vllm:prompt_tokens"
PREEMPTIONS = "vllm:num_preemptions"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
FINISHED = "vllm:request_success"


@dataclass(frozen=True)
class MetricsSample:
    t: float  # seconds since the run started (the midpoint of the scrape)
    generation_tokens: float
    prompt_tokens: float
    preemptions: float
    running: float
    waiting: float
    kv_usage: float  # fraction 0..1 (the mean over engines)
    requests_finished: float = 0.0


def parse_metrics(text: str, model: str | None = None, t: float = 0.0) -> MetricsSample:
    """One sample from a /metrics text; series of other models (`model_name` label) are skipped."""
    sums: dict[str, float] = {}
    kv: list[float] = []
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError) as exc:
        raise ServerError(f"/metrics is not Prometheus text ({exc})",
                          hint="bench reads vLLM's Prometheus counters; is this a vLLM server?") from exc
    for s in samples:
        if model is not None and s.labels.get("model_name", model) != model:
            continue
        base = s.name[: -len("_total")] if s.name.endswith("_total") else s.name
        if base in (GENERATION, PROMPT, PREEMPTIONS, RUNNING, WAITING, KV_USAGE) and not math.isfinite(s.value):
            raise ServerError(f"/metrics reports {s.name} = {s.value}: the server's counters are broken")
        if base in (GENERATION, PROMPT, PREEMPTIONS, RUNNING, WAITING, FINISHED) and not s.name.endswith("_created"):
            sums[base] = sums.get(base, 0.0) + float(s.value)
        elif s.name == KV_USAGE:
            kv.append(float(s.value))
    if GENERATION not in sums:
        raise ServerError(f"/metrics has no {GENERATION}_total counter"
                          + (f" for model {model!r}" if model else ""),
                          hint="bench reads vLLM's Prometheus counters: serve with vLLM (metrics are on by default)")
    return MetricsSample(t=t, generation_tokens=sums[GENERATION], prompt_tokens=sums.get(PROMPT, 0.0),
                         preemptions=sums.get(PREEMPTIONS, 0.0), running=sums.get(RUNNING, 0.0),
                         waiting=sums.get(WAITING, 0.0), kv_usage=sum(kv) / len(kv) if kv else 0.0,
                         requests_finished=sums.get(FINISHED, 0.0))


def combine(samples: list[MetricsSample], t: float) -> MetricsSample:
    """One sample of several nodes (a fleet behind a router): sums, and the mean KV usage."""
    return MetricsSample(t=t, generation_tokens=sum(s.generation_tokens for s in samples),
                         prompt_tokens=sum(s.prompt_tokens for s in samples),
                         preemptions=sum(s.preemptions for s in samples), running=sum(s.running for s in samples),
                         waiting=sum(s.waiting for s in samples),
                         kv_usage=sum(s.kv_usage for s in samples) / len(samples),
                         requests_finished=sum(s.requests_finished for s in samples))


@dataclass(frozen=True)
class SteadyWindow:
    first: int  # sample indices, inclusive
    last: int
    t0: float
    t1: float
    generated_tokens: float  # counter delta over [t0, t1]

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("nan")


def steady_window(samples: list[MetricsSample], sessions: int, *, after: float, before: float,
                  baseline_running: float = 0.0) -> SteadyWindow | None:
    """The longest run of samples in which all `sessions` decode and nothing else happens.

    A sample qualifies when `running == sessions + baseline_running`, `waiting == 0`, and it lies in
    [after, before] (after every session's first token, before any session's last). Consecutive
    qualifying samples form a window only while the prompt and preemption counters stay unchanged:
    a finished prefill or a preemption (whose KV is recomputed) splits it.
    """
    best: SteadyWindow | None = None
    i = 0
    while i < len(samples):
        if not _qualifies(samples[i], sessions + baseline_running, after, before):
            i += 1
            continue
        j = i
        while (j + 1 < len(samples) and _qualifies(samples[j + 1], sessions + baseline_running, after, before)
               and samples[j + 1].prompt_tokens == samples[i].prompt_tokens
               and samples[j + 1].preemptions == samples[i].preemptions):
            j += 1
        if j > i:
            a, b = samples[i], samples[j]
            window = SteadyWindow(i, j, a.t, b.t, b.generation_tokens - a.generation_tokens)
            if best is None or window.seconds > best.seconds:
                best = window
        i = j + 1
    return best


def _qualifies(s: MetricsSample, running: float, after: float, before: float) -> bool:
    return s.running == running and s.waiting == 0 and after <= s.t <= before


def scrape(server, t0: float, nodes: list[str] | None = None) -> MetricsSample:
    """A synchronous scrape (for a sample before and after a run). `nodes`: the base URLs of the
    nodes behind a router, each scraped and the answers combined; one that does not answer is left
    out (the bench reports its sessions), none answering is an error."""
    sent = time.monotonic()
    if not nodes:
        text = server.metrics_text()
        return parse_metrics(text, server.model_id, (sent + time.monotonic()) / 2 - t0)
    import httpx

    answered = []
    for node in nodes:
        try:
            response = httpx.get(f"{node}/metrics", headers=server.headers, timeout=QUICK_TIMEOUT_S)
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            answered.append(parse_metrics(response.text, server.model_id))
    if not answered:
        raise ServerUnreachable(f"none of the {len(nodes)} node(s) behind {server.base_url} answers /metrics",
                                hint="glmctl fleet status --url " + server.base_url + " shows each node")
    return combine(answered, (sent + time.monotonic()) / 2 - t0)
