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

from glmctl.evals.client import ServerError

GENERATION = "vllm:generation_tokens"
PROMPT = "vllm:prompt_tokens"
PREEMPTIONS = "vllm:num_preemptions"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class MetricsSample:
    t: float  # seconds since the run started (the midpoint of the scrape)
    generation_tokens: float
    prompt_tokens: float
    preemptions: float
    running: float
    waiting: float
    kv_usage: float  # fraction 0..1 (the mean over engines)


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
        if base in (GENERATION, PROMPT, PREEMPTIONS, RUNNING, WAITING) and not s.name.endswith("_created"):
            sums[base] = sums.get(base, 0.0) + float(s.value)
        elif s.name == KV_USAGE:
            kv.append(float(s.value))
    if GENERATION not in sums:
        raise ServerError(f"/metrics has no {GENERATION}_total counter"
                          + (f" for model {model!r}" if model else ""),
                          hint="bench reads vLLM's Prometheus counters: serve with vLLM (metrics are on by default)")
    return MetricsSample(t=t, generation_tokens=sums[GENERATION], prompt_tokens=sums.get(PROMPT, 0.0),
                         preemptions=sums.get(PREEMPTIONS, 0.0), running=sums.get(RUNNING, 0.0),
                         waiting=sums.get(WAITING, 0.0), kv_usage=sum(kv) / len(kv) if kv else 0.0)


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


def scrape(server, t0: float) -> MetricsSample:
    """A synchronous scrape (for a sample before and after a run)."""
    sent = time.monotonic()
    text = server.metrics_text()
    mid = (sent + time.monotonic()) / 2 - t0
    return parse_metrics(text, server.model_id, mid)
