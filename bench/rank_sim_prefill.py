"""bench/rank_sim.py's `prefill` cell: one long prompt on an idle server, with vLLM's torch profiler
recording a few of its chunks (`--chunk` tokens each) at each of several contexts (default ~8k,
~64k, ~240k), so that a chunk's kernel time can be split by component at a known context.

Placing a window: during a prefill the only progress figure vLLM publishes is its KV-usage gauge
(the prompt counter moves when the prefill ends). `ContextMeter` polls it: the first rise is the
first chunk, and every later rise is a whole number of attention blocks (the smallest rise seen is
one block of the attention block size vLLM logs), so the context is one chunk plus the rises in
blocks. A window starts (`/start_profile`) once that estimate reaches its target less half a
window, and stops (`/stop_profile`, which returns once the trace is written) `window_chunks` chunks
later. The estimate only places windows: each profiled iteration's context is read from the trace
(`rank_sim_profile.chunk_breakdown`, vLLM's detailed step annotation, which the server turns on
when this cell is among the cells).

Costs: the prompt's prefill (about 0.25 s per 2,048-token chunk on the H200: ~31 s for 252k
tokens) plus each window's trace export, during which the engine stands still. The prompt's time to
first token is therefore no TTFT measurement (`profiled_ttft_s`); what the gauge shows outside the
windows is: `admission_s` (sent -> first chunk scheduled) and `finish_s` (last chunk scheduled ->
first token).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

PREFILL = "prefill"  # the cell's name in --cells
DEFAULT_CONTEXTS = "8k,64k,240k"
TAIL_CHUNKS = 4  # chunks of the prompt after the last window: the estimate may run late by a few
EPS = 1e-9
_BLOCK_LINE = re.compile(r"attention block size to (\d+) tokens")
# bf16 matmul rate of this GPU (random data, best of 5 x 20 back-to-back 8192^3 products), taken in
# a process of its own before the server starts: the peak the prefill record's fractions use.
PEAK_CODE = """
import json, torch
n = 8192
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(10):
    a @ b
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
best = 0.0
for _ in range(5):
    s.record()
    for _ in range(20):
        a @ b
    e.record()
    torch.cuda.synchronize()
    best = max(best, 20 * 2 * n ** 3 / (s.elapsed_time(e) * 1e-3))
print(json.dumps({"bf16_tflops": round(best / 1e12, 1), "device": torch.cuda.get_device_name(0),
                  "how": "torch bf16 matmul 8192^3 on random data, best of 5 x 20 back to back (CUDA events)"}))
"""


def parse_contexts(spec: str) -> list[int]:
    out = []
    for part in (p.strip().lower() for p in spec.split(",") if p.strip()):
        out.append(int(float(part[:-1]) * 1000) if part.endswith("k") else int(part))
    return sorted(out)


def prompt_tokens(contexts: list[int], chunk: int, window_chunks: int) -> int:
    """The prompt: the last window centred on its target, then TAIL_CHUNKS more chunks."""
    return max(contexts) + (window_chunks * chunk) // 2 + TAIL_CHUNKS * chunk


def block_tokens(facts: dict) -> int | None:
    """The attention block size vLLM logged ("Setting attention block size to N tokens")."""
    for line in facts.get("block_lines") or []:
        m = _BLOCK_LINE.search(line)
        if m:
            return int(m[1])
    return None


class ContextMeter:
    """Context of the one prompt being prefilled, from KV-usage readings (see the module doc).
    Without a block size, the usage is taken as `kv_tokens` tokens per unit (the logged KV
    capacity: a few percent low, as it spreads each request's fixed blocks over its tokens)."""

    def __init__(self, chunk: int, block: int | None, kv_tokens: int | None, baseline: float) -> None:
        self.chunk, self.block, self.kv_tokens, self.baseline = chunk, block, kv_tokens, baseline
        self.first: float | None = None
        self.last: float | None = None
        self.unit: float | None = None  # the smallest rise after the first: one block
        self.first_t: float | None = None
        self.last_t: float | None = None

    def update(self, usage: float, t: float) -> None:
        if usage <= self.baseline + EPS:
            return
        if self.first is None:
            self.first, self.last, self.first_t, self.last_t = usage, usage, t, t
            return
        rise = usage - self.last
        if rise > EPS:
            self.unit = rise if self.unit is None else min(self.unit, rise)
            self.last, self.last_t = usage, t

    @property
    def context(self) -> int | None:
        if self.first is None:
            return None
        grown = self.last - self.first
        if self.block and self.unit:
            return self.chunk + round(grown / self.unit) * self.block
        if self.kv_tokens:
            return self.chunk + round(grown * self.kv_tokens)
        return self.chunk


class PrefillWindows(threading.Thread):
    """Starts and stops the profiler around the prompt's chunks at each target context (see the
    module doc); `done` is set by the caller when the prompt has its first token. Every callable is
    injected (usage reader, profile start/stop, clock, sleep) so the placement is testable."""

    def __init__(self, read_usage: Callable[[], float], start: Callable[[], None], stop: Callable[[], None],
                 contexts: list[int], chunk: int, window_chunks: int, meter: ContextMeter, deadline: float,
                 done: threading.Event, *, interval: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(daemon=True)
        self.read_usage, self.start_profile, self.stop_profile = read_usage, start, stop
        self.contexts, self.chunk, self.window_chunks = contexts, chunk, window_chunks
        self.meter, self.deadline, self.done = meter, deadline, done
        self.interval, self.clock, self.sleep = interval, clock, sleep
        self.windows: list[dict] = []
        self.polls = self.silences = 0

    def _poll(self) -> None:
        try:
            usage = self.read_usage()
        except Exception:  # noqa: BLE001 - a silent /metrics is a gap, not the end of the cell
            self.silences += 1
            return
        self.polls += 1
        self.meter.update(usage, self.clock())

    def _wait_for(self, context: int) -> bool:
        while not self.done.is_set() and self.clock() < self.deadline:
            self._poll()
            now = self.meter.context
            if now is not None and now >= context:
                return True
            self.sleep(self.interval)
        return False

    def run(self) -> None:
        t0 = self.clock()
        for target in self.contexts:
            if not self._wait_for(max(0, target - self.window_chunks * self.chunk // 2)):
                self.windows.append({"target": target, "missed": "the prompt ended or the cell's time ran out first"})
                continue
            w: dict = {"target": target, "est_context_at_start": self.meter.context,
                       "started_s": round(self.clock() - t0, 2)}
            try:
                self.start_profile()
                self._wait_for(self.meter.context + self.window_chunks * self.chunk)
                w["est_context_at_stop"] = self.meter.context
                stop_at = self.clock()
                self.stop_profile()
                w["stop_call_s"] = round(self.clock() - stop_at, 2)  # the trace's export: the engine waits
            except Exception as exc:  # noqa: BLE001 - the window says so; the cell goes on
                w["error"] = f"{type(exc).__name__}: {exc}"[:300]
            self.windows.append(w)
        while not self.done.is_set() and self.clock() < self.deadline:  # the last chunk's time
            self._poll()
            self.sleep(self.interval)


def _post(base: str, path: str, timeout: float) -> None:
    import httpx

    httpx.post(base + path, timeout=timeout).raise_for_status()


def bf16_peak(timeout_s: float = 120.0) -> dict:
    """PEAK_CODE in a process of its own (the GPU must be free: before the server starts)."""
    try:
        done = subprocess.run([sys.executable, "-c", PEAK_CODE], capture_output=True, text=True, timeout=timeout_s)
        if done.returncode == 0:
            return json.loads(done.stdout.strip().splitlines()[-1])
        return {"error": (done.stderr or done.stdout)[-400:]}
    except (subprocess.TimeoutExpired, OSError, ValueError, IndexError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def prefill_cell(client, prompts, base: str, profile_dir: Path, layers: int, server_facts: dict, *,
                 contexts: list[int], chunk: int, window_chunks: int, time_limit_s: float) -> dict:
    """The cell (see the module doc): the prompt, its windows, then each window's trace split into
    chunks (`rank_sim_profile.chunk_breakdown`)."""
    from rank_sim_profile import chunk_breakdown, load_events, traces_since

    from glmctl.evals.bench_drive import drive
    from glmctl.evals.metrics import scrape
    from glmctl.evals.serving_bench import wait_idle

    length = prompt_tokens(contexts, chunk, window_chunks)
    batch = prompts.prompts(1, length)
    before = wait_idle(client, 60.0)
    meter = ContextMeter(chunk, block_tokens(server_facts), server_facts.get("kv_tokens"), before.kv_usage)
    done = threading.Event()
    since = time.time()
    windows = PrefillWindows(lambda: scrape(client, 0.0).kv_usage, lambda: _post(base, "/start_profile", 120),
                             lambda: _post(base, "/stop_profile", 300), contexts, chunk, window_chunks, meter,
                             time.monotonic() + time_limit_s, done)
    windows.start()
    try:
        run = drive(client, batch, 2, poll_interval=1.0)
    finally:
        done.set()
        windows.join(timeout=330)
    t = run.traces[0]
    sent = run.started + t.sent_at
    out: dict = {"cell": PREFILL, "prompt_tokens": length, "contexts": contexts, "window_chunks": window_chunks,
                 "block_tokens": meter.block, "profiled_ttft_s": None if t.first_token_at is None
                 else round(t.first_token_at - t.sent_at, 2), "windows": windows.windows,
                 "usage_polls": windows.polls, "usage_silences": windows.silences, "errors": [t.error] if t.error else []}
    if meter.first_t is not None:
        out["admission_s"] = round(meter.first_t - sent, 2)
        if t.first_token_at is not None:
            out["finish_s"] = round(run.started + t.first_token_at - meter.last_t, 2)
    out["traces"] = []
    for trace in traces_since(profile_dir, since):
        split = chunk_breakdown(load_events(trace), layers)
        out["traces"].append({"trace": trace.name, **split})
    out["summary"] = summary(out["traces"])
    return out


def summary(traces: list[dict]) -> list[dict]:
    """Per trace: the complete prefill chunks' mean context, GPU span and wall time (the table's line)."""
    rows = []
    for tr in traces:
        its = [it for it in tr.get("iterations", []) if it["complete"] and it.get("ctx_requests")]
        if not its:
            rows.append({"trace": tr.get("trace"), "chunks": 0, "error": tr.get("error", "no complete prefill chunk")})
            continue
        ctx = [it["context"] for it in its if it["context"] is not None]
        walls = [it["wall_us"] for it in its if it["wall_us"]]
        rows.append({"trace": tr.get("trace"), "chunks": len(its),
                     "context": round(sum(ctx) / len(ctx)) if ctx else None,
                     "span_ms": round(sum(it["span_us"] for it in its) / len(its) / 1e3, 2),
                     "wall_ms": round(sum(walls) / len(walls) / 1e3, 2) if walls else None})
    return rows
