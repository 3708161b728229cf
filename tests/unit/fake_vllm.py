"""A stand-in for `vllm serve` in unit tests of the supervisor (test fixture, not a product part).

It logs the start-up lines glmctl follows (shard progress, the KV cache size line), answers
GET /health like vLLM's API server, and starts a child process that ignores SIGTERM (as a stuck
worker would) and is not stopped by the server on shutdown: only the supervisor's process-group
cleanup can remove it.

    python fake_vllm.py --port N [--die-after S --exit-code C] [--never-healthy]
"""

from __future__ import annotations

import argparse
import http.server
import signal
import subprocess
import sys
import threading
import time

STUCK_CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--die-after", type=float, default=None)
    ap.add_argument("--exit-code", type=int, default=3)
    ap.add_argument("--never-healthy", action="store_true")
    args = ap.parse_args()

    subprocess.Popen([sys.executable, "-c", STUCK_CHILD])
    print(f"INFO [api_utils.py:286] non-default args: {{'port': {args.port}}}", flush=True)
    print("(Worker pid=1) Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:00<?, ?it/s]", flush=True)
    if args.die_after is not None:
        time.sleep(args.die_after)
        print("ERROR fatal: simulated start-up failure", flush=True)
        sys.exit(args.exit_code)
    print("(EngineCore pid=2) INFO [kv_cache_utils.py:2395] CPU KV cache size: 2,097,152 tokens, "
          "Maximum concurrency for 8,192 tokens per request: 256.00x", flush=True)
    print("INFO [core.py:379] init engine (profile, create kv cache, warmup model) took 0.10 s", flush=True)
    if args.never_healthy:
        time.sleep(600)

    def stop(signum, frame):
        print(f"INFO shutting down on signal {signum}", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server = http.server.HTTPServer(("127.0.0.1", args.port), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("INFO:     Application startup complete.", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
