"""Per-rank simulation of the reference node: one TP8 rank of GLM-5.3-Flash served by real vLLM.

A tensor-parallel rank of TP8 computes, apart from its collectives, what a TP1 model with the
per-rank dimensions computes (`glmctl testing rank-config`). This script serves such a model with
random weights (`load_format=dummy`) and the plugin's Triton path, on a KV budget equal to one
L40's memory, and measures, against the real OpenAI server:

* KV capacity: vLLM's logged "GPU KV cache size", its weight memory and memory split, the kernels
  it selected, and a boot timeline (`rank_sim_server`);
* steady decode per sessions x context cell, from vLLM's counters (glmctl's bench driver and
  steady window); with MTP, verify steps per second from vLLM's spec-decode counters (with random
  weights the acceptance is meaningless, so tokens/s is derived later from a stated one);
* time to first token: every session's, per cell (eight ~227k prompts sent together are the
  report's queue), and one 256k prompt on an idle server;
* where a steady decode step goes: vLLM's torch profiler for a few engine iterations inside the
  cell's steady window, kernels grouped by kind (`rank_sim_profile`);
* where a prefill chunk goes (cell `prefill`, `rank_sim_prefill`): one long prompt, the profiler
  around a few of its chunks at each `--prefill-contexts` context, each chunk's kernels by kind,
  with the GPU's bf16 matmul rate taken before the server starts.

The steady-window rule for many long sessions: all sessions are sent together (their prefills
queue, one at a time, as in the report) and each asks for up to `--decode-budget` tokens, enough to
outlast the queue. Once the server shows every prefill done (the prompt counter grew by all the
prompts), all sessions running, none waiting and no preemption for `--window-s` seconds, the
window is measured; the profile (when asked) then runs inside that same steady state, and the
client closes every stream (vLLM aborts the requests). A cell that finds no window by its own
time limit is stopped and says so.

    python bench/rank_sim.py --model RANK_DIR --name exl3-mtp3 --mtp 3 \
        --cells warm,8x22k,8x227k,256k --profile-cell 8x227k --out $OUT/rank-sim-exl3.json

Runs where vLLM (CUDA) is importable; writes the JSON after every cell, so a run stopped by its
deadline keeps what it measured. SIGTERM/SIGINT end the server's whole process group first.
Nothing here is a prediction: glmctl.plan.prediction.node_prediction turns the steps into 8x L40 figures.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_sim_prefill import DEFAULT_CONTEXTS, PREFILL, bf16_peak, parse_contexts, prefill_cell  # noqa: E402
from rank_sim_profile import breakdown  # noqa: E402
from rank_sim_server import Server, end_group  # noqa: E402

WARM_UP = "warm"  # a short cell before the measured ones: first-use JIT of the real-metadata paths
SINGLE = "256k"  # one 256,000-token prompt on an idle server (its TTFT)


def parse_cell(spec: str) -> tuple[int, int]:
    s, c = spec.lower().split("x")
    return int(s), int(float(c[:-1]) * 1000) if c.endswith("k") else int(c)


class WindowWatch(threading.Thread):
    """Ends a cell once its steady window is measured (see the module doc): samples the server's
    counters and gauges; `window_end` is when `window_s` of steady state had passed, `stop` tells
    the driver to close the streams; `profile` (when given) runs between the two."""

    def __init__(self, server, sessions: int, prompt_tokens: int, baseline, window_s: float,
                 deadline: float, profile=None, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.server, self.sessions, self.baseline = server, sessions, baseline
        self.prompt_target = baseline.prompt_tokens + prompt_tokens
        self.window_s, self.deadline, self.profile, self.interval = window_s, deadline, profile, interval
        self.stop = threading.Event()
        self.window_end: float | None = None  # time.monotonic()
        self.profile_result: dict | None = None
        self.reason: str | None = None

    def _all_decoding(self, s) -> bool:
        """Every prefill of the cell done, all its sessions running, nothing waiting."""
        return (s.prompt_tokens >= self.prompt_target and s.waiting == 0
                and s.running == self.sessions + self.baseline.running)

    def run(self) -> None:
        from glmctl.evals.metrics import scrape

        first = None
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if now > self.deadline:
                    self.reason = "the cell's time limit passed before a steady window"
                    break
                s = scrape(self.server, 0.0)  # t: time.monotonic()
                if not self._all_decoding(s):
                    first = None
                elif first is None or (s.prompt_tokens, s.preemptions) != (first.prompt_tokens, first.preemptions):
                    first = s  # a streak starts (again: a preemption or a late prefill splits it)
                if first is not None and s.t - first.t >= self.window_s:
                    self.window_end = time.monotonic()
                    if self.profile is not None:
                        self.profile_result = self.profile()
                    break
                time.sleep(self.interval)
        except Exception as exc:  # noqa: BLE001 - the cell reports it; the sessions are stopped
            self.reason = f"watching the cell failed: {type(exc).__name__}: {exc}"
        finally:
            self.stop.set()


def spec_counters(server) -> tuple[float, float]:
    """(drafts, accepted tokens) summed over vLLM's spec-decode counters."""
    from prometheus_client.parser import text_string_to_metric_families

    drafts = accepted = 0.0
    for fam in text_string_to_metric_families(server.metrics_text()):
        for s in fam.samples:
            if s.name == "vllm:spec_decode_num_drafts_total":
                drafts += s.value
            elif s.name == "vllm:spec_decode_num_accepted_tokens_total":
                accepted += s.value
    return drafts, accepted


def profiler(base_url: str, seconds: float):
    """Start vLLM's profiler, let it record, stop it; returns when the trace is being written."""
    def run() -> dict:
        import httpx

        started = time.time()
        httpx.post(base_url + "/start_profile", timeout=120).raise_for_status()
        time.sleep(seconds)
        try:  # it stops itself after its iteration limit; this is the fallback
            httpx.post(base_url + "/stop_profile", timeout=300)
        except httpx.HTTPError:
            pass
        return {"started": started, "seconds": round(time.time() - started, 1)}
    return run


def run_cell(server, prompts, sessions: int, context: int, *, decode_budget: int, window_s: float,
             time_limit_s: float, profile=None) -> dict:
    """One cell through glmctl's bench driver with the window rule of the module doc."""
    from glmctl.evals.bench_drive import drive
    from glmctl.evals.metrics import steady_window
    from glmctl.evals.serving_bench import wait_idle

    batch = prompts.prompts(sessions, context)
    before = wait_idle(server, 60.0)
    drafts0 = spec_counters(server)
    t_start = time.monotonic()
    watch = WindowWatch(server, sessions, sum(map(len, batch)), before, window_s, t_start + time_limit_s, profile)
    watch.start()
    run = drive(server, batch, decode_budget, poll_interval=0.25, stop=watch.stop)
    watch.stop.set()
    watch.join(timeout=400)
    drafts1 = spec_counters(server)
    traces = run.traces
    errors = [t.error for t in traces if t.error]
    firsts = [t.first_token_at for t in traces]
    out: dict = {"sessions": sessions, "context": context, "decode_budget": decode_budget,
                 "ttft_s": [None if f is None else round(f - t.sent_at, 2) for f, t in zip(firsts, traces, strict=True)],
                 "errors": errors[:2], "stopped_by_client": sum(t.stopped for t in traces),
                 "metrics_silences": run.metrics_silences[:20],  # (t, s): scrapes the server left unanswered
                 "wall_s": round(time.monotonic() - t_start, 1)}
    if watch.profile_result is not None:
        out["profile"] = watch.profile_result
    if errors or any(f is None for f in firsts):
        out["no_window"] = watch.reason or "a session failed or received no token"
        return out
    end = min(t.done_at for t in traces)
    if watch.window_end is not None:
        end = min(end, watch.window_end - run.started)  # the profiled iterations are not in the rate
    window = steady_window(run.samples, sessions, after=max(firsts), before=end, baseline_running=before.running)
    if window is None:
        out["no_window"] = watch.reason or "no steady window (see glmctl bench for the rule)"
        return out
    tok_s = window.tokens_per_second
    out.update(decode_tok_s=round(tok_s, 2), window_s=round(window.seconds, 2))
    d_drafts, d_acc = drafts1[0] - drafts0[0], drafts1[1] - drafts0[1]
    gen = sum(t.output_tokens for t in traces)
    if d_drafts > 0:
        # Each request's verify step emits 1 + accepted tokens; drafts count request-steps.
        tokens_per_step = gen / d_drafts
        out.update(measured_tokens_per_step=round(tokens_per_step, 3), accepted_per_step=round(d_acc / d_drafts, 3),
                   steps_per_s=round(tok_s / sessions / tokens_per_step, 2))
    else:
        out["steps_per_s"] = round(tok_s / sessions, 2)
    out["step_ms"] = round(1000.0 / out["steps_per_s"], 3)
    return out


def ttft_single(server, prompts, context: int) -> float | None:
    from glmctl.evals.bench_drive import drive

    run = drive(server, prompts.prompts(1, context), 2, poll_interval=1.0)
    t = run.traces[0]
    return None if t.first_token_at is None else round(t.first_token_at - t.sent_at, 2)


def warm_up(server, prompts) -> dict:
    """One 8k prompt, then 8 short ones together: the prefill and decode paths with real metadata
    compile here (the profiling run has none), not inside a measured cell."""
    from glmctl.evals.bench_drive import drive

    t0 = time.monotonic()
    drive(server, prompts.prompts(1, 8192), 4, poll_interval=1.0)
    drive(server, prompts.prompts(8, 1024), 32, poll_interval=1.0)
    return {"cell": WARM_UP, "wall_s": round(time.monotonic() - t0, 1)}


def _layers(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config).get("num_hidden_layers", 45))


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--mtp", type=int, default=0)
    ap.add_argument("--kv", default="fp8")
    ap.add_argument("--plugin", default="on")
    ap.add_argument("--gpu-mem-gib", type=float, default=44.40, help="one L40's memory as torch sees it")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="fixed KV space instead of --gpu-mem-gib (dry runs on vLLM CPU)")
    ap.add_argument("--max-model-len", type=int, default=262144)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-capture", type=int, default=48)
    ap.add_argument("--no-compile", action="store_true", help="no torch.compile; FULL decode graphs")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cells", default="8x22k", help=f"comma list: SxCk cells, {WARM_UP!r}, {SINGLE!r}, {PREFILL!r}")
    ap.add_argument("--decode-budget", type=int, default=4096, help="max tokens a session may decode")
    ap.add_argument("--window-s", type=float, default=8.0, help="steady seconds a cell measures")
    ap.add_argument("--cell-limit-s", type=float, default=420.0, help="a cell's own time limit")
    ap.add_argument("--profile-cell", default=None, help="comma list of the cells to profile")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--prefill-contexts", default=DEFAULT_CONTEXTS, help=f"the {PREFILL!r} cell's window contexts")
    ap.add_argument("--prefill-window-chunks", type=int, default=4, help="chunks per prefill window")
    ap.add_argument("--prefill-min-s", type=float, default=90.0, help=f"time the {PREFILL!r} cell needs to start")
    ap.add_argument("--env", action="append", help="KEY=VALUE for the server")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for everything")
    return ap.parse_args()


def main() -> int:
    args = _args()
    t_end = time.monotonic() + args.deadline
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    profile_dir = Path(f"/tmp/rank-sim-prof-{args.name}")
    profile_dir.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    record: dict = {"name": args.name, "device": device, "torch_version": torch.__version__, "settings": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "cells": [],
        "method": "steady window of vLLM's counters (glmctl bench driver); sessions stopped by the client once "
                  "it is measured (bench/rank_sim.py's rule)"}
    try:
        import vllm

        record["vllm_version"] = vllm.__version__
    except ImportError as exc:
        record["error"] = f"vllm not importable: {exc}"
        args.out.write_text(json.dumps(record, indent=1))
        return 1

    def save() -> None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(args.out)

    if PREFILL in args.cells.split(","):  # the GPU is still free: its bf16 rate, the prefill fractions' peak
        record["bf16_matmul"] = bf16_peak()
        save()
    server = Server(args, out_dir / f"vllm-{args.name}.log", profile_dir, Path(f"/tmp/rank-sim-{args.name}.pgid"))

    def on_signal(signum, frame):  # the stage script's timeout: end the server's group, keep the record
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # the deadline ends the server even when a client call blocks: the call then fails and the run ends
    killer = threading.Timer(max(1.0, t_end - time.monotonic()),
                             lambda: server.proc is not None and end_group(server.proc.pid))
    killer.daemon = True
    killer.start()
    try:
        record["server"] = server.start(deadline=t_end - 30)
        save()
        print(f"[{args.name}] up in {record['server']['startup_s']} s, KV {record['server'].get('kv_tokens')} tokens",
              flush=True)
        _cells(args, server, record, save, profile_dir, t_end)
    except BaseException as exc:  # noqa: BLE001 - SystemExit from a signal too: the record says what ended it
        record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        print(f"[{args.name}] ERROR {record['error'][:2000]}", flush=True)
    finally:
        killer.cancel()
        try:
            if "server" in record:
                record["server"].update(_late_facts(server))
        except OSError:
            pass
        server.stop()
        save()
    return 0 if not record.get("error") else 1


def _late_facts(server) -> dict:
    """Facts logged after the server answered (the JIT warnings of measured cells among them)."""
    text = server.log_path.read_text(errors="replace")
    jit = [ln.strip()[:240] for ln in text.splitlines() if "during inference" in ln and "latency spike" in ln]
    return {"jit_after_warmup": {"count": len(jit), "first": jit[:6]}}


def _cells(args, server, record: dict, save, profile_dir: Path, t_end: float) -> None:
    from glmctl.evals.client import OpenAIServer
    from glmctl.evals.corpus import stdlib_text
    from glmctl.evals.serving_bench import PromptSource
    from glmctl.evals.tokenizer import open_tokenizer

    client = OpenAIServer(server.base, "rank", timeout=900.0)
    client.connect()
    prompts = PromptSource(open_tokenizer(client, args.model), stdlib_text())
    for spec in [c for c in args.cells.split(",") if c]:
        left = t_end - time.monotonic()
        if left < 30:
            record["cells"].append({"cell": spec, "skipped": "deadline"})
            continue
        t0 = time.monotonic()
        try:
            if spec == WARM_UP:
                cell = warm_up(client, prompts)
            elif spec == PREFILL:
                if left < args.prefill_min_s:
                    record["cells"].append({"cell": spec, "skipped": f"deadline ({left:.0f} s left)"})
                    save()
                    continue
                cell = prefill_cell(client, prompts, server.base, profile_dir, _layers(args.model), record["server"],
                                    contexts=parse_contexts(args.prefill_contexts), chunk=args.chunk,
                                    window_chunks=args.prefill_window_chunks, time_limit_s=left - 20)
            elif spec == SINGLE:
                cell = {"cell": spec, "prompt_tokens": 256_000, "ttft_s": ttft_single(client, prompts, 256_000)}
                record["prefill_ttft_256k_s"] = cell["ttft_s"]
            else:
                sessions, context = parse_cell(spec)
                budget = max(16, min(args.decode_budget, args.max_model_len - context - 64))
                profiled = spec in (args.profile_cell or "").split(",")
                prof = profiler(server.base, 3.0) if profiled else None
                cell = run_cell(client, prompts, sessions, context, decode_budget=budget, window_s=args.window_s,
                                time_limit_s=min(args.cell_limit_s, left - 20), profile=prof)
                if prof is not None:
                    since = (cell.get("profile") or {}).get("started")
                    cell["breakdown"] = (breakdown(profile_dir, args.profile_steps, _layers(args.model), since)
                                         if since else {"error": cell.get("no_window", "the profile never started")})
        except Exception as exc:  # noqa: BLE001 - record and carry on with the next cell
            cell = {"error": f"{type(exc).__name__}: {exc}"}
        cell["cell"] = spec
        record["cells"].append(cell)
        save()
        ttft = [x for x in cell.get("ttft_s", []) or [] if x] if isinstance(cell.get("ttft_s"), list) else []
        print(f"[{args.name}] {spec}: {cell.get('decode_tok_s')} tok/s, step {cell.get('step_ms')} ms, "
              f"TTFT max {max(ttft or [0])} s ({time.monotonic() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
