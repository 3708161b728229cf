#!/usr/bin/env python3
"""`make demo`: the main job on the embedded default (the tiny checkpoint, served on CPU).

Each step is the real `glmctl` command a user would type; the demo stops at the first failure.
The eval and bench steps run against the tiny checkpoint served by vLLM (profile tiny-cpu).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLMCTL = [sys.executable, "-m", "glmctl"]


def steps(tiny: Path) -> list[tuple[str, list[str]]]:
    return [
        # block 1024: vLLM 0.30 cannot lay out the tiny checkpoint's bf16 KV at its default 512
        ("KV plan for the tiny checkpoint on this CPU",
         ["plan", "--model", str(tiny), "--cpu", "--block-size", "1024"]),
        ("KV plan for GLM-5.3-Flash on the reference node (8x L40, commercial setup)",
         ["plan", "--model", "glm-5.3-flash", "--gpus", "8xL40", "--tp", "8", "--experts", "exl3:4",
          "--kda", "fp8", "--kv-cache-dtype", "fp8", "--speculative", "mtp:3", "--max-num-seqs", "8"]),
        ("The report's five KV pools on 8x L40: planner predictions vs measurements",
         ["plan", "--reproduce-report"]),
        ("Block-FP8 attention projections of the tiny checkpoint (step 7 of the report), streamed and atomic",
         ["quantize", "fp8", str(tiny), str(tiny.parent / "tiny-glm-fp8"), "--force"]),
        ("...verified against the source: structure, config vs tensors, per-tensor error",
         ["quantize", "verify", str(tiny.parent / "tiny-glm-fp8"), "--reference", str(tiny), "--top", "5"]),
    ]


def live_steps(url: str, out: Path) -> list[tuple[str, list[str]]]:
    """Short quality and speed checks against the served tiny checkpoint (random weights)."""
    return [
        ("Perplexity of the tiny model on 1,000 tokens of Python's stdlib (random weights: expect thousands)",
         ["eval", "perplexity", "--url", url, "--window", "256", "--max-tokens", "1000",
          "--out", str(out / "perplexity.json")]),
        ("Needle in a haystack, 2 lengths x 3 depths (a random model retrieves nothing: this shows the harness)",
         ["eval", "needle", "--url", url, "--lengths", "1k,2k", "--depths", "10,50,90", "--max-answer-tokens", "16",
          "--out", str(out / "needle.jsonl"), "--restart"]),
        ("KL divergence, the server against itself in both roles (a build against its reference: 0 here)",
         ["eval", "kld", "--url", url, "--reference-url", url, "--window", "256", "--max-tokens", "512",
          "--out", str(out / "kld.jsonl"), "--restart"]),
        ("HumanEval on 5 problems, each program sandboxed (random weights score 0: this shows the harness)",
         ["eval", "humaneval", "--url", url, "--problems", "0-4", "--max-tokens", "64",
          "--out", str(out / "humaneval.jsonl"), "--restart"]),
        ("Bench: 4 concurrent sessions of 1,000 prompt tokens, steady-state decode from vLLM's counter",
         ["bench", "--url", url, "--sessions", "4", "--context", "1k", "--output-tokens", "256",
          "--poll-interval", "0.2", "--out", str(out / "bench.json")]),
    ]


def run(title: str, argv: list[str]) -> int:
    print(f"\n==> {title}\n$ glmctl {shlex.join(argv)}", flush=True)
    code = subprocess.call([*GLMCTL, *argv], cwd=ROOT)
    if code != 0:
        print(f"demo step failed with exit code {code}: glmctl {shlex.join(argv)}", file=sys.stderr)
    return code


@contextlib.contextmanager
def serving(tiny: Path) -> Iterator[dict]:
    """`glmctl serve --profile tiny-cpu` in the background, as a user would start it; its ready
    document (endpoint, model, KV cache) while it runs; SIGTERM and a clean exit afterwards."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["serve", "--profile", "tiny-cpu", "--model", str(tiny), "--port", str(port), "--json"]
    print(f"\n==> Serve the tiny checkpoint on vLLM CPU (profile tiny-cpu)\n$ glmctl {shlex.join(argv)} &", flush=True)
    proc = subprocess.Popen([*GLMCTL, *argv], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        text, ready = "", None
        for line in proc.stdout:  # the ready document is the only thing glmctl prints on stdout
            text += line
            try:
                ready = json.loads(text)
                break
            except ValueError:
                continue
        if ready is None:
            raise SystemExit(f"demo step failed: glmctl serve exited with code {proc.wait()} before it was ready")
        yield ready
    finally:
        if proc.poll() is None:
            print(f"\n==> Stop the server\n$ kill -TERM {proc.pid}", flush=True)
            proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    if code != 0:
        raise SystemExit(f"demo step failed: glmctl serve exited with code {code}")
    print("glmctl serve stopped cleanly (exit code 0)")


def one_request(ready: dict) -> None:
    import httpx

    body = {"model": ready["model"], "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}
    print(f"\n==> One completion request\n$ curl {ready['endpoint']}/completions -d '{json.dumps(body)}'",
          flush=True)
    resp = httpx.post(f"{ready['endpoint']}/completions", json=body, timeout=300)
    resp.raise_for_status()
    text = resp.json()["choices"][0]["text"]
    print(f"{text!r}  (random weights: any text is right; the path from profile to plugin to API is the point)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", type=Path, required=True)
    args = ap.parse_args()
    for title, argv in steps(args.tiny):
        if code := run(title, argv):
            return code
    if importlib.util.find_spec("glmctl.plugin.activation") is None:
        print("\n==> skipped: serving the tiny checkpoint (the plugin's CPU path is not on this build yet)")
        return 0
    out = args.tiny.parent / "demo"
    with serving(args.tiny) as ready:
        one_request(ready)
        for title, argv in live_steps(ready["endpoint"].removesuffix("/v1"), out):
            if code := run(title, argv):
                return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
