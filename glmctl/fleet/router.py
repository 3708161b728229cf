"""vllm-router as glmctl runs it: the policy, the session header, its command line, its /workers.

What glmctl relies on, checked against the 0.1.17 wheel (`vllm-router --help`, and requests sent
through it to two servers; tests/vllm/test_fleet.py repeats the check with real vLLM servers):

- `--policy sticky_least_loaded` keys a session on the `X-Session-ID` request header (the first of
  x-session-id, x-user-id, x-tenant-id, x-correlation-id, x-request-id, x-trace-id that is set).
  A new session goes to the healthy node with the fewest sessions, each later request with the
  same id to that node. The OpenAI `user` body field does not keep a completions session on one
  node in 0.1.17 (its turns spread), so the header it is. `consistent_hash` keys on the same
  header but hashes sessions onto nodes regardless of load (4 sessions on 2 nodes may be 3 + 1).
- A node whose `/health` fails `--health-failure-threshold` checks in a row is taken out; the
  sessions it held are placed again on the least-loaded healthy node by their next request
  (their KV cache is lost with the node). A request that meets the dead node before that answers
  HTTP 500 after the router's retries; a stream cut by the node's death ends without its last
  chunk.
- The router's own `/health` answers 200 only while every node is healthy (503 "Unhealthy
  servers: [...]" otherwise); `GET /workers` lists the nodes with `is_healthy` and `load` (requests
  in flight). It forwards `/v1/*`, `/tokenize`, `/detokenize` and the headers of a request
  (Authorization included), and `/metrics` to one node only: fleet-wide numbers are summed by
  glmctl from each node's own `/metrics`. Its Prometheus metrics are on `--prometheus-port`.
- `VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S` (default 7,200) forgets a session idle that long.
- Its process renames itself `vllm::router`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from glmctl.errors import DependencyError, GlmctlError
from glmctl.serving.launch_files import local_url

VERSION = "0.1.17"
POLICY = "sticky_least_loaded"
SESSION_HEADER = "X-Session-ID"
SESSION_TTL_ENV = "VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S"
DEFAULT_PORT = 8000
DEFAULT_METRICS_PORT = 29000


class RouterUnreachable(GlmctlError):
    """The router's URL does not answer."""


@dataclass(frozen=True)
class RouterSettings:
    """The router's listening addresses and how it watches the nodes (its flags, named)."""

    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    metrics_host: str = "127.0.0.1"
    metrics_port: int = DEFAULT_METRICS_PORT
    health_check_interval_s: int = 5
    """The router's default is 60 s: a dead node's sessions would fail for minutes."""
    health_failure_threshold: int = 2
    health_success_threshold: int = 2
    health_check_timeout_s: int = 5
    worker_startup_timeout_s: int = 1800
    """How long the router waits at start for every node to be healthy (a real model loads for minutes)."""
    worker_startup_check_interval_s: int = 5
    request_timeout_s: int = 3600
    """One request in all: a 240k-token prefill takes minutes."""
    session_ttl_s: int = 7200

    @property
    def url(self) -> str:
        return local_url(self.host, self.port)

    @property
    def metrics_url(self) -> str:
        return local_url(self.metrics_host, self.metrics_port) + "/metrics"

    def argv(self, node_urls: list[str], command: list[str] | None = None) -> list[str]:
        """The router's command line; `command` replaces the `vllm-router` script (see router_entry)."""
        return [
            *(command or ["vllm-router"]), "--host", self.host, "--port", str(self.port),
            "--worker-urls", *node_urls,
            "--policy", POLICY,
            "--prometheus-host", self.metrics_host, "--prometheus-port", str(self.metrics_port),
            "--health-check-endpoint", "/health",
            "--health-check-interval-secs", str(self.health_check_interval_s),
            "--health-failure-threshold", str(self.health_failure_threshold),
            "--health-success-threshold", str(self.health_success_threshold),
            "--health-check-timeout-secs", str(self.health_check_timeout_s),
            "--worker-startup-timeout-secs", str(self.worker_startup_timeout_s),
            "--worker-startup-check-interval", str(self.worker_startup_check_interval_s),
            "--request-timeout-secs", str(self.request_timeout_s),
            "--log-level", "info",
        ]

    def env(self) -> dict[str, str]:
        return {SESSION_TTL_ENV: str(self.session_ttl_s)}


def supervised_command() -> list[str]:
    """How glmctl starts the router itself: its launcher through `glmctl.fleet.router_entry`, in
    this Python; a DependencyError naming the extra when vllm-router is not installed."""
    import importlib.util

    if importlib.util.find_spec("vllm_router") is None:
        raise DependencyError(
            f"glmctl fleet runs the vLLM project's router, vllm-router {VERSION}, which is not installed here",
            hint="pip install 'glmctl[fleet]' (or: pip install vllm-router==" + VERSION + ")",
        )
    return [sys.executable, "-m", "glmctl.fleet.router_entry"]


def installed_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("vllm-router")
    except md.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class RouterWorker:
    url: str
    healthy: bool
    load: int | None
    """Requests the router has in flight on the node."""


def router_workers(base_url: str, *, headers: dict | None = None, timeout: float = 10.0) -> list[RouterWorker] | None:
    """The nodes behind a vllm-router at `base_url`, or None when `base_url` is not one (a plain
    vLLM server answers /workers with 404)."""
    import httpx

    url = base_url.rstrip("/") + "/workers"
    try:
        response = httpx.get(url, headers=headers or {}, timeout=timeout)
    except httpx.HTTPError as exc:
        raise RouterUnreachable(f"{url} did not answer ({type(exc).__name__}: {exc})",
                                hint="is the router running there? (glmctl fleet up prints its URL)") from exc
    if response.status_code != 200:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    rows = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("url"), str) for r in rows):
        return None
    return [RouterWorker(url=r["url"].rstrip("/"), healthy=bool(r.get("is_healthy")),
                         load=r["load"] if isinstance(r.get("load"), int) else None) for r in rows]
