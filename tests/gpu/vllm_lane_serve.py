"""Subprocess body of the gpu lane's serve case: the real OpenAI server through glmctl's own CLI.

    python tests/gpu/vllm_lane_serve.py REQUEST.json   -> one JSON line on stdout, prefixed "@@"

REQUEST: {"checkpoint": DIR, "profile": YAML, "port": N, "timeout_s": S}. Runs, as a user would:
`glmctl serve --profile P --model DIR --port N --json` (preflight, vLLM through glmctl's launcher,
its ready document on stdout), one greedy completion, `glmctl bench --url`, `glmctl eval
perplexity --url`, `glmctl plan --json` for the same GPU and profile, then Ctrl-C (SIGINT) to the
server and its exit status. Every command's exit status, JSON and stderr tail are reported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
sys.path.insert(0, str(REPO))


def glmctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "glmctl", *args]


def _run(argv: list[str], timeout: float) -> dict:
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"argv": argv[2:], "rc": None, "error": f"timed out after {timeout:.0f} s"}
    out: dict = {"argv": argv[2:], "rc": proc.returncode, "seconds": round(time.perf_counter() - started, 1),
                 "stderr_tail": proc.stderr[-1500:]}
    try:
        out["json"] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out["stdout_tail"] = proc.stdout[-1500:]
    return out


def _ready_document(proc: subprocess.Popen, deadline: float) -> dict | None:
    """The JSON `glmctl serve --json` prints once vLLM is healthy (several lines, indented)."""
    text, found = "", {}

    def read() -> None:
        nonlocal text
        for line in proc.stdout:
            text += line
            try:
                found["doc"] = json.loads(text)
                return
            except json.JSONDecodeError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(max(0.0, deadline - time.monotonic()))
    return found.get("doc")


def _completion(base_url: str, model: str, max_tokens: int = 8) -> dict:
    body = {"model": model, "prompt": "def fibonacci(n):\n    ", "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "ignore_eos": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        choice = json.loads(r.read())["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    return {"tokens": len(choice["logprobs"]["tokens"]), "logprobs_ok": all(x <= 0 for x in lps),
            "text": choice["text"], "seconds": time.perf_counter() - started}


# The bench cell: 2 sessions of 1k context, decoding long enough for a steady window of
# BENCH_WINDOW_S (glmctl bench needs two /metrics samples with nothing else happening; at
# BENCH_POLL_S that is ~15), sized from this server's own decode speed.
BENCH_WINDOW_S, BENCH_POLL_S, BENCH_CONTEXT = 3.0, 0.2, 1024


def bench_output_tokens(seconds_short: float, seconds_long: float, extra_tokens: int, max_model_len: int) -> int:
    """Output tokens per session for a steady window of BENCH_WINDOW_S: the decode rate from two
    completions that differ by `extra_tokens` (prefill and overheads cancel), doubled for the two
    sessions' batch being slower than one, kept within the model length."""
    per_token = max((seconds_long - seconds_short) / extra_tokens, 1e-4)
    tokens = int(2 * BENCH_WINDOW_S / per_token) + 64
    return max(64, min(tokens, max_model_len - BENCH_CONTEXT - 64))


def plan_args(prof, ckpt: str, gpus: list) -> list[str]:
    """`glmctl plan` for the profile's setup on this node (its fixed KV space, if it has one)."""
    args = ["plan", "--model", ckpt, "--max-model-len", str(prof.max_model_len), "--max-num-seqs",
            str(prof.max_num_seqs), "--json"]
    if prof.platform == "cpu":
        return [*args, "--cpu", "--kv-cache-gib", prof.env.get("VLLM_CPU_KVCACHE_SPACE", "1")]
    args += ["--num-gpus", "1", "--gpu-memory-gib", f"{gpus[0].total_gib:.4f}", "--gpu-memory-utilization",
             str(prof.gpu_memory_utilization or 0.92)]
    fixed = prof.vllm_args.get("kv-cache-memory-bytes")
    return args + (["--kv-cache-gib", repr(int(fixed) / GIB)] if fixed is not None else [])


def main(request: dict) -> dict:
    ckpt, port = request["checkpoint"], str(request["port"])
    report: dict = {}
    started = time.perf_counter()
    err = open(Path(request["log"]), "w")  # the server's stderr, for its whole life
    serve = subprocess.Popen(glmctl("serve", "--profile", request["profile"], "--model", ckpt, "--port", port,
                                    "--json"), stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO,
                             start_new_session=True)
    from tests.gpu.vllm_lane_schedule import record_own_group

    record_own_group(serve.pid)  # its own session: the lane stops it by this id if this helper is killed
    try:
        doc = _ready_document(serve, time.monotonic() + request.get("timeout_s", 300))
        report["startup_s"] = round(time.perf_counter() - started, 1)
        report["ready"] = doc
        if doc is None:
            report["error"] = (f"glmctl serve gave no ready document (exit {serve.poll()}); "
                               f"stderr: {Path(request['log']).read_text()[-3000:]}")
        else:
            _after_ready(report, request, doc, ckpt)
    except Exception as exc:  # noqa: BLE001 - the server is stopped below and the report kept
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _stop(serve, report)
        err.close()
    return report


def _after_ready(report: dict, request: dict, doc: dict, ckpt: str) -> None:
    from glmctl.probe.gpus import inventory
    from glmctl.serving import profiles

    base = doc["endpoint"].removesuffix("/v1")
    report["completion"] = _completion(base, doc["model"])
    longer = _completion(base, doc["model"], 8 + 128)
    max_len = profiles.load(request["profile"]).max_model_len
    tokens = bench_output_tokens(report["completion"]["seconds"], longer["seconds"], 128, max_len)
    report["bench_output_tokens"] = tokens
    report["bench"] = _run(glmctl("bench", "--url", base, "--sessions", "2", "--context", str(BENCH_CONTEXT),
                                  "--output-tokens", str(tokens), "--poll-interval", str(BENCH_POLL_S),
                                  "--json"), 180)
    report["perplexity"] = _run(glmctl("eval", "perplexity", "--url", base, "--window", "512",
                                       "--max-tokens", "2048", "--json"), 180)
    report["plan"] = _run(glmctl(*plan_args(profiles.load(request["profile"]), ckpt, inventory())), 60)
    log = Path(doc["log"])
    text = log.read_text(errors="replace") if log.exists() else ""
    report["log_plugin_lines"] = [ln[ln.index("glmctl plugin:"):][:300] for ln in text.splitlines()
                                  if "glmctl plugin:" in ln][:6]
    report["log_errors"] = [ln[-300:] for ln in text.splitlines() if " ERROR " in ln][:6]


def _stop(serve: subprocess.Popen, report: dict) -> None:
    """Ctrl-C (SIGINT) to `glmctl serve`, as an operator stops it; its exit status."""
    if serve.poll() is not None:
        report.setdefault("exit_status", serve.returncode)
        return
    serve.send_signal(signal.SIGINT)
    try:
        report["exit_status"] = serve.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)
        report["exit_status"] = f"killed: still running 90 s after SIGINT ({serve.wait(10)})"


if __name__ == "__main__":
    print("@@" + json.dumps(main(json.loads(Path(sys.argv[1]).read_text())), default=str), flush=True)
