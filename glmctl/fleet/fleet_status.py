"""`glmctl fleet status --url ROUTER`: each node's health, sessions and KV use, from its /metrics.

The router says which nodes it routes to and whether it counts each healthy (`GET /workers`);
each node is then asked itself: `/health`, and `/metrics` for the requests it is running and
holding in its queue (a session is in the engine while one of its turns is), its KV cache use and
the requests it has finished. All nodes are asked at once, each request within `timeout`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, computed_field

from glmctl.errors import GlmctlError, UsageError
from glmctl.fleet.router import POLICY, SESSION_HEADER, router_workers


class NodeStatus(BaseModel):
    url: str
    routed: bool  # the router counts it healthy (it sends it sessions)
    healthy: bool  # it answered /health with 200 just now
    error: str | None = None
    running: int | None = None  # requests decoding or prefilling (vllm:num_requests_running)
    waiting: int | None = None  # requests queued (vllm:num_requests_waiting)
    kv_usage: float | None = None  # fraction of its KV blocks in use, 0..1
    requests_finished: int | None = None  # vllm:request_success_total
    router_load: int | None = None  # requests the router has in flight on it

    @computed_field
    @property
    def sessions(self) -> int | None:
        """Requests in its engine: running + waiting."""
        return None if self.running is None else self.running + (self.waiting or 0)


class FleetStatus(BaseModel):
    router: str
    policy: str = POLICY
    session_header: str = SESSION_HEADER
    nodes: list[NodeStatus]
    healthy_nodes: int
    sessions: int  # in the engines of the healthy nodes now

    @computed_field
    @property
    def all_healthy(self) -> bool:
        return self.healthy_nodes == len(self.nodes)


def _node(url: str, routed: bool, load: int | None, headers: dict, timeout: float) -> NodeStatus:
    import httpx

    from glmctl.evals.metrics import parse_metrics

    status = NodeStatus(url=url, routed=routed, healthy=False, router_load=load)
    try:
        health = httpx.get(f"{url}/health", headers=headers, timeout=timeout)
        status.healthy = health.status_code == 200
        if not status.healthy:
            status.error = f"/health answered HTTP {health.status_code}"
            return status
        metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        status.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return status
    if metrics.status_code != 200:
        status.error = f"/metrics answered HTTP {metrics.status_code}"
        return status
    try:
        sample = parse_metrics(metrics.text)
    except GlmctlError as exc:
        status.error = exc.message
        return status
    status.running, status.waiting = int(sample.running), int(sample.waiting)
    status.kv_usage, status.requests_finished = sample.kv_usage, int(sample.requests_finished)
    return status


def fleet_status(router_url: str, *, headers: dict | None = None, timeout: float = 10.0) -> FleetStatus:
    base = router_url.rstrip("/")
    workers = router_workers(base, headers=headers, timeout=timeout)
    if workers is None:
        raise UsageError(f"{base} is not a vllm-router: GET /workers does not list nodes",
                         hint="pass the router's URL (glmctl fleet up prints it); for one server use its own "
                              "/metrics, glmctl bench or glmctl eval")
    with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
        nodes = list(pool.map(lambda w: _node(w.url, w.healthy, w.load, headers or {}, timeout), workers))
    healthy = [n for n in nodes if n.healthy and n.routed]
    return FleetStatus(router=base, nodes=nodes, healthy_nodes=len(healthy),
                       sessions=sum(n.sessions or 0 for n in healthy))
