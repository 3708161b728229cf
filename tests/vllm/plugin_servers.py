"""A real `vllm serve` of the tiny checkpoint with the glmctl plugin, for the plugin's vllm-lane tests.

Launched exactly as glmctl launches vLLM (`python -m glmctl.serving.vllm_entry serve ...`), on a
free port, with its log in a file; `stop()` ends the process group it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from glmctl.serving.server import free_port

STARTUP_TIMEOUT_S = 420  # ~30 s alone on 2 cores; the CI machine may be busy


class ServerHttp:
    """Requests to a test server at `self.base_url` (no /v1) and its log at `self.log_path`."""

    base_url: str
    log_path: Path

    def get(self, path: str, timeout: float = 60) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return r.read().decode()

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Server(ServerHttp):
    url: str
    proc: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return self.url

    @property
    def log_path(self) -> Path:
        return self.log

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def start_server(model: Path, log: Path, *extra: str, env: dict | None = None) -> Server:
    port = free_port()
    cmd = [
        sys.executable, "-m", "glmctl.serving.vllm_entry", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--max-model-len", "4096", "--enforce-eager", "--max-logprobs", "-1",
        "--served-model-name", "tiny", *extra,
    ]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "GLMCTL_PLUGIN": "auto", **(env or {})}
    full_env.pop("GLMCTL_PLUGIN_ACTIVE", None)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{server.log_text()[-6000:]}")
        try:
            if server.get("/health", timeout=5) is not None:
                return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    server.stop()
    raise RuntimeError(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{server.log_text()[-6000:]}")
